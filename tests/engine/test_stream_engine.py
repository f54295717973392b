"""``speccompat.generator.stream`` on a real engine: the same states as ``generate()``, sequence by
sequence, whether ``generate()`` runs on top of the stream or as one call, and with fewer sequences in
flight than the input holds (requests admitted while others run)."""

from __future__ import annotations

import pytest

from .conftest import mixed_sequences

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("speculators", ["0.3.0", "0.4.0.1"])
def test_stream_equals_generate(engines, speculators):
    import torch

    seqs = mixed_sequences(10, seed=29, lo=5, hi=400)
    host = engines.get(speculators, "llama")
    call = host.call("generate", token_ids=seqs, mode="call")["results"]
    on_stream = host.call("generate", token_ids=seqs, mode="stream")
    assert on_stream["stats"]["mode"] == "stream" and on_stream["stats"]["unverified_steps"] == 0
    for bound in (None, 3):
        out = host.call("stream", token_ids=seqs, options={"max_in_flight_sequences": bound, "copy": True})
        assert sorted(i for i, _ in out["items"]) == list(range(len(seqs)))
        streamed = dict(out["items"])
        for i, seq in enumerate(seqs):
            ref = call[i]["hidden_states"]
            assert on_stream["results"][i]["input_ids"].tolist() == seq
            for layer, (a, b, c) in enumerate(zip(ref, on_stream["results"][i]["hidden_states"], streamed[i],
                                                  strict=True)):
                assert a.shape == (len(seq), 256)
                assert torch.equal(a, b), f"sequence {i}, layer {layer}: generate() differs between modes"
                assert torch.equal(a, c), f"sequence {i}, layer {layer}: stream(bound={bound}) differs"
