"""On-disk layouts of one sample.

``safetensors`` (default): ``<name_for_id(id)>.safetensors`` holding ``input_ids`` [n] int64,
``loss_mask`` [n] int64 (when the input has one) and ``hidden_states_<layer>`` [n, hidden] per
layer id, with the sample's facts and the data set's provenance in the header metadata. Written
by :func:`encode_safetensors` straight from tensor memory (header + raw buffers, no copy).

``speculators``: ``data_<i>.pt``, exactly what speculators 0.3/0.4's
``scripts/data_generation_offline.py`` writes with ``torch.save``: ``{"input_ids": LongTensor[n],
"hidden_states": [Tensor[n, hidden], ...], "loss_mask": LongTensor[n]}`` (all ones when the input
has no mask), read by ``speculators.train.data.Eagle3SampleFileDataset`` unchanged.

``speculators-arrow``: what speculators >= 0.5 trains on (:mod:`speccompat.dataset.arrow_format`).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import Rejected
from .names import name_for_id

__all__ = ["DTYPES", "SAFETENSORS", "SPECULATORS", "Encoded", "Layout", "encode_safetensors", "layout_named",
           "read_safetensors", "tensor_buffer"]

#: --dtype -> (bytes per element, safetensors dtype name, torch dtype name)
DTYPES = {"bfloat16": (2, "BF16", "bfloat16"), "float16": (2, "F16", "float16"), "float32": (4, "F32", "float32"),
          # float8_e4m3fn with float32 scales (speccompat.dataset.fp8); 4 more bytes a token (a token's scale)
          "fp8": (1, "F8_E4M3", "float8_e4m3fn")}
_ST_NAME = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32", "int8": "I8",
            "uint8": "U8", "float64": "F64",
            "float8_e4m3fn": "F8_E4M3"}
SAFETENSORS, SPECULATORS = "safetensors", "speculators"
#: the layouts this version writes and reads
ARROW = "speculators-arrow"
LAYOUTS = (SAFETENSORS, SPECULATORS, ARROW)


def tensor_buffer(t: Any) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def owned(t: Any) -> Any:
    """``t`` as a contiguous tensor that owns all of its storage. ``torch.save`` writes a tensor's
    whole storage: a view (``generate(copy=False)`` returns views of one batch-wide buffer) would
    put the entire batch into every file."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def st_dtype(t: Any) -> str:
    return _ST_NAME[str(t.dtype).removeprefix("torch.")]


@dataclass
class Encoded:
    """What one file is: the bytes before the tensors (header) and the tensors' buffers in order."""

    header: bytes
    tensors: list[tuple[str, str, list[int], memoryview]]  # (name, dtype, shape, buffer)
    trailer: Any = None  # speculators layout: the object torch.save writes

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(b) for *_, b in self.tensors)


def encode_safetensors(named: list[tuple[str, Any]], metadata: dict[str, str]) -> Encoded:
    """safetensors header for ``named`` tensors (in this order) and their buffers."""
    header: dict[str, Any] = {"__metadata__": metadata}
    tensors = []
    offset = 0
    for name, t in named:
        buf = tensor_buffer(t)
        dtype = st_dtype(t)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(buf)]}
        tensors.append((name, dtype, list(t.shape), buf))
        offset += len(buf)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    return Encoded(struct.pack("<Q", len(raw)) + raw, tensors)


def read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
    """(metadata, {name: (dtype, shape, buffer)}, mmap) of a safetensors file, without torch.
    Raises ``ValueError`` for a file that is not a complete safetensors file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a symbolic link is refused (ELOOP)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a plain file")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"header is not JSON: {exc}") from None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("header __metadata__ is not an object of strings")
    start = 8 + n
    out = {}
    end_max = 0
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {name!r}: no valid data_offsets in the header")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)) \
                or not isinstance(info.get("dtype"), str):
            raise ValueError(f"tensor {name!r}: no valid dtype/shape in the header")
        b, e = offsets
        if not 0 <= b <= e or start + e > size:
            raise ValueError(f"tensor {name}: data {b}..{e} outside the file ({size - start} data bytes)")
        out[name] = (info["dtype"], list(shape), memoryview(mm)[start + b : start + e])
        end_max = max(end_max, e)
    if start + end_max != size:
        raise ValueError(f"{size - start - end_max} bytes after the last tensor")
    return meta, out, mm


class Layout:
    """Names and file contents of one layout."""

    name = SAFETENSORS
    suffix = ".safetensors"
    #: files a data set of this layout has besides the samples and the manifest
    side_files: tuple[str, ...] = ()
    #: whether :meth:`finalize` writes the token-frequency file at ``token_freq_path`` (beside the directory)
    token_freq_beside = False

    def file_name(self, sample_id: str, index: int) -> str:
        return name_for_id(sample_id, self.suffix)

    def is_sample_file(self, name: str) -> bool:
        return name.endswith(self.suffix)

    def tensors(self, sample: Any, hidden_states: list[Any], layer_ids: list[int], dtype: Any,
                fp8_scale: str | None = None) -> list[tuple[str, Any]]:
        """The named tensors of one sample's file; ``fp8_scale``: quantize to fp8 with scales of this
        granularity (:mod:`speccompat.dataset.fp8`) instead of casting to ``dtype``."""
        import torch

        named = [("input_ids", torch.tensor(sample.input_ids, dtype=torch.int64))]
        if sample.loss_mask is not None:
            named.append(("loss_mask", torch.tensor(sample.loss_mask, dtype=torch.int64)))
        if fp8_scale is not None:
            from .fp8 import SCALES, quantize

            if len(layer_ids) != len(hidden_states):
                raise ValueError(f"{len(hidden_states)} hidden-state tensors for {len(layer_ids)} layer ids")
            q, scales = quantize(hidden_states, fp8_scale, stack=False)
            return [*named, *((f"hidden_states_{i}", t) for i, t in zip(layer_ids, q, strict=True)), (SCALES, scales)]
        named += [(f"hidden_states_{i}", h if h.dtype == dtype else h.to(dtype))
                  for i, h in zip(layer_ids, hidden_states, strict=True)]
        return named

    def expected_tensors(self, n: int, layer_ids: list[int], hidden: int, has_mask: bool) -> dict[str, list[int]]:
        """Tensor name -> shape of a sample of ``n`` tokens (what verify checks a file against)."""
        return {"input_ids": [n], **({"loss_mask": [n]} if has_mask else {}),
                **{f"hidden_states_{i}": [n, hidden] for i in layer_ids}}

    def encode(self, named: list[tuple[str, Any]], metadata: dict[str, str]) -> Encoded:
        return encode_safetensors(named, metadata)

    def read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        return read_safetensors(path)

    def derived_names(self, root: Path) -> set[str]:
        """The names in the directory ``root`` that the layout's side files occupy (what verify knows
        and ``--overwrite`` removes besides the samples and the manifest)."""
        return set(self.side_files)

    def finalize(self, ddir: Any, entries: list[dict[str, Any]], *, token_freq: Any, token_freq_path: Path,
                 info: dict[str, Any]) -> None:
        """Write the layout's side files once every sample is in place; called from the one finish
        path (:func:`speccompat.dataset.finish.finish_dataset`) of a whole run and of a merge.
        ``ddir``: the :class:`~speccompat.dataset.directory.DatasetDir`; ``entries``: the finished
        entries in input order; ``token_freq``: a callable returning ``{token id: count}`` over the
        loss-masked tokens of ``entries``; ``token_freq_path``: where that file goes; ``info``: the
        header, provenance and run facts (``header``, ``provenance``, ``extra``, ``speculators_version``).
        The safetensors layout has none."""


#: why the speculators 0.3/0.4 layout refuses fp8
FP8_SPECULATORS_04 = ("--dtype fp8 cannot be read by speculators 0.3/0.4 (--format speculators / --to speculators-0.4): "
                      "their Eagle3SampleFileDataset casts the stored tensors with .to(dtype) and knows no scale, so "
                      "it would train on unscaled fp8 values; use --format speculators-arrow (speculators >= 0.9 "
                      "reads it with FP8Transfer) or safetensors, or --dtype bfloat16")


class SpeculatorsLayout(Layout):
    name = SPECULATORS
    suffix = ".pt"
    side_files = ("data_config.json", "sample_lengths.json")
    token_freq_beside = True

    def file_name(self, sample_id: str, index: int) -> str:
        return f"data_{index}.pt"

    def is_sample_file(self, name: str) -> bool:
        return name.startswith("data_") and name.endswith(".pt")

    def tensors(self, sample: Any, hidden_states: list[Any], layer_ids: list[int], dtype: Any,
                fp8_scale: str | None = None) -> list[tuple[str, Any]]:
        import torch

        if fp8_scale is not None:  # refused before anything starts (fp8.refuse_layout); never written
            raise ValueError(FP8_SPECULATORS_04)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.num_tokens
        named = [("input_ids", torch.tensor(sample.input_ids, dtype=torch.long)),
                 ("loss_mask", torch.tensor(mask, dtype=torch.long))]
        named += [(f"hidden_states_{i}", owned(h if h.dtype == dtype else h.to(dtype)))
                  for i, h in zip(layer_ids, hidden_states, strict=True)]
        return named

    def encode(self, named: list[tuple[str, Any]], metadata: dict[str, str]) -> Encoded:
        d = dict(named)
        obj = {"input_ids": d["input_ids"],
               "hidden_states": [t for n, t in named if n.startswith("hidden_states_")],
               "loss_mask": d["loss_mask"]}
        return Encoded(b"", [(n, st_dtype(t), list(t.shape), tensor_buffer(t)) for n, t in named], trailer=obj)

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        import torch

        try:
            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"torch.load failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(obj, dict) or not {"input_ids", "hidden_states", "loss_mask"} <= set(obj):
            raise ValueError("not a speculators sample dict (input_ids, hidden_states, loss_mask)")
        out = {"input_ids": obj["input_ids"], "loss_mask": obj["loss_mask"]}
        layer_ids = getattr(self, "layer_ids", None) or list(range(len(obj["hidden_states"])))
        if not isinstance(obj["hidden_states"], (list, tuple)) or not all(
                isinstance(t, torch.Tensor) for t in [obj["input_ids"], obj["loss_mask"], *obj["hidden_states"]]):
            raise ValueError("input_ids, loss_mask and hidden_states are not tensors")
        if len(obj["hidden_states"]) != len(layer_ids):
            raise ValueError(f"{len(obj['hidden_states'])} hidden-state tensors, expected {len(layer_ids)}")
        out.update({f"hidden_states_{i}": h for i, h in zip(layer_ids, obj["hidden_states"], strict=True)})
        return {}, {n: (st_dtype(t), list(t.shape), tensor_buffer(t)) for n, t in out.items()}, obj

    def read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        if os.path.islink(path):
            raise ValueError("a symbolic link (refused)")
        return self._read(path)

    def finalize(self, ddir: Any, entries: list[dict[str, Any]], *, token_freq: Any, token_freq_path: Path,
                 info: dict[str, Any]) -> None:
        from .speculators_format import write_side_files

        write_side_files(ddir, entries, token_freq=token_freq, token_freq_path=token_freq_path, info=info)


def layout_named(name: str, layer_ids: list[int] | None = None, num_layers: int | None = None) -> Layout:
    """The layout ``name``; ``num_layers`` (the model's decoder layers) lets a layout refuse a layer
    set it cannot store faithfully."""
    if name == ARROW:
        from .arrow_format import layout

        return layout(layer_ids, num_layers)
    if name == SAFETENSORS:
        return Layout()
    if name == SPECULATORS:
        if num_layers is not None and layer_ids and layer_ids[-1] != max(layer_ids):
            raise Rejected(f"--format {SPECULATORS}: the last layer is {layer_ids[-1]}, not the largest of "
                           f"{list(layer_ids)}: speculators 0.3/0.4 take the last one as the verifier's final state "
                           f"(data[\"hidden_states\"][-1]); put {max(layer_ids)} last")
        lay = SpeculatorsLayout()
        lay.layer_ids = list(layer_ids or [])  # type: ignore[attr-defined]
        return lay
    raise ValueError(f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
