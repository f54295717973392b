"""The layouts, by name: one small interface (:class:`~speccompat.dataset.formats.Layout`: a
sample's file name, tensors, encoding, reading, side files) and one module per layout behind it.

- ``safetensors`` (default): ``<name_for_id(id)>.safetensors`` holding ``input_ids`` [n] int64,
  ``loss_mask`` [n] int64 (when the input has one) and ``hidden_states_<layer>`` [n, hidden] per
  layer id, with the sample's facts and the data set's provenance in the header metadata
  (:mod:`speccompat.dataset.formats`);
- ``speculators``: speculators 0.3/0.4's ``data_<i>.pt`` files and side files
  (:mod:`speccompat.dataset.speculators_format`);
- ``speculators-arrow``: what speculators >= 0.5 trains on (:mod:`speccompat.dataset.arrow_format`).
"""

from __future__ import annotations

from typing import Any

from . import arrow_format
from .errors import Rejected
from .formats import Layout
from .spec import ARROW, LAYOUTS, SAFETENSORS, SPECULATORS, StoredSpec
from .speculators_format import SpeculatorsLayout

__all__ = ["LAYOUTS", "Layout", "layout_named", "layout_of"]


def layout_of(header: dict[str, Any]) -> Layout:
    """The layout of a stored set, from its manifest header (``layout`` and the layer ids its
    provenance records)."""
    return layout_named(header["layout"], list(StoredSpec.of_provenance(header["provenance"]).layer_ids))


def layout_named(name: str, layer_ids: list[int] | None = None, num_layers: int | None = None) -> Layout:
    """The layout ``name``; ``num_layers`` (the model's decoder layers) lets a layout refuse a layer
    set it cannot store faithfully."""
    if name == ARROW:
        return arrow_format.layout(layer_ids, num_layers)
    if name == SAFETENSORS:
        return Layout()
    if name == SPECULATORS:
        if num_layers is not None and layer_ids and layer_ids[-1] != max(layer_ids):
            raise Rejected(f"--layout {SPECULATORS}: the last layer is {layer_ids[-1]}, not the largest of "
                           f"{list(layer_ids)}: speculators 0.3/0.4 take the last one as the verifier's final state "
                           f"(data[\"hidden_states\"][-1]); put {max(layer_ids)} last")
        lay = SpeculatorsLayout()
        lay.layer_ids = list(layer_ids or [])  # type: ignore[attr-defined]
        return lay
    raise ValueError(f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
