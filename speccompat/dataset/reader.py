"""Reading a data set of any layout with your own training code.

:class:`HiddenStatesDataset` is a map-style ``torch.utils.data.Dataset`` over a finished data set
(``safetensors``, ``speculators`` or ``speculators-arrow`` layout): item ``k`` is the ``k``-th sample
in input order (for ``speculators-arrow``, Arrow row ``k``), as a dict::

    {"id": str, "input_ids": LongTensor[n], "loss_mask": LongTensor[n] | None,
     "hidden_states": [Tensor[n, hidden], ...],   # one per layer, in layer_ids order
     "layer_ids": [i, ...],                       # output of decoder layer i (0-based), pre-norm
     "vllm_aux_ids": [i + 1, ...]}                # the same layers in vLLM's numbering

fp8 data sets (``--dtype fp8``) are returned dequantized: ``fp8.to(dtype) * scale.to(dtype)``, in
``dequantize_dtype`` (bfloat16 by default), as speculators' ``FP8Transfer`` does.

safetensors files are opened with ``safetensors.safe_open`` (memory-mapped; only the requested
tensors are read); ``.pt`` files with ``torch.load(mmap=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .directory import DatasetDir
from .formats import tensor_from
from .fp8 import SCALES, dequantize
from .layouts import layout_of

__all__ = ["HiddenStatesDataset", "decode_sample", "tensor_from"]

def decode_sample(layout_name: str, tensors: dict[str, Any], layer_ids: list[int], *, dtype: Any = None,
                  scale_layer_ids: list[int] | None = None) -> tuple[Any, Any, list[Any]]:
    """(input ids, loss mask or None, one [n, hidden] tensor per layer id) of a sample's tensors
    (name -> tensor) as its layout stores them. fp8 states (a ``hidden_states_scales`` tensor beside
    them) are dequantized, ``fp8.to(dtype) * scale.to(dtype)`` (``dtype``: bfloat16 by default);
    ``scale_layer_ids``: the layer ids the scales' layer axis follows (default ``layer_ids``)."""
    ids = tensors["input_ids"]
    mask = tensors.get("loss_mask")
    scales = tensors.get(SCALES)
    if "hidden_states" in tensors and layout_name not in ("safetensors", "speculators"):
        hs = tensors["hidden_states"]
        if hs.shape[1] != len(layer_ids):
            raise ValueError(f"hidden_states has {hs.shape[1]} layers, the data set {len(layer_ids)}")
        if scales is not None:
            hs = dequantize(hs, scales, dtype)
        layers = list(hs.unbind(1))
    else:
        layers = [tensors[f"hidden_states_{i}"] for i in layer_ids]
        if scales is not None:
            by = scale_layer_ids or layer_ids
            cols = [by.index(i) if scales.shape[1] > 1 else 0 for i in layer_ids]
            layers = [dequantize(q, scales[:, c], dtype) for q, c in zip(layers, cols, strict=True)]
    return ids, mask, layers


class HiddenStatesDataset:
    """Map-style dataset over the data set in ``path`` (see the module's documentation). ``layers``:
    a subset of the stored layer ids to return (default: all)."""

    def __init__(self, path: str | Path, layers: list[int] | None = None, dequantize_dtype: Any = None) -> None:
        self.path = Path(path)
        self.dequantize_dtype = dequantize_dtype  # fp8 sets: the dtype returned (default bfloat16)
        self.dir = DatasetDir(self.path)
        m = self.dir.manifest()
        if m.header is None:
            raise ValueError(f"{self.path}: no manifest.jsonl header: not a speccompat data set")
        self.provenance = m.provenance or {}
        self.layout_name = m.header.get("layout", "safetensors")
        self.stored_layer_ids = list(m.spec.layer_ids)
        self.layer_ids = list(layers) if layers is not None else list(self.stored_layer_ids)
        missing = [i for i in self.layer_ids if i not in self.stored_layer_ids]
        if missing:
            raise ValueError(f"{self.path}: layer(s) {missing} are not stored (stored: {self.stored_layer_ids})")
        self.layout = layout_of(m.header)
        self.entries = sorted(m.entries.values(), key=lambda e: (e.get("line", 0), str(e["id"])))

    def __len__(self) -> int:
        return len(self.entries)

    def _read(self, path: Path) -> dict[str, Any]:
        if self.layout.suffix == ".pt":
            import torch

            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            out = {"input_ids": obj["input_ids"], "loss_mask": obj["loss_mask"]}
            out.update({f"hidden_states_{i}": h for i, h in zip(self.stored_layer_ids, obj["hidden_states"],
                                                                 strict=True)})
            return out
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            out = {"input_ids": f.get_tensor("token_ids" if "token_ids" in keys else "input_ids")}
            if "loss_mask" in keys:
                out["loss_mask"] = f.get_tensor("loss_mask")
            if SCALES in keys:
                out[SCALES] = f.get_tensor(SCALES)
            if "hidden_states" in keys:
                sl = f.get_slice("hidden_states")
                pos = [self.stored_layer_ids.index(i) for i in self.layer_ids]
                if pos == list(range(len(self.stored_layer_ids))):
                    out["hidden_states"] = sl[:]
                else:
                    import torch

                    out["hidden_states"] = torch.stack([sl[:, k, :] for k in pos], dim=1)
                    if SCALES in out and out[SCALES].shape[1] > 1:  # per-layer scales: the same layers
                        out[SCALES] = out[SCALES][:, pos]
            else:
                out.update({f"hidden_states_{i}": f.get_tensor(f"hidden_states_{i}") for i in self.layer_ids})
        return out

    def __getitem__(self, k: int) -> dict[str, Any]:
        e = self.entries[k]
        tensors = self._read(self.dir.path(e["file"]))
        # the requested layers, in their order (a stacked file's were picked by _read)
        ids, mask, layers = decode_sample(self.layout_name, tensors, self.layer_ids, dtype=self.dequantize_dtype,
                                          scale_layer_ids=self.stored_layer_ids)
        return {"id": e["id"], "input_ids": ids, "loss_mask": mask, "hidden_states": layers,
                "layer_ids": list(self.layer_ids), "vllm_aux_ids": [i + 1 for i in self.layer_ids]}
