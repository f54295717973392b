"""Input checks and result validation of the fixed generate() (no engine needed: pure functions)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="result validation handles torch tensors")

from speccompat.errors import HiddenStatesError  # noqa: E402
from speccompat.generator import normalize_token_ids, validate_results  # noqa: E402


def norm(x, vocab=100, max_len=10):
    return normalize_token_ids(x, vocab_size=vocab, max_len=max_len)


def test_accepts_lists_tuples_tensors_and_numpy_like_ints():
    import numpy as np

    seqs, truncated = norm([[1, 2], (3, 4, 5), torch.tensor([6]), np.array([7, 8])])
    assert seqs == [[1, 2], [3, 4, 5], [6], [7, 8]] and truncated == []
    assert norm(torch.tensor([[1, 2], [3, 4]]))[0] == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ([], ValueError, "token_ids is empty"),
        ([[1], []], ValueError, "sequence 1 is empty"),
        ([[1, 2.0]], TypeError, r"sequence 0, position 1: token id 2.0 is not an integer"),
        ([[1, True]], TypeError, "position 1: token id True is not an integer"),
        ([[1, "2"]], TypeError, "is not an integer"),
        ([[1, -1]], ValueError, r"token id -1 outside the vocabulary \[0, 100\)"),
        ([[1, 100]], ValueError, "token id 100 outside the vocabulary"),
        ("12", TypeError, "must be a list of token id sequences"),
        ([5, 6], TypeError, "sequence 0: expected a list of token ids, got int"),
        (torch.tensor([1, 2]), ValueError, "must be 2-D"),
        (torch.tensor([[1.0]]), TypeError, "must hold integers"),
    ],
)
def test_bad_input_is_rejected_naming_the_problem(bad, error, match):
    with pytest.raises(error, match=match):
        norm(bad)


def test_overlong_sequences_are_truncated_and_reported():
    seqs, truncated = norm([[1] * 12, [2] * 3, [3] * 10], max_len=10)
    assert [len(s) for s in seqs] == [10, 3, 10] and truncated == [0]


def results_for(seqs, layers=2, hidden=4):
    return [
        {"input_ids": torch.tensor(s), "hidden_states": [torch.ones(len(s), hidden) for _ in range(layers)],
         "loss_mask": None}
        for s in seqs
    ]


def test_validation_accepts_matching_results():
    seqs = [[1, 2, 3], [4]]
    validate_results(results_for(seqs), seqs, layer_ids=[3, 7], hidden=4)


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda r: r.pop(), "1 results for 2 sequences"),
        (lambda r: r.reverse(), "sequence 0: input_ids differ from the input"),
        (lambda r: r[1]["hidden_states"].pop(), "sequence 1: 1 layers, expected 2"),
        (lambda r: r[0]["hidden_states"].__setitem__(1, torch.ones(2, 4)), r"sequence 0, layer 7: shape \(2, 4\)"),
        (lambda r: r[0]["hidden_states"][0].__setitem__((1, 2), float("nan")),
         "sequence 0, layer 3: non-finite values in 1 of 3 tokens"),
        (lambda r: r[1]["hidden_states"][1].__setitem__((0, 0), float("inf")), "sequence 1, layer 7: non-finite"),
    ],
)
def test_validation_names_the_sequence_and_layer(corrupt, match):
    seqs = [[1, 2, 3], [4]]
    res = results_for(seqs)
    corrupt(res)
    with pytest.raises(HiddenStatesError, match=match):
        validate_results(res, seqs, layer_ids=[3, 7], hidden=4)


@pytest.mark.parametrize(
    ("layer_ids", "error", "match"),
    [([1, 2.5], TypeError, r"layer_ids must be ints, got \[2.5\]"), ([1, True], TypeError, "must be ints"),
     ([3, 1, 3], ValueError, r"duplicate layer ids \[3\]"), ([], ValueError, "layer_ids is empty"),
     ("1,2", TypeError, "must be a list of ints")],
)
def test_bad_layer_ids_are_rejected_before_the_original_init_runs(layer_ids, error, match):
    from speccompat.generator import wrap_init

    called = []
    with pytest.raises(error, match=match):
        wrap_init(lambda *a, **k: called.append(1), None, ("model",), {"layer_ids": layer_ids})
    assert called == []
    wrap_init(lambda *a, **k: called.append(1), None, ("model", [0, 2]), {})
    assert called == [1]
