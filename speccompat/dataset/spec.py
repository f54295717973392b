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
    output of decoder layer i) and ``hidden_size``."""

    dtype: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    granularity: str | None = None

    @property
    def serving_ids(self) -> tuple[int, ...]:
        """The same layers in vLLM's numbering (aux hidden state i+1)."""
        return tuple(i + 1 for i in self.layer_ids)

    @property
    def safetensors_dtype(self) -> str:
        """The safetensors dtype name of the stored hidden states."""
        return DTYPES[self.dtype][1]

    @classmethod
    def of_provenance(cls, prov: dict[str, Any]) -> StoredSpec:
        """The spec a data set's provenance records (``hidden_states`` and ``model``)."""
        hs = prov["hidden_states"]
        granularity = ((hs.get("fp8") or {}).get("scale") or DEFAULT_GRANULARITY) if hs["dtype"] == "fp8" else None
        return cls(hs["dtype"], tuple(hs["layer_ids"]), int(prov["model"]["hidden_size"]), granularity)
