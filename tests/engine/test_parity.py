"""The proof of a cell: speculators' own generator, under speccompat, on a real vLLM engine,
against transformers on the same tiny checkpoint (45 mixed-length sequences, 4 layers including
the last). Thresholds are relative to the measured bf16 noise of each case: docs/parity.md."""

from __future__ import annotations

import pytest

from speccompat.testing.parity import measure, violations

from .conftest import KINDS, LAYER_IDS, SPECULATORS, mixed_sequences, skip_unless_model_runs

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("speculators", SPECULATORS)
def test_parity_with_transformers(engines, references, record_cell, speculators, kind):
    skip_unless_model_runs(kind)
    seqs = mixed_sequences(45, seed=7)
    host = engines.get(speculators, kind)
    out = host.generate(seqs)
    results = out["results"]

    # Count, order and shapes, before any numerics.
    assert len(results) == len(seqs)
    hidden = 256
    for res, seq in zip(results, seqs, strict=True):
        assert res["input_ids"].tolist() == seq
        assert len(res["hidden_states"]) == len(LAYER_IDS)
        for h in res["hidden_states"]:
            assert tuple(h.shape) == (len(seq), hidden)

    ref32, ref16 = references(kind)
    cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                    [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
    bad = violations(cases)
    worst = max(cases, key=lambda c: c.got.rel)
    record_cell(speculators=speculators, model=kind, test="parity", sequences=len(seqs),
                tokens=sum(map(len, seqs)), layer_ids=LAYER_IDS, outcome="failed" if bad else "passed",
                worst_rel=round(worst.got.rel, 5), worst_min_cos=round(min(c.got.min_cos for c in cases), 5),
                max_bad_tokens=round(max(c.bad_tokens for c in cases), 4),
                seconds=round(out["seconds"], 3), stats=out["stats"])
    assert not bad, f"{len(bad)} of {len(cases)} cases off:\n" + "\n".join(bad[:15])


def test_thresholds_reject_a_wrong_layer_and_a_wrong_sequence(engines, references):
    """The parity check can fail: the same results against the neighbouring layer's reference,
    or against another sequence's reference, are rejected in every case."""
    kind = "llama"
    seqs = mixed_sequences(6, seed=11, lo=40, hi=200)
    results = engines.get("0.4.0.1", kind).generate(seqs)["results"]
    ref32, ref16 = references(kind)
    shifted = [layer + 1 for layer in LAYER_IDS[:-1]]
    wrong_layer = measure(
        [{"hidden_states": r["hidden_states"][:-1]} for r in results],
        [ref32.hidden_states(s, shifted) for s in seqs],
        [ref16.hidden_states(s, shifted) for s in seqs],
    )
    assert len(violations(wrong_layer)) == len(wrong_layer)
    # another sequence of the same length: take each sequence's own prefix of the next one's states
    rotated = seqs[1:] + seqs[:1]
    cross = []
    for res, other in zip(results, rotated, strict=True):
        n = min(len(other), res["input_ids"].numel())
        cross.append(([h[:n] for h in res["hidden_states"]], other[:n]))
    wrong_seq = measure(
        [{"hidden_states": h} for h, _ in cross],
        [ref32.hidden_states(o, LAYER_IDS) for _, o in cross],
        [ref16.hidden_states(o, LAYER_IDS) for _, o in cross],
    )
    assert len(violations(wrong_seq)) == len(wrong_seq)
