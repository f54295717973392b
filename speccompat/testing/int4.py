"""INT4 experts of the tiny checkpoints: compressed-tensors W4A16, pack-quantized, groups of 32,
symmetric - the scheme of the released Kimi-K2.5 - with compressed-tensors' own maths
(:func:`quantize_int4`, :func:`dequantize_int4`), the tensors of a checkpoint's routed experts
quantized (``_quantize_experts``) and a dense copy for the transformers reference
(:func:`decompress_checkpoint`). :mod:`speccompat.testing.models` builds the checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: compressed-tensors W4A16 of the released Kimi-K2.5 (and Kimi-K2-Thinking): routed experts only.
INT4_GROUP_SIZE = 32
INT4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": INT4_GROUP_SIZE,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


def _int4_scheme() -> Any:
    from compressed_tensors.quantization import QuantizationScheme

    group = INT4_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    return QuantizationScheme(targets=group["targets"], weights=group["weights"])


def quantize_int4(weight: Any) -> dict[str, Any]:
    """One [out, in] weight as compressed-tensors W4A16 pack-quantized tensors (compressed-tensors'
    own observer maths and packing): ``weight_packed`` int32 [out, in/8], ``weight_scale`` [out, in/32]
    in the weight's dtype, ``weight_shape`` int [2]."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _int4_scheme()
    out_f, in_f = weight.shape
    if in_f % INT4_GROUP_SIZE:
        raise ValueError(f"input size {in_f} is not a multiple of the INT4 group size {INT4_GROUP_SIZE}")
    groups = weight.float().reshape(out_f, in_f // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    scale = scale.to(weight.dtype)
    packed = PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero.to(torch.int8)}, scheme)
    return {k: v for k, v in packed.items() if k in ("weight_packed", "weight_scale", "weight_shape")}


def dequantize_int4(tensors: dict[str, Any], dtype: Any = None) -> Any:
    """The inverse of quantize_int4 (compressed-tensors' decompression), in float32 unless ``dtype``."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out = PackedQuantizationCompressor.decompress(
        {"weight_packed": tensors["weight_packed"], "weight_scale": tensors["weight_scale"].float(),
         "weight_shape": tensors["weight_shape"]}, _int4_scheme())
    return out["weight"].to(dtype or torch.float32)


_EXPERT_WEIGHT = r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"


def _quantize_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    import re

    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if re.search(_EXPERT_WEIGHT, name):
            stem = name[: -len("weight")]
            out.update({stem + k: v for k, v in quantize_int4(t).items()})
        else:
            out[name] = t
    return out


def decompress_checkpoint(path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """A dense copy of an INT4-expert checkpoint (experts dequantized exactly, in float32, by
    compressed-tensors), without its quantization_config: what transformers loads as the reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, dest = Path(path), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        dense = {}
        for name, t in tensors.items():
            if name.endswith(".weight_packed"):
                stem = name[: -len("weight_packed")]
                dense[stem + "weight"] = dequantize_int4(
                    {k: tensors[stem + k] for k in ("weight_packed", "weight_scale", "weight_shape")})
            elif not name.endswith((".weight_scale", ".weight_shape")):
                dense[name] = t
        save_file(dense, dest / f.name, metadata={"format": "pt"})
    return dest
