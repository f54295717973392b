"""Comparison metrics between extracted hidden states and the reference, per sequence and layer."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["LOOSE", "TIGHT", "Agreement", "Case", "Thresholds", "compare", "measure", "violations"]


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


class Case(NamedTuple):
    """One (sequence, layer) comparison: the extraction against the fp32 reference, next to the
    bf16 noise of the same case (transformers in bf16 against transformers in fp32)."""

    seq: int
    layer: int
    got: Agreement
    noise: Agreement
    bad_tokens: float  # fraction of tokens whose cosine to the reference is below TOKEN_COS
    noise_bad_tokens: float


#: A token "disagrees" below this cosine. MoE routing flips (one token choosing other experts)
#: show up as isolated tokens far below it, in vLLM and in transformers-bf16 alike.
TOKEN_COS = 0.99


def _cos(a: Any, b: Any) -> Any:
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def measure(results: list[dict], refs32: list[list[Any]], refs16: list[list[Any]]) -> list[Case]:
    """Compare every (sequence, layer) of ``results`` with the references (one list per sequence)."""
    cases = []
    for i, (res, r32, r16) in enumerate(zip(results, refs32, refs16, strict=True)):
        for j, (h, a, b) in enumerate(zip(res["hidden_states"], r32, r16, strict=True)):
            cases.append(
                Case(i, j, compare(h, a), compare(b, a),
                     float((_cos(h, a) < TOKEN_COS).float().mean()),
                     float((_cos(b, a) < TOKEN_COS).float().mean()))
            )
    return cases


class Thresholds(NamedTuple):
    """Pass criteria, relative to the measured bf16 noise of each case (docs/parity.md).

    A case passes when its relative error is within ``rel_ratio`` times its own bf16 noise (or
    ``rel_floor``) and its fraction of disagreeing tokens within ``bad_ratio`` times the noise's
    (plus ``bad_floor``). With ``allowance`` > 0, up to that fraction of the sequences (at least
    one) may have cases beyond those limits, but never beyond the ``ceiling`` (nor 1.5 times the
    case's own noise, when that is higher).

    The default is the tight rule (:data:`TIGHT`): every case within its limits, dense and MoE
    layers alike - the tiny MoE checkpoints route by a clear margin, so bf16 rounding never swaps a
    token's experts. :data:`LOOSE` is for MoE checkpoints whose routers sit near ties (random
    routers: a swap changes that token's output completely, at random per case and engine).
    """

    rel_ratio: float = 3.0
    rel_floor: float = 0.03
    bad_ratio: float = 3.0
    bad_floor: float = 0.01
    allowance: float = 0.0  # fraction of sequences (at least one, when > 0) whose cases may exceed the limits above
    ceiling_rel: float = 0.0
    ceiling_bad: float = 0.0


#: Every case within max(3 x its bf16 noise, 0.03) relative error and 3 x its noise + 1% disagreeing tokens.
TIGHT = Thresholds()
#: The rule for near-tie routing: 3% disagreeing tokens on top, 5% of the sequences (at least one)
#: may exceed the per-case limits up to rel 0.25 / 25% disagreeing tokens.
LOOSE = Thresholds(bad_floor=0.03, allowance=0.05, ceiling_rel=0.25, ceiling_bad=0.25)


def _describe(c: Case, rel_limit: float, bad_limit: float) -> str:
    return (
        f"sequence {c.seq}, layer #{c.layer}: rel {c.got.rel:.4f} (limit {rel_limit:.4f}), "
        f"tokens below cos {TOKEN_COS}: {c.bad_tokens:.1%} (limit {bad_limit:.1%}), "
        f"min cos {c.got.min_cos:.4f}; bf16 noise rel {c.noise.rel:.4f}"
    )


def violations(cases: list[Case], t: Thresholds | None = None) -> list[str]:
    """Messages for the cases that fail ``t`` (default TIGHT; empty: the extraction agrees with
    the reference)."""
    t = t or TIGHT
    over, beyond = [], []
    for c in cases:
        rel_limit = max(t.rel_ratio * c.noise.rel, t.rel_floor)
        bad_limit = t.bad_ratio * c.noise_bad_tokens + t.bad_floor
        if t.allowance > 0:
            # The ceiling is never below the case's own noise (some MoE cases flip a lot in bf16 too).
            ceiling_rel = max(t.ceiling_rel, 1.5 * c.noise.rel)
            ceiling_bad = max(t.ceiling_bad, 1.5 * c.noise_bad_tokens)
            if c.got.rel > ceiling_rel or c.bad_tokens > ceiling_bad:
                beyond.append(_describe(c, ceiling_rel, ceiling_bad) + " [above the ceiling]")
                continue
        if c.got.rel > rel_limit or c.bad_tokens > bad_limit:
            over.append((c, _describe(c, rel_limit, bad_limit)))
    sequences_over = {c.seq for c, _ in over}
    allowed = max(1, int(t.allowance * len({c.seq for c in cases}))) if t.allowance > 0 else 0
    return beyond + ([msg for _, msg in over] if len(sequences_over) > allowed else [])
