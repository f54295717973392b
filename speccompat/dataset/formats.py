"""The safetensors codec and the layout of one sample: :class:`Layout` (the default layout and the
base of the others, :mod:`speccompat.dataset.layouts`).

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

from .fp8 import SCALES, quantize
from .names import name_for_id
from .spec import ARROW, DTYPES, LAYOUTS, SAFETENSORS, SPECULATORS, SUFFIXES, StoredSpec

__all__ = ["ARROW", "DTYPES", "LAYOUTS", "SAFETENSORS", "SPECULATORS", "Encoded", "Layout", "encode_safetensors",
           "read_safetensors", "tensor_buffer", "tensor_from"]

_ST_NAME = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32", "int8": "I8",
            "uint8": "U8", "float64": "F64",
            "float8_e4m3fn": "F8_E4M3"}
_TORCH = {v: k for k, v in _ST_NAME.items()}


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


def tensor_from(dtype: str, shape: list[int], buf: memoryview) -> Any:
    """A tensor over ``buf`` (no copy) of safetensors dtype ``dtype`` and ``shape``."""
    import warnings

    import torch

    dt = getattr(torch, _TORCH[dtype])
    if not len(buf):
        return torch.empty(shape, dtype=dt)
    with warnings.catch_warnings():  # read-only mmap: the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dt).reshape(shape)


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
    suffix = SUFFIXES[SAFETENSORS]
    #: files a data set of this layout has besides the samples and the manifest
    side_files: tuple[str, ...] = ()
    #: whether :meth:`finalize` writes the token-frequency file at ``token_freq_path`` (beside the directory)
    token_freq_beside = False

    def file_name(self, sample_id: str, index: int) -> str:
        return name_for_id(sample_id, self.suffix)

    def is_sample_file(self, name: str) -> bool:
        return name.endswith(self.suffix)

    def tensors(self, sample: Any, hidden_states: list[Any], spec: StoredSpec) -> list[tuple[str, Any]]:
        """The named tensors of one sample's file: its states (one per ``spec.layer_ids``) cast to
        ``spec.dtype``, or for fp8 quantized with scales of ``spec.granularity``
        (:mod:`speccompat.dataset.fp8`)."""
        import torch

        layer_ids, dtype = spec.layer_ids, getattr(torch, spec.torch_dtype_name)
        named = [("input_ids", torch.tensor(sample.input_ids, dtype=torch.int64))]
        if sample.loss_mask is not None:
            named.append(("loss_mask", torch.tensor(sample.loss_mask, dtype=torch.int64)))
        if len(layer_ids) != len(hidden_states):
            raise ValueError(f"{len(hidden_states)} hidden-state tensors for {len(layer_ids)} layer ids")
        if spec.granularity is not None:
            q, scales = quantize(hidden_states, spec.granularity, stack=False)
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
