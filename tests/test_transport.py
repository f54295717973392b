"""The worker-to-driver transport of packed hidden states (shared-memory file or inline)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="the transport moves torch tensors")

from speccompat import transport  # noqa: E402


@pytest.mark.parametrize("tokens", [3, 5000])
def test_round_trip_is_exact_and_leaves_no_file(tokens):
    layers = [torch.randn(tokens, 256).to(torch.bfloat16) for _ in range(4)]
    desc = transport.pack(layers)
    assert ("file" in desc) == (tokens * 256 * 2 * 4 > transport.INLINE_LIMIT)
    out = transport.unpack(desc)
    assert out.shape == (4, tokens, 256) and out.dtype == torch.bfloat16
    for i, t in enumerate(layers):
        assert torch.equal(out[i], t)
    if "file" in desc:
        assert not os.path.exists(desc["file"])


def test_a_failed_pack_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(transport, "_SHM", str(tmp_path))
    monkeypatch.setattr(transport, "INLINE_LIMIT", 0)

    good = torch.ones(10, 8)
    bad = torch.ones(10, 8)
    with pytest.raises(RuntimeError):
        transport.pack([good, bad.view(8, 10)])  # shape mismatch while copying
    assert list(tmp_path.iterdir()) == []


def test_a_small_dev_shm_falls_back_to_inline(monkeypatch):
    monkeypatch.setattr(transport, "_shm_has_room", lambda nbytes: False)
    layers = [torch.ones(5000, 256) for _ in range(4)]
    desc = transport.pack(layers)
    assert "inline" in desc and torch.equal(transport.unpack(desc)[3], layers[3])
