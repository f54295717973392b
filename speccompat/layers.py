"""Which decoder layers to capture: speculators' default and its checks, before any engine starts.

speculators 0.3/0.4 choose ``[2, L//2, L-3, L-1]`` when no ``layer_ids`` are given. For small
models that list repeats a layer (L=6 gives ``[2, 3, 3, 5]``) and the duplicate is only noticed by
the workers, after the engine has started. :func:`resolve_layer_ids` applies speculators' rule and
rejects what would fail later, naming the model's layer count; :func:`check_generator_layer_ids` is
the hook that ``speccompat``'s ``generator.__init__`` patch calls.

Layer ``i`` means the residual stream after decoder layer ``i`` (0-based), before the final norm;
``L-1`` (the last layer) is allowed, as in speculators.

vLLM numbers the same states differently: its EAGLE-3 aux id ``k`` is the state after ``k`` layers,
i.e. the input of decoder layer ``k`` (vLLM 0.32.0, ``vllm/model_executor/models/llama.py:428-441``:
the state before layer ``start_layer`` is offered as id ``start_layer``, the output of layer ``idx``
as id ``idx + 1``; ``deepseek_v2.py:1561-1587`` captures the input of layer ``idx`` as id ``idx`` and
the final pre-norm state as id ``end_layer``). So layer ``i`` here is vLLM aux id ``i + 1``
(:func:`vllm_aux_id`), and the final layer ``L-1`` is aux id ``L``. :func:`layer_records` is what
every data set records per stored layer, :func:`training_layers` / :func:`describe_for_training`
give the trainer flags that make a draft use, at serving time, the layers it was trained on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerIdsError", "LayerIdsTypeError", "TrainingLayers", "check_generator_layer_ids", "describe_for_training",
           "layer_for_aux_id", "layer_records", "num_hidden_layers", "resolve_layer_ids", "speculators_default",
           "training_layers", "vllm_aux_id", "vllm_default_aux_ids"]


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


def vllm_aux_id(layer: int) -> int:
    """vLLM's EAGLE-3 aux id of the output of decoder layer ``layer``: the state after ``layer + 1``
    layers (see the module docstring for the vLLM source lines)."""
    return layer + 1


def layer_for_aux_id(aux_id: int) -> int:
    """The decoder layer whose output vLLM's aux id ``aux_id`` is (aux id 0, the embeddings, is -1)."""
    return aux_id - 1


def layer_records(layer_ids: Any) -> list[dict[str, Any]]:
    """What a data set records for each stored layer, in stored order."""
    return [{"layer": i, "meaning": f"output of decoder layer {i}", "vllm_aux_id": vllm_aux_id(i)} for i in layer_ids]


def vllm_default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """The aux ids vLLM serves an EAGLE-3 draft whose config sets no ``eagle_aux_hidden_state_layer_ids``.

    vLLM 0.32.0: ``vllm/v1/worker/gpu_model_runner.py:5241-5247`` (and the v2 runner's
    ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:25-30``) fall back to
    ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``,
    ``vllm/model_executor/models/interfaces.py:1712-1733``: ``(2, L//2, L-3)`` with ``L`` the number of
    decoder layers of the (language) model; ``models/transformers/base.py:850-852`` says the same."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class TrainingLayers:
    """How a data set's layers are used by the speculators trainers, and what vLLM must be told.

    Every trainer concatenates all stored layers but the last as the draft's input and uses the
    last one as the verifier state (speculators 0.4.0.1 ``speculators/train/data.py:95-112``
    ``standardize_data_v1``: ``cat(hs[:-1])`` and ``hs[-1]``; 0.5-0.9 ``ArrowDataset``:
    ``hs[:, :-1]`` and ``hs[:, -1]``). vLLM serves the aux states in ascending id order
    (``interfaces.py:1578`` sorts them; capture follows the forward pass)."""

    layer_ids: tuple[int, ...]
    num_hidden_layers: int

    @property
    def input_layers(self) -> tuple[int, ...]:
        """The stored layers the draft takes as input (all but the verifier state), stored order."""
        return self.layer_ids[:-1]

    @property
    def aux_ids(self) -> tuple[int, ...]:
        """``eagle_aux_hidden_state_layer_ids`` for the draft: vLLM ids of :attr:`input_layers`."""
        return tuple(vllm_aux_id(i) for i in self.input_layers)

    @property
    def verifier_layer(self) -> int:
        return self.layer_ids[-1]

    def target_layer_ids_flag(self) -> list[str]:
        """speculators >= 0.5's training flag (a list: ``--target-layer-ids`` takes ``nargs="+"``)."""
        return ["--target-layer-ids", *map(str, self.aux_ids)]

    def draft_config(self) -> dict[str, list[int]]:
        """What a draft trained on these layers needs in its config.json (top level, where speculators
        0.4 and 0.9's ``Eagle3SpeculatorConfig`` keep it and vLLM reads it)."""
        return {"eagle_aux_hidden_state_layer_ids": list(self.aux_ids)}


def training_layers(layer_ids: Any, num_hidden_layers: int) -> TrainingLayers:
    """The training view of a data set's ``layer_ids`` (speccompat numbering) for a model of
    ``num_hidden_layers`` decoder layers. Raises :class:`LayerIdsError` when no trainer can make a
    draft that vLLM serves the layers it was trained on: fewer than two layers, a last layer that
    is not the final one (``L-1``: the trainers take it for the verifier state), or input layers
    not in ascending order (the trainers concatenate them in stored order, vLLM in ascending order)."""
    ids = tuple(resolve_layer_ids(layer_ids, num_hidden_layers))
    last = num_hidden_layers - 1
    if len(ids) < 2:
        raise LayerIdsError(f"layers {list(ids)}: a draft needs at least one input layer besides the final "
                            f"layer {last} (the verifier state)")
    if ids[-1] != last:
        where = f"stored at position {ids.index(last)}" if last in ids else "not stored"
        raise LayerIdsError(f"layers {list(ids)}: the last stored layer, {ids[-1]}, is not the final decoder layer "
                            f"{last} ({where}); the trainers take the last stored layer as the verifier state")
    inputs = ids[:-1]
    if list(inputs) != sorted(inputs):
        raise LayerIdsError(f"layers {list(ids)}: the input layers {list(inputs)} are not ascending; the trainers "
                            f"concatenate them in stored order, vLLM serves them in ascending order "
                            f"{sorted(inputs)}")
    return TrainingLayers(ids, num_hidden_layers)


def describe_for_training(layer_ids: Any, num_hidden_layers: int, dataset: str = "DATASET") -> str:
    """What to tell the trainer about a data set with these layers (the extraction drivers print
    it at the end): the layers' meaning, ``--target-layer-ids`` for speculators >= 0.5 and the
    ``eagle_aux_hidden_state_layer_ids`` a 0.3/0.4-trained draft needs. ``dataset``: its path."""
    ids = list(layer_ids)
    lines = [f"layers stored: {' '.join(map(str, ids))} of {num_hidden_layers} (layer i = output of decoder "
             f"layer i = vLLM aux id i+1: {' '.join(str(vllm_aux_id(i)) for i in ids)})"]
    try:
        t = training_layers(ids, num_hidden_layers)
    except LayerIdsError as exc:
        return "\n".join([*lines, f"no EAGLE-3 trainer can use these layers as stored: {exc}"])
    default = tuple(sorted(set(vllm_default_aux_ids(num_hidden_layers))))  # as vLLM captures them
    lines += [
        f"draft input: layers {' '.join(map(str, t.input_layers))}; verifier state: layer {t.verifier_layer}",
        f"speculators >= 0.5: train with {' '.join(t.target_layer_ids_flag())}",
        f"speculators 0.3/0.4: put {json.dumps(t.draft_config())} into the trained draft's config.json "
        f"(`speccompat check-draft DRAFT_DIR {dataset} --fix` does it)"
        + ("" if t.aux_ids == default else
           f"; 0.4's trainer leaves it unset, and vLLM then serves its default aux ids "
           f"{' '.join(map(str, default))} = outputs of layers {' '.join(str(layer_for_aux_id(k)) for k in default)}"),
    ]
    return "\n".join(lines)
