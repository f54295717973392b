"""fp8 hidden states (``--dtype fp8``): ``float8_e4m3fn`` values and float32 scales, the schema of
hs-connectors 0.9's fp8 backend, which speculators >= 0.9 reads with ``FP8Transfer``.

Per sample, over the stored layers stacked as ``[n, layers, hidden]``:

- ``scale = amax / 448`` per token (``--fp8-scale token``: the amax over all layers and the hidden
  dimension, scales ``[n, 1, 1]``, hs-connectors' own choice) or per token and layer
  (``token-layer``: the amax over the hidden dimension, scales ``[n, layers, 1]``); the scale is
  rounded to the nearest bfloat16 value (kept as float32): exact in bfloat16, so that ``FP8Transfer``'s
  bfloat16 dequantization is the exact (float32) product rounded once; an all-zero token gets the
  scale 1e-12 (its values stay 0);
- ``fp8 = (x.float() * (1 / scale)).to(float8_e4m3fn)``: round to nearest; ``|x| / scale`` is at most
  448 times (1 + 2^-9) (the bfloat16 rounding of the scale), which rounds to 448, so no value
  saturates or becomes NaN;
- dequantize: ``x = fp8.to(dtype) * scale.to(dtype)`` (broadcasting; hs-connectors'
  ``dequantize_fp8_tensor``). Both scale shapes broadcast against ``[n, layers, hidden]``.

A state with a non-finite value is refused (its amax is not finite), as the bf16 writer refuses
one that does not fit its dtype.

Stored tensors: ``speculators-arrow``: ``hidden_states`` F8_E4M3 ``[n, layers, hidden]`` and
``hidden_states_scales`` F32; ``safetensors``: ``hidden_states_<layer>`` F8_E4M3 ``[n, hidden]`` per
layer and ``hidden_states_scales`` F32 ``[n, 1 or layers, 1]`` (the k-th scale layer belongs to the
k-th layer id). speculators 0.3/0.4 (``.pt``) cannot read fp8: their loader casts the stored
tensors with ``.to(dtype)`` and knows no scale.
"""

from __future__ import annotations

from typing import Any

from .spec import FP8_SPECULATORS_04, SPECULATORS

__all__ = ["FP8", "FP8_MAX", "GRANULARITIES", "SCALES", "available", "dequantize", "dequantize_layers",
           "describe", "flushed_note", "quantize", "refuse", "refuse_unavailable", "scales_shape"]

FP8 = "fp8"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALES = "hidden_states_scales"  # hs-connectors' SCALES_KEY
#: --fp8-scale values -> what the scale is the amax of
GRANULARITIES = {"token": "each token, over all stored layers and the hidden dimension (hs-connectors' choice)",
                 "token-layer": "each token and layer, over the hidden dimension"}
MIN_SCALE = 1e-12  # the scale of an all-zero token (hs-connectors' clamp)
DEQUANTIZE_RULE = "hidden_states.to(dtype) * hidden_states_scales.to(dtype)"


def available() -> bool:
    """Whether this torch has ``float8_e4m3fn``."""
    import torch

    return getattr(torch, "float8_e4m3fn", None) is not None


def refuse_unavailable() -> str | None:
    """Why ``--dtype fp8`` cannot run here (None when it can)."""
    try:
        import torch
    except ImportError:
        return "--dtype fp8 needs torch"
    if getattr(torch, "float8_e4m3fn", None) is None:
        return (f"--dtype fp8: this torch ({torch.__version__}) has no float8_e4m3fn; use torch >= 2.1 "
                "or --dtype bfloat16")
    return None


def refuse(dtype: str, layout: str) -> str | None:
    """Why a data set of ``dtype`` cannot be written in ``layout`` here (None when it can): fp8 needs
    float8_e4m3fn in torch, and a layout whose trainer reads fp8 (not speculators 0.3/0.4's)."""
    if dtype != FP8:
        return None
    if layout == SPECULATORS:
        return FP8_SPECULATORS_04
    return refuse_unavailable()


def scales_shape(n: int, layers: int, granularity: str) -> list[int]:
    return [n, layers if granularity == "token-layer" else 1, 1]


def describe(granularity: str) -> dict[str, Any]:
    """What the provenance records about an fp8 data set (``hidden_states.fp8``)."""
    return {"format": "float8_e4m3fn", "scale": granularity, "scale_tensor": SCALES, "scale_dtype": "float32",
            "scale_shape": "[n, layers, 1]" if granularity == "token-layer" else "[n, 1, 1]",
            "scale_rule": f"amax / {FP8_MAX:g} over {GRANULARITIES[granularity]}, rounded to the nearest "
                          f"bfloat16 value; {MIN_SCALE:g} for an all-zero token",
            "quantize": "(hidden_states.float() * (1 / scale)).to(float8_e4m3fn), round to nearest",
            "dequantize": DEQUANTIZE_RULE,
            "layers": "speculators-arrow: hidden_states [n, layers, hidden]; safetensors: hidden_states_<layer> "
                      "[n, hidden] with hidden_states_scales[:, k] for the k-th layer id (k = 0 for scale token)"}


def quantize(hidden_states: list[Any], granularity: str, *, stack: bool) -> tuple[Any, Any]:
    """``(fp8, scales)`` of one sample's states (one ``[n, hidden]`` tensor per layer): ``fp8`` is one
    ``[n, layers, hidden]`` tensor (``stack``) or a list of ``[n, hidden]`` tensors; ``scales`` float32
    ``[n, 1 or layers, 1]``, on the states' device (a CUDA state is quantized there). Raises
    ``ValueError`` for a state with a non-finite value.

    Per layer: one pass for the amax (``abs().amax``), one for ``x * (1 / scale)`` into float32, one
    for the cast into the fp8 output (written in place into the stacked tensor)."""
    import torch

    f8 = torch.float8_e4m3fn
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown fp8 scale granularity {granularity!r} (known: {', '.join(GRANULARITIES)})")
    n, hidden = hidden_states[0].shape
    L = len(hidden_states)
    dev = hidden_states[0].device
    amax = torch.stack([h.abs().amax(dim=-1) for h in hidden_states], dim=1).float()  # [n, L]
    if granularity == "token":
        amax = amax.amax(dim=1, keepdim=True)  # [n, 1]
    if not bool(torch.isfinite(amax).all()):
        bad = [k for k in range(L) if not bool(torch.isfinite(hidden_states[k]).all())]
        raise ValueError(f"non-finite hidden states (layer position(s) {bad}): not quantized to fp8")
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE).to(torch.bfloat16).float()
    inv = scale.reciprocal()
    out = torch.empty((n, L, hidden), dtype=f8, device=dev) if stack else None
    layers = []
    for k, h in enumerate(hidden_states):
        col = inv[:, k if granularity == "token-layer" else 0].unsqueeze(1)  # [n, 1]
        x = h.float()
        x = x.mul_(col) if x.data_ptr() != h.data_ptr() else x * col  # never scale the caller's tensor in place
        if out is not None:
            out[:, k].copy_(x)
        else:
            layers.append(x.to(f8))
    return (out if stack else layers), scale.unsqueeze(-1)


def dequantize(fp8: Any, scales: Any, dtype: Any = None) -> Any:
    """hs-connectors' ``dequantize_fp8_tensor``: ``fp8.to(dtype) * scales.to(dtype)`` (bfloat16 by
    default), for ``[n, layers, hidden]`` and ``[n, 1 or layers, 1]``."""
    import torch

    dtype = dtype or torch.bfloat16
    return fp8.to(dtype) * scales.to(dtype)


def dequantize_layers(layers: list[Any], scales: Any, dtype: Any = None) -> list[Any]:
    """The same for one ``[n, hidden]`` tensor per layer (the safetensors layout)."""
    import torch

    dtype = dtype or torch.bfloat16
    s = scales.reshape(scales.shape[0], -1).to(dtype)  # [n, 1 or layers]
    return [q.to(dtype) * s[:, k if s.shape[1] > 1 else 0].unsqueeze(1) for k, q in enumerate(layers)]


def flushed_note(flushed: int, values: int, granularity: str) -> str | None:
    """What a run says about the hidden-state values fp8 stored as 0 although they were not (below
    half of e4m3's smallest subnormal, 2^-9, at their token's scale); None when there were none."""
    if flushed <= 0:
        return None
    hint = "" if granularity == "token-layer" else "; --fp8-scale token-layer (a scale per layer) keeps more of them"
    return (f"fp8: {flushed} of {values} hidden-state values ({100 * flushed / max(values, 1):.3g}%) were not 0 but "
            f"are stored as 0: they are below fp8's smallest step at their token's scale{hint}")
