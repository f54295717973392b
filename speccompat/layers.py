"""Which decoder layers to capture: speculators' default and its checks, before any engine starts.

speculators 0.3/0.4 choose ``[2, L//2, L-3, L-1]`` when no ``layer_ids`` are given. For small
models that list repeats a layer (L=6 gives ``[2, 3, 3, 5]``) and the duplicate is only noticed by
the workers, after the engine has started. :func:`resolve_layer_ids` applies speculators' rule and
rejects what would fail later, naming the model's layer count; :func:`check_generator_layer_ids` is
the hook that ``speccompat``'s ``generator.__init__`` patch calls.

Layer ``i`` means the residual stream after decoder layer ``i`` (0-based), before the final norm;
``L-1`` (the last layer) is allowed, as in speculators.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["LayerIdsError", "LayerIdsTypeError", "check_generator_layer_ids", "num_hidden_layers", "resolve_layer_ids",
           "speculators_default"]


class LayerIdsError(ValueError):
    """Layer ids that cannot be captured from this model; the message says why and what to pass."""


class LayerIdsTypeError(LayerIdsError, TypeError):
    """``layer_ids`` is not a list of ints."""


def speculators_default(num_layers: int) -> list[int]:
    """speculators 0.3/0.4's choice when ``layer_ids`` is None."""
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def resolve_layer_ids(requested: Any, num_layers: int) -> list[int]:
    """``requested`` checked against a model of ``num_layers`` decoder layers (None: speculators'
    default). Raises :class:`LayerIdsError` for non-integers, duplicates, empty lists, ids outside
    ``[0, num_layers - 1]``, and for a default that repeats a layer."""
    if requested is None:
        ids = speculators_default(num_layers)
        bad = sorted({i for i in ids if ids.count(i) > 1 or not 0 <= i < num_layers})
        if bad:
            raise LayerIdsError(
                f"speculators' default layer ids [2, L//2, L-3, L-1] are {ids} for this model's "
                f"{num_layers} decoder layers (layer(s) {bad} repeated or out of range); pass layer_ids "
                f"explicitly: distinct ids in [0, {num_layers - 1}], e.g. the last one, {num_layers - 1}, "
                "and three earlier ones"
            )
        return ids
    if isinstance(requested, (str, bytes)) or not hasattr(requested, "__iter__"):
        raise LayerIdsTypeError(f"layer_ids must be a list of ints, got {type(requested).__name__}")
    ids = list(requested)
    wrong = [x for x in ids if isinstance(x, bool) or not isinstance(x, int)]
    if wrong:
        raise LayerIdsTypeError(f"layer_ids must be ints, got {wrong}")
    if not ids:
        raise LayerIdsError("layer_ids is empty")
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise LayerIdsError(f"duplicate layer ids {dup} in {ids}")
    out = [x for x in ids if not 0 <= x < num_layers]
    if out:
        raise LayerIdsError(f"layer ids {out} outside the model's decoder layers [0, {num_layers - 1}]")
    return ids


def _config_dict(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    from transformers import PretrainedConfig  # a hub id: transformers resolves and caches it

    cfg, _ = PretrainedConfig.get_config_dict(model_path)
    return cfg


def num_hidden_layers(model_path: str) -> int:
    """Decoder layers of the text model (``text_config`` first, as speculators reads Kimi-K2.5)."""
    cfg = _config_dict(model_path)
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("num_hidden_layers"), int):
            return int(c["num_hidden_layers"])
    raise LayerIdsError(f"{model_path}: config.json has no num_hidden_layers (nor in text_config)")


def check_generator_layer_ids(model_path: Any, layer_ids: Any) -> None:
    """Called by the ``generator.__init__`` patch with speculators' arguments, before any engine
    starts: explicit ids are checked for type and duplicates (the model's range is checked by
    speculators itself, also before the engine); a default is checked against the model's config."""
    if layer_ids is not None:
        resolve_layer_ids(layer_ids, num_layers=1 << 30)
        return
    if not isinstance(model_path, (str, os.PathLike)):
        return  # speculators will fail on it itself, before the engine
    try:
        layers = num_hidden_layers(os.fspath(model_path))
    except (OSError, ValueError, ImportError):
        return  # an unreadable config is speculators' error to report (before the engine)
    resolve_layer_ids(None, layers)
