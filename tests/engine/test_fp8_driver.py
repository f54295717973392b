"""``--dtype fp8 --format speculators-arrow`` from the real driver on the CPU engine, read by
speculators 0.9.0's own ``ArrowDataset`` with hs-connectors 0.9.0's ``FP8Transfer`` (the released
wheels): per row, the trainer's draft input and verifier state are exactly the dequantized fp8 of
what speculators' generator returned for the same batches (an engine of the shared pool, same
checkpoint and layers), and that is the bf16 states within fp8's rounding. One driver run per model;
Llama's is engine_full (``nox -s engine_full``): the gate runs Kimi-K2.5's, through the same fp8 code."""

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

CHILD = textwrap.dedent('''
    import sys, torch
    from pathlib import Path
    data = import_loader(Path(sys.argv[1]))
    from hs_connectors.transfer import FP8Transfer
    d = data.ArrowDataset(max_len=4096, datapath=sys.argv[2], on_missing="raise",
                          transfer=FP8Transfer(Path(sys.argv[2]) / "hidden_states"))
    items = [d[k] for k in range(len(d))]
    torch.save([{k: v for k, v in it.items()} for it in items], sys.argv[3])
    print(len(items))
''')


@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.engine_full), "kimi_k25"])
def test_driver_fp8_is_read_by_speculators_09_fp8_transfer(engines, tmp_path, kind):
    import torch
    from support.fp8_checks import rel_err, within_fp8
    from support.trainer_wheels import run_trainer_child

    from speccompat.dataset.fp8 import dequantize, quantize

    pytest.importorskip("datasets", reason="--format speculators-arrow needs `datasets` (speccompat[arrow])")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    skip_unless_model_runs(kind)
    model = engines.checkpoint(kind)
    _vocab, words = checkpoint_vocab(model)
    rng = random.Random(13)
    seqs = [random_ids(rng, n, words) for n in (41, 88, 9, 70)]
    data = write_jsonl(tmp_path / "data.jsonl", [json.dumps({"id": f"q{k}", "input_ids": s})
                                                 for k, s in enumerate(seqs)])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "extract_hidden_states.py"), "--model-path", str(model),
         "--prepared-data", str(data), "--output-dir", str(out), "--layer-ids", *map(str, LAYER_IDS),
         "--max-seq-len", "1023", "--tp-size", "1", "--gpu-memory-utilization", "0.1",
         "--format", "speculators-arrow", "--dtype", "fp8"],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT, cwd=REPO)
    (tmp_path / "driver.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    v = subprocess.run([sys.executable, "-m", "speccompat", "verify", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert v.returncode == 0, v.stdout + v.stderr
    header = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert header["provenance"]["hidden_states"]["fp8"]["scale"] == "token"

    host = engines.get("0.4.0.1", kind)  # max_model_len 1024, as the driver's (--max-seq-len 1023)
    want = []
    for k in range(0, len(seqs), 2):
        want += host.generate(seqs[k:k + 2])["results"]
    saved = tmp_path / "items.pt"
    run_trainer_child(CHILD, "0.9.0", [str(out), str(saved)])
    items = torch.load(saved)
    assert len(items) == len(seqs)
    worst = 0.0
    for k, (item, ref, s) in enumerate(zip(items, want, seqs, strict=True)):
        hs = [h.to(torch.bfloat16) for h in ref["hidden_states"]]
        q, scale = quantize(hs, "token", stack=True)
        deq = dequantize(q, scale, torch.bfloat16)
        assert item["input_ids"].tolist() == s, k
        assert torch.equal(item["hidden_states"], deq[:, :-1].flatten(1)), k
        assert torch.equal(item["verifier_last_hidden_states"], deq[:, -1]), k
        assert within_fp8(item["hidden_states"], torch.cat(hs[:-1], dim=-1), scale[:, 0]), k
        assert within_fp8(item["verifier_last_hidden_states"], hs[-1], scale[:, 0]), k
        worst = max(worst, rel_err(item["hidden_states"], torch.cat(hs[:-1], dim=-1)),
                    rel_err(item["verifier_last_hidden_states"], hs[-1]))
    assert 0 < worst < 0.05, worst
