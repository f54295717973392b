"""``--format speculators-arrow`` from the real driver on the CPU engine, read by speculators 0.9.0's
and 0.6.0's own ``ArrowDataset`` (from the released wheels): for a dense model (Llama) and Kimi-K2.5's
tiny stand-in, every row the trainer builds is tensor-equal to what speculators' generator returned
for the same batches (an engine of the shared pool, same checkpoint and layers). One driver run per model;
Llama's is engine_full (``nox -s engine_full``): the gate runs Kimi-K2.5's, through the same layout code."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from .conftest import LAYER_IDS, skip_unless_model_runs
from .test_kimi_driver import EXAMPLE, REPO, TIMEOUT, _env, checkpoint_vocab, random_ids, write_jsonl

pytestmark = pytest.mark.engine

#: The trainer's items, saved for the comparison (tensor-equal: torch.save keeps them bit for bit).
CHILD = textwrap.dedent('''
    import sys, torch
    data = import_loader(__import__("pathlib").Path(sys.argv[1]))
    d = data.ArrowDataset(max_len=4096, datapath=sys.argv[2], on_missing="raise")
    items = [d[k] for k in range(len(d))]
    torch.save([{k: v for k, v in it.items()} for it in items], sys.argv[3])
    print(len(items))
''')


@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.engine_full), "kimi_k25"])
def test_driver_speculators_arrow_is_read_by_speculators_09_and_06_loaders(engines, tmp_path, kind):
    import torch
    from support.trainer_wheels import run_trainer_child

    pytest.importorskip("datasets", reason="--format speculators-arrow needs `datasets` (speccompat[arrow])")
    skip_unless_model_runs(kind)
    model = engines.checkpoint(kind)
    _vocab, words = checkpoint_vocab(model)
    rng = random.Random(11)
    seqs = [random_ids(rng, n, words) for n in (37, 90, 12, 64, 5)]
    data = write_jsonl(tmp_path / "data.jsonl", [json.dumps({"id": f"q{k}", "input_ids": s, **(
        {"loss_mask": [0] * 3 + [1] * (len(s) - 3)} if k % 2 else {})}) for k, s in enumerate(seqs)])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "extract_hidden_states.py"), "--model-path", str(model),
         "--prepared-data", str(data), "--output-dir", str(out), "--layer-ids", *map(str, LAYER_IDS),
         "--max-seq-len", "1023", "--batch-size", "2", "--tp-size", "1", "--gpu-memory-utilization", "0.1",
         "--format", "speculators-arrow"],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT, cwd=REPO)
    (tmp_path / "driver.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    v = subprocess.run([sys.executable, "-m", "speccompat", "verify", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert v.returncode == 0, v.stdout + v.stderr

    # what speculators' generator returns for the same batches, on an engine of the shared pool
    host = engines.get("0.4.0.1", kind)  # max_model_len 1024, as the driver's (--max-seq-len 1023)
    want = []
    for k in range(0, len(seqs), 2):
        want += host.generate(seqs[k:k + 2])["results"]
    for version in ("0.9.0", "0.6.0"):
        saved = tmp_path / f"items-{version}.pt"
        run_trainer_child(CHILD, version, [str(out), str(saved)])
        items = torch.load(saved)
        assert len(items) == len(seqs)
        for k, (item, ref, s) in enumerate(zip(items, want, seqs, strict=True)):
            hs = [h.to(torch.bfloat16) for h in ref["hidden_states"]]
            assert item["input_ids"].tolist() == s, (version, k)
            mask = [0] * 3 + [1] * (len(s) - 3) if k % 2 else [1] * len(s)
            assert item["loss_mask"].tolist() == mask, (version, k)
            assert torch.equal(item["hidden_states"], torch.cat(hs[:-1], dim=-1)), (version, k)
            assert torch.equal(item["verifier_last_hidden_states"], hs[-1]), (version, k)
