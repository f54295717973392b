"""fp8's error bounds: what a dequantized state may differ from the state it was made of."""

from __future__ import annotations

#: e4m3fn rounds to nearest with 3 mantissa bits: at most 2^-4 of |x| for a normal value, at most half
#: its smallest subnormal step (2^-9 / 2) of the scale below 2^-6; bfloat16 rounds the product at 2^-8.
REL, SUB, BF16 = 2.0 ** -4, 2.0 ** -10, 2.0 ** -8


def within_fp8(got, want, scale):
    """Each element of ``got`` (dequantized) within fp8's rounding of ``want``, ``scale`` broadcasting."""
    got, want = got.double(), want.double()
    bound = REL * want.abs() + SUB * scale.double() + BF16 * got.abs() + 1e-30
    return bool(((got - want).abs() <= bound).all())


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())
