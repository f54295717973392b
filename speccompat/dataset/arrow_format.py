"""The ``speculators-arrow`` layout: what speculators >= 0.5 trains on (0.9.0 ``ArrowDataset``,
``speculators/train/data.py``), with speccompat's guarantees.

A finished data set directory is at once a Hugging Face ``datasets`` directory and a speccompat data set:

- ``data-*.arrow``, ``dataset_info.json``, ``state.json`` (``datasets.Dataset.save_to_disk``, torch
  format): one row per finished sample, in input order, with ``input_ids`` (int64), ``loss_mask``
  (int64; all ones when the input had none) and ``seq_len``;
- ``hidden_states/hs_<row>.safetensors``: a hard link (a copy where the file system has none) to the
  row's sample file;
- ``token_freq.pt``: ``{token_id: count}`` over the loss-masked tokens (``torch.save``);
- ``speccompat_arrow.json``: the rows (row -> id -> sample file) and the layers' meaning (speccompat
  layer i = output of decoder layer i = vLLM aux id i+1; the ``--target-layer-ids`` to train with);
- ``<name_for_id(id)>.safetensors``: one sample file per sample under a stable name, written by the
  writer like the default layout's (atomic, checksummed in ``manifest.jsonl``, provenance in the
  metadata), holding ``token_ids`` [n] int64, ``hidden_states`` [n, num_layers, hidden] (layers
  ascending, the last the final decoder layer's output, before the final norm) and ``loss_mask`` [n]
  int64 (which the trainer does not read; it makes each file self-contained).

Rows are numbered only by :meth:`ArrowLayout.finalize`, at the end of a run or a merge, over the
samples then finished: failed samples, ``--limit`` and shards leave no gaps, and resume and verify
work on the stable names. Needs ``datasets`` and ``pyarrow`` (``pip install 'speccompat[arrow]'``),
imported here only.
"""

from __future__ import annotations

import filecmp
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from .errors import Rejected
from .formats import Encoded, Layout, encode_safetensors, read_safetensors, tensor_from
from .fp8 import SCALES, quantize
from .fsutil import check_own_dirs, fresh_dir, fsync_dir, own_dir_problem, remove_own_dir, write_atomic
from .inputs import input_digest
from .manifest import Manifest
from .names import ARROW_BUILD_DIR, ARROW_HS_DIR, ARROW_INFO_NAME, ARROW_STATE, ARROW_TOKEN_FREQ
from .spec import ARROW, SUFFIXES, StoredSpec

__all__ = ["ARROW", "ArrowLayout", "check_layers", "layer_semantics", "require_datasets"]

logger = logging.getLogger("speccompat.dataset")

HS_DIR, INFO_NAME, TOKEN_FREQ, STATE, BUILD_DIR = (ARROW_HS_DIR, ARROW_INFO_NAME, ARROW_TOKEN_FREQ, ARROW_STATE,
                                                   ARROW_BUILD_DIR)
#: stored name in the sample file -> name in the manifest (verify and resume hash ``input_ids``)
_FILE_NAMES = {"input_ids": "token_ids"}
_CANONICAL = {v: k for k, v in _FILE_NAMES.items()}
_FEATURES = {"input_ids": ("list", "int64"), "loss_mask": ("list", "int64"), "seq_len": ("value", "int64")}


def layer_semantics(layer_ids: list[int]) -> dict[str, Any]:
    """What each stored layer is, in speccompat's and in vLLM's numbering, and the trainer flag."""
    return {"layers": [{"layer": i, "meaning": f"output of decoder layer {i} (0-based), before the final norm",
                        "vllm_aux_id": i + 1} for i in layer_ids],
            "verifier_layer": layer_ids[-1] if layer_ids else None,
            "target_layer_ids": [i + 1 for i in layer_ids[:-1]],
            "note": "speculators >= 0.5 takes hidden_states[:, -1] as the verifier's last state and "
                    "hidden_states[:, :-1] as the draft's inputs; train with --target-layer-ids "
                    "(vLLM numbering) so that vLLM serves the draft the layers it was trained on"}


def check_layers(layer_ids: list[int], num_layers: int | None = None) -> None:
    """Raise :class:`Rejected` for a layer set speculators >= 0.5 would misread: not ascending, or
    (when ``num_layers`` is known: a set being written) one layer only, or whose last layer is not the
    final decoder layer."""
    if not layer_ids:
        raise Rejected(f"--layout {ARROW} needs at least one layer (the final decoder layer)")
    for a, b in zip(layer_ids, layer_ids[1:], strict=False):
        if b <= a:
            raise Rejected(f"--layout {ARROW}: layer {b} follows layer {a}; layers must be strictly ascending "
                           f"(speculators stacks them in forward order), got {list(layer_ids)}")
    if num_layers is not None and len(layer_ids) < 2:
        raise Rejected(f"--layout {ARROW}: one layer ({list(layer_ids)}) is the verifier's final state only: "
                       "speculators takes every layer but the last as the draft's input, which would have width 0; "
                       f"store at least one more layer before the final decoder layer {num_layers - 1}")
    if num_layers is not None and layer_ids[-1] != num_layers - 1:
        raise Rejected(f"--layout {ARROW}: the last layer is {layer_ids[-1]}, not the final decoder layer "
                       f"{num_layers - 1}: speculators takes the last one as the verifier's final state "
                       f"(add {num_layers - 1} to the layer ids)")


def _dir_of(owner: Any) -> Path:
    """The output directory: ``owner`` itself (a path), or its ``root`` (a
    :class:`~speccompat.dataset.directory.DatasetDir`) / ``out_dir``."""
    if isinstance(owner, (str, os.PathLike)):
        return Path(owner)
    for attr in ("root", "out_dir"):
        value = getattr(owner, attr, None)
        if isinstance(value, (str, os.PathLike)):
            return Path(value)
    raise TypeError(f"not an output directory: {owner!r}")


def _as_tensor(dtype: str, shape: list[int], buf: memoryview) -> Any:
    return tensor_from(dtype, shape, buf)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links on this file system: a copy
        shutil.copyfile(src, dst)


class ArrowLayout(Layout):
    name = ARROW
    suffix = SUFFIXES[ARROW]
    side_files = (HS_DIR, INFO_NAME, TOKEN_FREQ, STATE, "dataset_info.json")

    def __init__(self, layer_ids: list[int] | None = None) -> None:
        self.layer_ids = list(layer_ids or [])

    def is_sample_file(self, name: str) -> bool:
        return name.endswith(self.suffix)

    def tensors(self, sample: Any, hidden_states: list[Any], spec: StoredSpec) -> list[tuple[str, Any]]:
        """For fp8: hs-connectors' fp8 schema (``hidden_states`` float8_e4m3fn and
        ``hidden_states_scales`` float32, :mod:`speccompat.dataset.fp8`)."""
        import torch

        check_layers(list(spec.layer_ids))
        if len(spec.layer_ids) != len(hidden_states):
            raise ValueError(f"{len(hidden_states)} hidden-state tensors for {len(spec.layer_ids)} layer ids")
        dtype = getattr(torch, spec.torch_dtype_name)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.num_tokens
        scales = []
        if spec.granularity is not None:
            stacked, s = quantize(hidden_states, spec.granularity, stack=True)
            scales = [(SCALES, s)]
        else:
            stacked = torch.stack([h if h.dtype == dtype else h.to(dtype) for h in hidden_states], dim=1)
        return [("input_ids", torch.as_tensor(sample.input_ids, dtype=torch.int64)),
                ("hidden_states", stacked), *scales,
                ("loss_mask", torch.as_tensor(mask, dtype=torch.int64))]

    def expected_tensors(self, n: int, layer_ids: list[int], hidden: int, has_mask: bool) -> dict[str, list[int]]:
        return {"input_ids": [n], "loss_mask": [n], "hidden_states": [n, len(layer_ids), hidden]}

    def encode(self, named: list[tuple[str, Any]], metadata: dict[str, str]) -> Encoded:
        enc = encode_safetensors([(_FILE_NAMES.get(n, n), t) for n, t in named], metadata)
        enc.tensors = [(_CANONICAL.get(n, n), *rest) for n, *rest in enc.tensors]
        return enc

    def read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        meta, tensors, mm = read_safetensors(path)
        return meta, {_CANONICAL.get(n, n): v for n, v in tensors.items()}, mm

    # -- the trainer's view ------------------------------------------------------------------

    def finalize(self, ddir: Any, entries: list[dict[str, Any]], *, token_freq: Any, token_freq_path: Path,
                 info: dict[str, Any]) -> None:
        """Build the Arrow dataset, ``hidden_states/hs_<row>`` and ``token_freq.pt`` over ``entries``
        (every finished entry of the manifest, in input order: row ``r`` is ``entries[r]``), from the
        one finish path (:func:`speccompat.dataset.finish.finish_dataset`). ``token_freq()`` gives the
        counts of ``token_freq.pt``; it is written inside the directory, where speculators >= 0.5
        looks for it (``token_freq_path`` is the 0.3/0.4 layout's). Streams over the files."""
        from datasets import Dataset
        from datasets.arrow_writer import ArrowWriter
        from tqdm import tqdm

        out_dir = _dir_of(ddir)
        check_own_dirs(out_dir, [BUILD_DIR, HS_DIR])  # a link or a file there: refused before anything is touched
        entries = list(entries)
        remove_own_dir(out_dir, BUILD_DIR)  # left by an interrupted build
        build = fresh_dir(out_dir, BUILD_DIR)
        os.mkdir(build / HS_DIR)
        rows = []
        writer = ArrowWriter(features=_features(), path=str(build / "rows.arrow"), writer_batch_size=1000)
        try:
            for r, e in enumerate(tqdm(entries, desc=f"{out_dir.name}: Arrow rows", unit="sample",
                                       disable=len(entries) < 1000)):
                path = out_dir / e["file"]
                _meta, t, _mm = self.read(path)
                ids = _as_tensor(*t["input_ids"])
                mask = _as_tensor(*t["loss_mask"])
                if len(ids) != e["num_tokens"] or len(mask) != len(ids):
                    raise Rejected(f"{path}: {len(ids)} token ids, {len(mask)} mask entries, the manifest says "
                                   f"{e['num_tokens']}: run `speccompat verify {out_dir}`")
                _link(path, build / HS_DIR / f"hs_{r}.safetensors")
                writer.write({"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": len(ids)})
                rows.append({"row": r, "id": e["id"], "file": e["file"]})
            writer.finalize()
        finally:
            writer.close()
        _save(Dataset.from_file(str(build / "rows.arrow")), build / "arrow")
        fp8 = ((info.get("provenance") or {}).get("hidden_states") or {}).get("dtype") == "fp8"
        view = {"format": ARROW, "rows": rows, **layer_semantics(self.layer_ids),
                "trainer": ("speculators >= 0.9: --hidden-states-backend fp8 (FP8Transfer dequantizes; the default "
                            "'file' backend would not), " if fp8 else "speculators >= 0.5: ")
                           + "--data-path DIR (0.8+: --on-missing raise), "
                           "--target-layer-ids " + " ".join(str(i + 1) for i in self.layer_ids[:-1])}
        _swap_in(out_dir, build, dict(token_freq()), view)
        logger.info("%s: Arrow dataset of %d rows for speculators %s; train with --target-layer-ids %s%s",
                    out_dir, len(rows), ">= 0.9" if fp8 else ">= 0.5", " ".join(str(i + 1) for i in self.layer_ids[:-1]),
                    " --hidden-states-backend fp8" if fp8 else "")

    def derived_names(self, root: Path) -> set[str]:
        """The names the trainer's view owns in ``root``."""
        names = set(self.side_files)
        names |= {p.name for p in Path(root).glob("data-*.arrow")}
        if os.path.lexists(Path(root) / BUILD_DIR):
            names.add(BUILD_DIR)
        return names

    def check_view(self, out_dir: Path, manifest: Manifest) -> list[str]:
        """Problems of the trainer's view."""
        return check_view(self, Path(out_dir), manifest)


def _features() -> Any:
    from datasets import Features, Sequence, Value

    return Features({k: Sequence(Value(t)) if kind == "list" else Value(t) for k, (kind, t) in _FEATURES.items()})


def _save(ds: Any, path: Path) -> None:
    """``ds`` in torch format (as speculators' preprocessing saves it) at ``path``, without
    ``datasets``' own progress bars (the rows already had one)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds.set_format(type="torch")
        ds.save_to_disk(str(path))
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    _content_fingerprint(path)


def _content_fingerprint(path: Path) -> None:
    """Replace the fingerprint ``save_to_disk`` put into ``state.json`` (it differs between two builds
    of the same rows: it hashes where the rows were built) with one derived from the content (the
    Arrow files and the rest of the state), so that two builds of one data set are byte-identical."""
    import hashlib

    state_path = path / STATE
    state = json.loads(state_path.read_text(encoding="utf-8"))
    h = hashlib.sha256(b"speccompat-arrow-view-v1")
    for p in sorted(path.glob("data-*.arrow")):
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    h.update(json.dumps({k: v for k, v in state.items() if k != "_fingerprint"}, sort_keys=True).encode())
    state["_fingerprint"] = h.hexdigest()[:16]
    state_path.write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")


def _swap_in(out_dir: Path, build: Path, freq: dict[int, int], info: dict[str, Any]) -> None:
    """Replace the old view with the one in ``build``. ``state.json`` goes last: until it is there the
    directory is not a loadable dataset (verify says so), never a mix of two views."""
    import io

    import torch

    check_own_dirs(out_dir, [BUILD_DIR, HS_DIR])
    (out_dir / STATE).unlink(missing_ok=True)
    fsync_dir(out_dir)
    for p in out_dir.glob("data-*.arrow"):
        p.unlink()
    (out_dir / "dataset_info.json").unlink(missing_ok=True)
    if os.path.lexists(out_dir / HS_DIR):
        shutil.rmtree(out_dir / HS_DIR)
    os.replace(build / HS_DIR, out_dir / HS_DIR)
    buf = io.BytesIO()
    torch.save(freq, buf)
    write_atomic(out_dir / TOKEN_FREQ, buf.getvalue())
    write_atomic(out_dir / INFO_NAME, json.dumps(info, indent=1).encode())
    arrow = build / "arrow"
    for p in sorted(arrow.iterdir()):
        if p.name != STATE:
            os.replace(p, out_dir / p.name)
    fsync_dir(out_dir)
    os.replace(arrow / STATE, out_dir / STATE)
    fsync_dir(out_dir)
    remove_own_dir(out_dir, BUILD_DIR)


def check_view(layout: ArrowLayout, out_dir: Path, manifest: Manifest) -> list[str]:
    """Problems of the trainer's view of ``out_dir`` against ``manifest``: every entry is one row, in
    input order, ``hs_<row>`` is its file, the row's ids/mask hash to its ``input_sha256``, ``seq_len``
    is its token count, ``token_freq.pt`` counts the masked tokens."""
    import torch

    rebuild = f"re-run the extraction or `speccompat merge {out_dir}` to rebuild it"
    try:
        require_datasets()
    except Rejected as exc:
        return [f"{STATE}: the Arrow view cannot be checked: {exc}"]
    linked = [why for n in (BUILD_DIR, HS_DIR) if (why := own_dir_problem(out_dir, n))]
    if linked:
        return [f"{why.removeprefix(str(out_dir) + '/')}: refused (never followed); remove it, then {rebuild}"
                for why in linked]
    if os.path.lexists(out_dir / BUILD_DIR):
        return [f"{BUILD_DIR}: left by an interrupted build of the Arrow view; {rebuild}"]
    if not (out_dir / STATE).is_file():
        return [f"{STATE}: missing: the Arrow view for speculators >= 0.5 was not built (an interrupted run?); "
                f"{rebuild}"]
    try:
        info = json.loads((out_dir / INFO_NAME).read_text(encoding="utf-8"))
        rows = info["rows"]
    except (OSError, ValueError, KeyError) as exc:
        return [f"{INFO_NAME}: unreadable ({exc}); {rebuild}"]
    p: list[str] = []
    want = sorted(manifest.entries.values(), key=lambda e: (e.get("line", 0), str(e["id"])))
    got = [(r.get("id"), r.get("file")) for r in rows]
    if got != [(e["id"], e["file"]) for e in want] or [r.get("row") for r in rows] != list(range(len(rows))):
        p.append(f"{INFO_NAME}: its {len(rows)} rows are not the manifest's {len(want)} entries in input order "
                 f"(the view is older than the manifest); {rebuild}")
        return p
    hs_names = {f"hs_{r}.safetensors" for r in range(len(rows))}
    present = {q.name for q in (out_dir / HS_DIR).iterdir()} if (out_dir / HS_DIR).is_dir() else set()
    p += [f"{HS_DIR}/{n}: extra file (not a row of the view)" for n in sorted(present - hs_names)]
    for r, e in enumerate(want):
        hs = out_dir / HS_DIR / f"hs_{r}.safetensors"
        src = out_dir / e["file"]
        if not hs.is_file():
            p.append(f"{HS_DIR}/{hs.name}: missing (row {r}, id {e['id']!r})")
        elif src.is_file() and not (os.path.samefile(hs, src) or filecmp.cmp(hs, src, shallow=False)):
            p.append(f"{HS_DIR}/{hs.name}: differs from {e['file']} (row {r}, id {e['id']!r})")
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(out_dir))
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return [*p, f"{STATE}: `datasets.load_from_disk` fails: {type(exc).__name__}: {exc}"]
    if ds.format.get("type") != "torch":
        p.append(f"{STATE}: format {ds.format.get('type')!r}, speculators saves it as 'torch'")
    if len(ds) != len(want):
        return [*p, f"Arrow dataset: {len(ds)} rows, the manifest has {len(want)} entries; {rebuild}"]
    freq: Counter[int] = Counter()
    raw = ds.with_format(None)
    for r, (row, e) in enumerate(zip(raw, want, strict=True)):
        ids, mask = row["input_ids"], row["loss_mask"]
        sha = e.get("input_sha256")
        if row["seq_len"] != e["num_tokens"] or len(ids) != e["num_tokens"]:
            p.append(f"Arrow row {r}: seq_len {row['seq_len']}, {len(ids)} ids, the manifest says {e['num_tokens']}")
        elif sha and input_digest(ids, mask) != sha and not (input_digest(ids, None) == sha and set(mask) <= {1}):
            p.append(f"Arrow row {r}: input_ids/loss_mask do not hash to id {e['id']!r}'s input_sha256")
        freq.update(t for t, m in zip(ids, mask, strict=False) if m)
    try:
        stored = torch.load(out_dir / TOKEN_FREQ, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        p.append(f"{TOKEN_FREQ}: unreadable: {exc}")
    else:
        if stored != dict(freq):
            p.append(f"{TOKEN_FREQ}: differs from the counts of the loss-masked tokens of the rows")
    if info.get("layers") != layer_semantics(layout.layer_ids)["layers"]:
        p.append(f"{INFO_NAME}: its layers differ from the provenance's {layout.layer_ids}")
    return p


def require_datasets() -> None:
    """:class:`Rejected` unless ``datasets`` and ``pyarrow`` can be imported."""
    import importlib.util

    missing = [m for m in ("datasets", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        raise Rejected(f"--layout {ARROW} needs {' and '.join(missing)}: pip install 'speccompat[arrow]'")


def layout(layer_ids: list[int] | None = None, num_layers: int | None = None) -> ArrowLayout:
    """The layout for ``layer_ids``, checked (ascending). ``num_layers`` is given by what writes a
    data set: then the last layer must be the final one, and ``datasets`` must be importable (so a
    run is refused before its engine starts, not at its end)."""
    if layer_ids:
        check_layers(list(layer_ids), num_layers)
    if num_layers is not None:
        require_datasets()
    return ArrowLayout(layer_ids)

