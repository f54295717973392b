"""Tensor parallelism on the real engine: two worker processes (vLLM's CPU platform, gloo), the
states come from rank 0 only, once, full width, and match transformers."""

from __future__ import annotations

import pytest

from speccompat.testing.parity import measure, violations

from .conftest import LAYER_IDS, mixed_sequences, skip_unless_model_runs

pytestmark = pytest.mark.engine

#: vLLM's CPU platform binds each worker's threads to its own cores; with two cores that is one each.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


#: The gate runs TP 2 on the model with the most to split (MLA, MoE); Llama on both lines is engine_full.
@pytest.mark.pool(variant="tp2")
@pytest.mark.parametrize(("speculators", "kind"), [pytest.param("0.3.0", "llama", marks=pytest.mark.engine_full),
                                                   pytest.param("0.4.0.1", "llama", marks=pytest.mark.engine_full),
                                                   ("0.4.0.1", "deepseek_v3")])
def test_tp2_parity_from_one_rank(engines, references, record_cell, speculators, kind):
    import torch

    skip_unless_model_runs(kind)
    host = engines.get(speculators, kind, tp=2, env=None if torch.cuda.is_available() else TP2_ENV)
    seqs = mixed_sequences(40, seed=31, lo=20, hi=300)
    out = host.generate(seqs)
    results = out["results"]
    status = host.status()
    assert len(status["workers"]) == 2 and len({w["pid"] for w in status["workers"]}) == 2
    assert len(results) == len(seqs)
    for res, seq in zip(results, seqs, strict=True):
        assert res["input_ids"].tolist() == seq
        assert [tuple(h.shape) for h in res["hidden_states"]] == [(len(seq), 256)] * len(LAYER_IDS)
    ref32, ref16 = references(kind)
    cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                    [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
    bad = violations(cases)
    record_cell(speculators=speculators, model=kind, test="parity-tp2", tp=2, sequences=len(seqs),
                tokens=sum(map(len, seqs)), layer_ids=LAYER_IDS, outcome="failed" if bad else "passed",
                worst_rel=round(max(c.got.rel for c in cases), 5),
                worst_min_cos=round(min(c.got.min_cos for c in cases), 5), seconds=round(out["seconds"], 3))
    assert not bad, "\n".join(bad[:10])
