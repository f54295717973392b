"""Files written from ``generate(copy=False)`` views hold one sample, not the batch around it."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch", reason="the layouts encode torch tensors")

from speccompat.dataset.formats import owned  # noqa: E402
from speccompat.dataset.layouts import layout_named  # noqa: E402
from speccompat.dataset.spec import StoredSpec  # noqa: E402


def test_owned_clones_views_and_keeps_owners():
    batch = torch.randn(4, 1000, 64).to(torch.bfloat16)
    view = batch[2, 100:150]
    kept = owned(view)
    assert torch.equal(kept, view) and kept.untyped_storage().nbytes() == 50 * 64 * 2
    whole = torch.randn(50, 64)
    assert owned(whole) is whole


def test_speculators_layout_of_a_view_saves_only_the_sample():
    class Sample:
        input_ids, loss_mask, num_tokens = list(range(50)), None, 50

    batch = torch.randn(2, 5000, 64).to(torch.bfloat16)  # 1.3 MB of "batch"
    views = [batch[0, 300:350], batch[1, 300:350]]
    layout = layout_named("speculators", [3, 5])
    named = layout.tensors(Sample(), views, StoredSpec("bfloat16", (3, 5), 64))
    obj = layout.encode(named, {}).trailer
    f = io.BytesIO()
    torch.save(obj, f)
    assert f.tell() < 3 * 50 * 64 * 2 + 8192  # the two [50, 64] states and the ids, not the batch
    back = torch.load(io.BytesIO(f.getvalue()))
    assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], views, strict=True))
