"""speccompat's layer i equals what vLLM's own ``extract_hidden_states`` writes for aux id i + 1.

``extract_hidden_states`` (vLLM >= 0.18, PR #33736) is the extraction path of speculators >= 0.5 and
NVIDIA Model-Optimizer; its aux ids are what ``eagle_aux_hidden_state_layer_ids`` serves a draft.
The oracle (speccompat.testing.serving ``--native``) runs it in a plain engine, one request per
sequence, and reads back what ``ExampleHiddenStatesConnector`` wrote; speccompat's generator runs
speculators 0.4.0.1 on the same tiny checkpoint and sequences. Each case must be bit-equal or
within the generator's own run-to-run noise (the sequence alone vs batched with the others).

The connector's write-out uses CUDA streams: these cases run on GPUs only (``engine_full``; on the
GPU machine with ``--engine-full``, see docs/gpu.md). Results go into the run's evidence file
(test ``native-extract``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.engine_env import ENGINE_ENV

from speccompat.testing.serving import agreement

from .conftest import LAYER_IDS, mixed_sequences, skip_unless_model_runs

pytestmark = [pytest.mark.engine, pytest.mark.engine_full]


def native_states(model, aux_ids: list[int], seqs: list[list[int]], tmp_path) -> dict:
    import torch

    seq_file, out, log = tmp_path / "sequences.json", tmp_path / "native.pt", tmp_path / "native.log"
    seq_file.write_text(json.dumps(seqs))
    env = {**os.environ, **ENGINE_ENV.get("engine_env", {})}
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "speccompat.testing.serving", "--native", "--model", str(model),
                               "--aux-ids", *map(str, aux_ids), "--sequences", str(seq_file), "--out", str(out)],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900)
    assert proc.returncode == 0, f"vLLM's extract_hidden_states failed:\n{log.read_text()[-3000:]}"
    return torch.load(out)


@pytest.mark.pool
@pytest.mark.own_engines(1)  # the plain engine of vLLM's extract_hidden_states
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt_oss", "deepseek_v3", "kimi_k25"])
def test_capture_equals_vllms_extract_hidden_states(engines, tmp_path, record_cell, kind):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vLLM's ExampleHiddenStatesConnector writes through CUDA streams: GPU only")
    skip_unless_model_runs(kind)
    seqs = mixed_sequences(12, seed=11)
    aux_ids = [i + 1 for i in LAYER_IDS]
    host = engines.get("0.4.0.1", kind)
    single = [host.generate([s])["results"][0] for s in seqs]
    batched = host.generate(seqs)["results"]
    native = native_states(engines.checkpoint(kind), aux_ids, seqs, tmp_path)

    assert native["aux_ids"] == aux_ids and len(native["results"]) == len(seqs)
    for seq, cap, nat in zip(seqs, single, native["results"], strict=True):
        assert nat["input_ids"].tolist() == seq == cap["input_ids"].tolist()
    result = agreement(LAYER_IDS, single, batched, native["results"])
    record_cell(speculators="0.4.0.1", model=kind, test="native-extract", oracle=native["model_class"],
                layer_ids=LAYER_IDS, aux_ids=aux_ids, sequences=len(seqs),
                outcome="failed" if result.off else "passed",
                bit_equal_cases=f"{result.bit_equal}/{result.cases}", worst_rel=float(f"{result.worst_rel:.3g}"))
    assert result.cases == len(seqs) * len(LAYER_IDS)
    assert not result.off, f"{native['model_class']}: {len(result.off)} cases differ:\n" + "\n".join(result.off[:12])
    # the oracle can fail: layer i against aux id i + 2 (the next layer's output) is far off
    from speccompat.testing.parity import compare

    assert compare(single[0]["hidden_states"][1], native["results"][0]["hidden_states"][2]).rel > 0.05
