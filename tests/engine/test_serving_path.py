"""Serving-path parity: speccompat's layer i is what vLLM serves an EAGLE-3 draft as aux id i + 1.

The oracle is vLLM's own aux-hidden-state path (``SupportsEagle3.set_aux_hidden_state_layers``, the
model's own forward returning ``(hidden_states, aux)``: what EAGLE-3 serving and
``extract_hidden_states`` read), run by a plain engine without speculators or speccompat
(speccompat.testing.serving), on the same tiny checkpoint and sequences. This decides, where
transformers and vLLM disagree (gpt-oss), whether the capture or the engine differs.

Both sides run one sequence per forward. Each case must be bit-equal, or within the engine's own
run-to-run noise of that case: the same generator's states of that sequence when it is batched
with the others (another batch composition, other kernel blockings).

Where vLLM's model class has no aux path (no ``SupportsEagle3`` in vLLM 0.32.0: ``gemma3.py:367``
``Gemma3ForCausalLM(nn.Module, SupportsLoRA, SupportsPP)``, ``glm4_moe.py:534`` ``Glm4MoeForCausalLM(nn.Module,
SupportsPP, SupportsLoRA, Glm4MixtureOfExperts)``; vLLM cannot serve an EAGLE-3 draft for them), the oracle
is the plain engine's decoder layers read by forward hooks (``--layer-hooks``): vLLM's own computation
without speculators or speccompat.

Llama runs in the CI gate (one extra plain engine; its generator engine is the pool's). The other
architectures need their own engines: marker ``engine_full`` (``nox -s engine_full``, ``pytest --engine-full``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.engine_env import ENGINE_ENV

from speccompat.testing.parity import compare
from speccompat.testing.serving import agreement

from .conftest import LAYER_IDS, ORACLE_ENV, mixed_sequences, skip_unless_model_runs
from .test_architectures import CELLS, write_arch_evidence

pytestmark = pytest.mark.engine

_FULL = [pytest.mark.engine_full]


#: Tiny checkpoints whose vLLM model class has no aux hidden-state path (see the module doc).
NO_AUX_PATH = ("gemma3", "glm4_moe")
#: The architectures whose serving-path cases leave the gate (each needs its own engines).
FULL_KINDS = ("qwen3", "deepseek_v3", "kimi_k25", "gpt_oss", "mistral", "qwen3_moe", "gemma3", "glm4_moe", "llama4")


def serving_states(model, aux_ids: list[int], seqs: list[list[int]], tmp_path, log, *, layer_hooks=False,
                   max_model_len: int = 1024, max_num_batched_tokens: int = 0) -> dict:
    """Run vLLM's own aux path on ``model`` in a plain engine process (speccompat.testing.serving)."""
    import torch

    seq_file, out = tmp_path / "sequences.json", tmp_path / "serving.pt"
    seq_file.write_text(json.dumps(seqs))
    env = {**os.environ, **ENGINE_ENV.get("engine_env", {}), **ORACLE_ENV}
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "speccompat.testing.serving", "--model", str(model),
                               "--aux-ids", *map(str, aux_ids), "--sequences", str(seq_file), "--out", str(out),
                               "--max-model-len", str(max_model_len),
                               "--max-num-batched-tokens", str(max_num_batched_tokens),
                               *(["--layer-hooks"] if layer_hooks else [])],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=1200)
    assert proc.returncode == 0, f"the serving-path engine failed (see {log})"
    return torch.load(out)


@pytest.mark.pool
@pytest.mark.own_engines(1)  # the plain engine of vLLM's own aux path
@pytest.mark.parametrize("kind", ["llama", *(pytest.param(k, marks=_FULL) for k in FULL_KINDS)])
def test_capture_equals_vllms_aux_hidden_states(engines, tmp_path, kind):

    skip_unless_model_runs(kind)
    seqs = mixed_sequences(12, seed=7)
    aux_ids = [i + 1 for i in LAYER_IDS]
    from speccompat.testing.models import RECIPES

    engine = RECIPES[kind].engine
    host = engines.get("0.4.0.1", kind, **engine)
    single = [host.generate([s])["results"][0] for s in seqs]
    batched = host.generate(seqs)["results"]
    served = serving_states(engines.checkpoint(kind), aux_ids, seqs, tmp_path, tmp_path / "serving.log",
                            layer_hooks=kind in NO_AUX_PATH, **engine)

    assert served["aux_ids"] == aux_ids
    assert len(served["results"]) == len(seqs)
    for seq, cap, srv in zip(seqs, single, served["results"], strict=True):
        assert srv["input_ids"].tolist() == seq and cap["input_ids"].tolist() == seq
        assert srv["forwards"] == 1, "a sequence was not one prefill"
    result = agreement(LAYER_IDS, single, batched, served["results"])
    assert result.cases == len(seqs) * len(LAYER_IDS)
    off = result.off
    CELLS.append({"speculators": "0.4.0.1", "model": kind, "architecture": RECIPES[kind].architecture,
                  "test": "serving-path", "oracle": f"vLLM {served['oracle']} ({served['model_class']})",
                  "layer_ids": LAYER_IDS, "aux_ids": aux_ids, "sequences": len(seqs),
                  "outcome": "failed" if off else "passed", "bit_equal_cases": f"{result.bit_equal}/{result.cases}",
                  "worst_rel": float(f"{result.worst_rel:.3g}")})
    write_arch_evidence()
    assert not off, f"{served['model_class']}: {len(off)} cases differ:\n" + "\n".join(off[:12])
    # the oracle can fail: layer i against aux id i + 2 (the next layer's output) is far off
    wrong = compare(single[0]["hidden_states"][1], served["results"][0]["hidden_states"][2]).rel
    assert wrong > 0.05, wrong
