"""What a data set stores, as constants and as one typed value: the dtypes, the layouts' names and
file suffixes, and :class:`StoredSpec` (dtype, fp8 scale granularity, layer ids, hidden size).

A leaf of the data set library: it imports nothing else of it. The layouts themselves (how a
sample's tensors become a file) are :mod:`speccompat.dataset.layouts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ARROW", "DEFAULT_GRANULARITY", "DTYPES", "FP8_SPECULATORS_04", "LAYOUTS", "SAFETENSORS", "SPECULATORS", "SUFFIXES", "StoredSpec"]

#: --dtype -> (bytes per element, safetensors dtype name, torch dtype name)
DTYPES = {"bfloat16": (2, "BF16", "bfloat16"), "float16": (2, "F16", "float16"), "float32": (4, "F32", "float32"),
          # float8_e4m3fn with float32 scales (speccompat.dataset.fp8); 4 more bytes a token (a token's scale)
          "fp8": (1, "F8_E4M3", "float8_e4m3fn")}

#: the fp8 scale granularity when none is named (``--fp8-scale``): one scale per token
DEFAULT_GRANULARITY = "token"

#: The layouts this version writes and reads (``--layout``): per-sample safetensors files (the
#: default), speculators 0.3/0.4's ``data_<i>.pt`` files, speculators >= 0.5's Arrow data set.
SAFETENSORS, SPECULATORS, ARROW = "safetensors", "speculators", "speculators-arrow"
LAYOUTS = (SAFETENSORS, SPECULATORS, ARROW)
#: layout -> the suffix of its sample files
SUFFIXES = {SAFETENSORS: ".safetensors", SPECULATORS: ".pt", ARROW: ".safetensors"}

#: why the speculators 0.3/0.4 layout refuses fp8
FP8_SPECULATORS_04 = ("--dtype fp8 cannot be read by speculators 0.3/0.4 (--layout speculators / --to speculators): "
                      "their Eagle3SampleFileDataset casts the stored tensors with .to(dtype) and knows no scale, so "
                      "it would train on unscaled fp8 values; use --layout speculators-arrow (speculators >= 0.9 "
                      "reads it with FP8Transfer) or safetensors, or --dtype bfloat16")


@dataclass(frozen=True)
class StoredSpec:
    """What the sample files of one data set hold: ``dtype`` (a key of :data:`DTYPES`), the fp8
    scales' ``granularity`` (None unless fp8), the stored ``layer_ids`` (speccompat's numbering:
    output of decoder layer i) and ``hidden_size``.

    A run builds it once from its options (:meth:`of_options`) and passes it down: the provenance's
    ``hidden_states`` record is written from it, the directory opens with it, the writer casts and
    quantizes by it. A stored set's spec is read from its provenance (:meth:`of_provenance`)."""

    dtype: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    granularity: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if (self.granularity is not None) != (self.dtype == "fp8"):
            raise ValueError(f"an fp8 scale granularity goes with dtype fp8 only (dtype {self.dtype}, "
                             f"granularity {self.granularity!r})")
        if not self.layer_ids or not all(isinstance(i, int) and i >= 0 for i in self.layer_ids):
            raise ValueError(f"layer ids must be one or more integers >= 0, not {list(self.layer_ids)}")
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"hidden size must be a positive integer, not {self.hidden_size!r}")
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))

    @classmethod
    def of_options(cls, dtype: str, layer_ids: list[int] | tuple[int, ...], hidden_size: int,
                   fp8_scale: str | None = None) -> StoredSpec:
        """The spec of a run's options (``--dtype``, ``--fp8-scale``: :data:`DEFAULT_GRANULARITY` when
        fp8 and none is named; ignored otherwise, which the command line refuses before)."""
        return cls(dtype, tuple(layer_ids), int(hidden_size), (fp8_scale or DEFAULT_GRANULARITY) if dtype == "fp8"
                   else None)

    @classmethod
    def of_provenance(cls, prov: dict[str, Any]) -> StoredSpec:
        """The spec a data set's provenance records (``hidden_states`` and ``model``)."""
        hs = prov["hidden_states"]
        granularity = ((hs.get("fp8") or {}).get("scale") or DEFAULT_GRANULARITY) if hs["dtype"] == "fp8" else None
        return cls(hs["dtype"], tuple(hs["layer_ids"]), int(prov["model"]["hidden_size"]), granularity)

    @property
    def serving_ids(self) -> tuple[int, ...]:
        """The same layers in vLLM's numbering (aux hidden state i+1)."""
        return tuple(i + 1 for i in self.layer_ids)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def safetensors_dtype(self) -> str:
        """The safetensors dtype name of the stored hidden states."""
        return DTYPES[self.dtype][1]

    @property
    def torch_dtype_name(self) -> str:
        """The name in ``torch`` of the stored hidden states' dtype (``getattr(torch, name)``)."""
        return DTYPES[self.dtype][2]

    def expected_bytes(self, num_tokens: int) -> int:
        """An upper bound of the bytes ``num_tokens`` tokens of this spec take in one sample's files
        (states, fp8 scales at most one per token and layer, input ids and loss mask, the file's header)."""
        n_layers = len(self.layer_ids)
        scales = 4 * n_layers if self.is_fp8 else 0
        return n_layers * num_tokens * self.hidden_size * DTYPES[self.dtype][0] + (16 + scales) * num_tokens + 4096
