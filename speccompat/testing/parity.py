"""Comparison metrics between extracted hidden states and the reference, per sequence and layer."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Agreement", "compare"]


class Agreement(NamedTuple):
    """How closely one [tokens, hidden] tensor matches its reference.

    ``rel``: Frobenius relative error ||a - r|| / ||r||. ``min_cos``: the smallest per-token cosine
    similarity (one bad token shows here even when the average is fine). ``mean_cos``: the mean.
    """

    rel: float
    min_cos: float
    mean_cos: float


def compare(got: Any, ref: Any) -> Agreement:
    import torch

    a, r = got.float(), ref.float()
    if a.shape != r.shape:
        raise ValueError(f"shape {tuple(a.shape)} != reference {tuple(r.shape)}")
    rel = (torch.linalg.vector_norm(a - r) / torch.linalg.vector_norm(r).clamp_min(1e-12)).item()
    cos = torch.nn.functional.cosine_similarity(a, r, dim=-1)
    return Agreement(rel, cos.min().item(), cos.mean().item())
