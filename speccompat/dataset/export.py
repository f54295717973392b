"""``speccompat export DATASET --to LAYOUT OUT``: convert a finished data set to another layout, offline.

Streams over the source's samples in input order (each file read once, memory-mapped, checked
against its manifest checksums; at most ``max_in_flight_bytes`` of samples in memory), writes them
through the same writer as an extraction (atomic files, checksums, provenance), builds the layout's
side files, then verifies the result. The new provenance is the source's with the new layout and
``exported_from`` (the source's path, layout, dtype and provenance digest); ``--dtype`` converts
bfloat16 <-> fp8 (:mod:`speccompat.dataset.fp8`) on the way. A conversion that would lose
or misnumber a layer is refused before anything is written, naming the layer: to
``speculators-arrow`` the layers are stacked ascending and the last must be the final decoder layer.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .args import renamed_value
from .checksum import digest_fn
from .directory import EXPORT_STAGING, DatasetDir
from .errors import DatasetError, Rejected
from .fsutil import LOCK_NAME, fsync_dir
from .layouts import layout_named
from .manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from .reader import decode_sample, tensor_from
from .spec import ARROW, SAFETENSORS, SPECULATORS, StoredSpec

__all__ = ["EXPORT_FORMATS", "add_parser", "export_dataset", "main"]

logger = logging.getLogger("speccompat.dataset")

#: --to name -> layout name
EXPORT_FORMATS = {ARROW: ARROW, SPECULATORS: SPECULATORS, SAFETENSORS: SAFETENSORS}
#: old --to names -> the layout's one name
RENAMED = {"speculators-0.4": SPECULATORS}


def _plan_layers(layer_ids: list[int], num_layers: int | None, layout: str) -> list[int]:
    """The target's layer order; :class:`Rejected` naming the layer when none is faithful."""
    if len(set(layer_ids)) != len(layer_ids):
        raise Rejected(f"the source stores layer(s) {sorted({i for i in layer_ids if layer_ids.count(i) > 1})} "
                       "more than once")
    if layout != "speculators-arrow":
        return list(layer_ids)
    from .arrow_format import check_layers

    ordered = sorted(layer_ids)
    if num_layers is None:
        raise Rejected("the source's provenance lacks model.num_hidden_layers: cannot tell whether its last "
                       f"layer {ordered[-1]} is the final decoder layer the trainer needs")
    check_layers(ordered, num_layers)
    return ordered


class _Sample:
    """What the writer needs of a sample."""

    def __init__(self, entry: dict[str, Any], input_ids: list[int], loss_mask: list[int] | None) -> None:
        self.id, self.line = entry["id"], entry.get("line", 0)
        self.input_ids, self.loss_mask = input_ids, loss_mask
        self.truncated_from = entry.get("truncated_from")
        self.digest = entry["input_sha256"]  # checked against the ids and mask by verify

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _read_source(sdir: DatasetDir, entry: dict[str, Any], layout: Any, digest: Any, layer_ids: list[int],
                 dequantize_dtype: Any = None, *, prov: dict[str, Any] | None = None,
                 prov_sha: str | None = None) -> tuple[_Sample, dict[int, Any]]:
    """One source sample, checked as it is read: its tensors against the manifest's checksums and,
    given ``prov``, at verify's level (shapes, finite states, fp8 scales finite and positive, the
    input's hash, the embedded provenance) on the very bytes that are converted."""
    from .directory import _verify_contents
    from .inputs import input_digest

    src, path = sdir.root, sdir.path(entry["file"])
    try:
        _meta, raw, keep = layout.read(path)
    except (OSError, ValueError) as exc:
        raise Rejected(f"{path}: unreadable ({exc}); run `speccompat verify {src}`") from None
    want = entry.get("tensors") or {}
    for name, (dtype, shape, buf) in raw.items():
        w = want.get(name) or {}
        if [dtype, shape] != [w.get("dtype"), w.get("shape")] or digest(buf) != w.get("checksum"):
            raise Rejected(f"{path}: tensor {name} does not match the manifest; run `speccompat verify {src}`")
    missing = sorted(set(want) - set(raw))
    if missing:
        raise Rejected(f"{path}: tensor(s) {', '.join(missing)} of the manifest are missing from the file; "
                       f"run `speccompat verify {src}`")
    if prov is not None:
        found = _verify_contents(entry["file"], entry, layout, _meta, raw, prov, prov_sha)
        if found:
            raise Rejected(f"{src}/{found[0]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
                           + f": verify rejects this source; nothing was exported (run `speccompat verify {src}`)")
    try:
        tensors = {n: tensor_from(*v) for n, v in raw.items()}
        ids_t, mask_t, layers = decode_sample(layout.name, tensors, layer_ids, dtype=dequantize_dtype)
        ids = ids_t.tolist()
        mask = mask_t.tolist() if mask_t is not None else None
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise Rejected(f"{path}: its tensors are not a sample of this data set ({type(exc).__name__}: {exc}); "
                       f"run `speccompat verify {src}`") from None
    if mask is not None and input_digest(ids, mask) != entry.get("input_sha256") \
            and input_digest(ids, None) == entry.get("input_sha256") and set(mask) <= {1}:
        mask = None  # the input had no loss mask; the source layout filled in ones
    sample = _Sample(entry, ids, mask)
    sample._keep = keep  # type: ignore[attr-defined]  # the mapping the layer tensors view
    return sample, dict(zip(layer_ids, layers, strict=True))


def _is_within(inner: Path, outer: Path) -> bool:
    try:
        inner.resolve().relative_to(outer.resolve())
    except ValueError:
        return False
    return True


def staging_dir(out: Path) -> Path:
    """Where an export into ``out`` builds its data set: ``<out>.speccompat-export-staging``, beside
    ``out`` (same file system, so it is published by one rename; never inside ``out``, where a
    trainer's loader walking the directory would read a half-written set)."""
    r = Path(os.path.abspath(out))
    return r.with_name(r.name + EXPORT_STAGING)


def _source_lock(sdir: DatasetDir) -> Any:
    """A shared flock on the source's lock file for the export's life (None: the source has none, no
    extraction ever ran in it). :class:`Rejected` while an extraction or a shard holds it, as merge
    refuses: what it has not finished is not a data set to export. Opened read-only (a read-only
    source works) and never through a link."""
    import fcntl

    from .directory import PART_LOCK_RE

    src = sdir.root
    names = [LOCK_NAME, *(n for n in sdir.names() if PART_LOCK_RE.match(n))]
    held = None
    for name in names:
        try:
            fd = os.open(sdir.path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise Rejected(f"{sdir.path(name)}: cannot open the source's lock file ({exc.strerror}); refused") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            if held is not None:
                os.close(held)
            raise Rejected(f"{src} is being written by an extraction (pid {holder}, {name}): export it when the "
                           "extraction has ended") from None
        if name == LOCK_NAME:
            held = fd  # kept: no extraction starts in the source while it is read
        else:
            os.close(fd)
    return held


def _clear_staging(parent: DatasetDir, stage: DatasetDir) -> None:
    """Remove the staging folder ``stage`` (in ``parent``) an interrupted export left, saying what it held;
    :class:`Rejected` while another export holds it, or when it is a link or not a folder."""
    parent.check_own_dirs([stage.root.name])
    if os.path.lexists(stage.path(LOCK_NAME)) and stage.held(LOCK_NAME):
        raise Rejected(f"another export is writing to {stage} (its staging folder): wait for it to end")
    names = stage.names()
    entries = len(stage.manifest().entries) if MANIFEST_NAME in names else 0
    logger.warning("%s: found the staging folder of an interrupted export (%d file(s), %d sample(s) in its "
                   "manifest): removed; exporting anew", stage, len([n for n in names if n != LOCK_NAME]), entries)
    parent.remove_own_dir(stage.root.name)


@contextlib.contextmanager
def _export_words(out: Path, stage_path: Path) -> Any:
    """The writer's failures in export's words: an export keeps no finished file and does not
    resume (the extraction's \"finished files are kept: re-run to resume\" is not true of it)."""
    from .errors import NoSpace, WriterFailed

    try:
        yield
    except NoSpace as exc:
        cause = exc.__cause__
        why = getattr(cause, "strerror", None) or "no space left"
        raise NoSpace(f"no space left on the file system of {stage_path} ({why}): nothing was exported and the "
                      f"staging folder is removed; free some space (the new set needs about the source's size) "
                      f"and run the export again") from cause
    except WriterFailed as exc:
        cause = exc.__cause__
        raise WriterFailed(f"writing the new set in {stage_path} failed ({type(cause).__name__}: {cause}): nothing "
                           f"was exported into {out}; run the export again") from cause


def export_dataset(src: Path, to: str, out: Path, *, threads: int = 4, max_in_flight_bytes: int = 2 << 30,
                   progress: bool = True, dtype: str | None = None, fp8_scale: str | None = None) -> list[str]:
    """Convert ``src`` to layout ``to`` (a key of :data:`EXPORT_FORMATS`) in the new directory ``out``;
    returns ``verify``'s problems of the result (empty: intact, and in place). Raises :class:`Rejected`
    when the conversion is not possible or a source file is not as its manifest says (every file is
    checked as it is read, at verify's level: a source verify rejects is not exported).

    The new data set is written into :func:`staging_dir` (``<out>.speccompat-export-staging``, beside
    ``out``, created anew, never through a link), verified there, and only then published by renaming
    that folder to ``out`` (an empty ``out`` is replaced): no reader ever sees part of a set in
    ``out``. A refused or failed export leaves ``out`` as it was (empty or absent); a killed one
    leaves only the staging folder, which the next export into ``out`` removes, saying so. The
    speculators (0.3/0.4) layout's token-frequency file is kept beside the directory
    (``<out>.token_freq.pt``; an existing one is refused, not replaced).

    ``dtype``: the stored dtype of the result (default: the source's); ``fp8``: quantized with
    ``fp8_scale`` scales (default: the source's granularity, else per token). An fp8 source is
    dequantized exactly (into float32) first, so that an fp8 -> fp8 export of the same granularity
    stores the same values and scales."""
    from tqdm import tqdm

    from . import fp8
    from .store import OpenDataset
    from .verify import verify_dataset

    src, out = Path(src), Path(out)
    to = RENAMED.get(to, to)  # the old name of a layout
    if to not in EXPORT_FORMATS:
        raise Rejected(f"unknown layout {to!r} (known: {', '.join(EXPORT_FORMATS)})")
    if fp8_scale is not None and dtype != fp8.FP8:
        raise Rejected(f"--fp8-scale {fp8_scale} applies to --dtype fp8 only (the result is stored as "
                       f"{dtype or 'the source stores it'}): drop it, or pass --dtype fp8")
    if not src.is_dir():
        raise Rejected(f"{src}: not a directory")
    sdir = DatasetDir(src)
    src_lock = _source_lock(sdir)
    try:
        return _export_checked(sdir, to, out, threads=threads, max_in_flight_bytes=max_in_flight_bytes,
                               progress=progress, dtype=dtype, fp8_scale=fp8_scale, tqdm=tqdm, fp8=fp8,
                               open_dataset=OpenDataset, verify=verify_dataset)
    finally:
        if src_lock is not None:
            os.close(src_lock)


def _export_checked(sdir: DatasetDir, to: str, out: Path, *, threads: int, max_in_flight_bytes: int, progress: bool,
                    dtype: str | None, fp8_scale: str | None, tqdm: Any, fp8: Any, open_dataset: Any,
                    verify: Any) -> list[str]:
    src = sdir.root
    m = sdir.manifest()
    parts = sdir.parts()
    merge_hint = (f"; it holds {len(parts)} manifest part(s) of a sharded extraction not merged: run "
                  f"`speccompat merge {src}` first") if parts else ""
    if m.header is None:
        raise Rejected(f"{src}: no {MANIFEST_NAME} header: not a speccompat data set{merge_hint}")
    if parts:
        raise Rejected(f"{src}{merge_hint}")
    if m.problems:
        raise Rejected(f"{src}: {m.problems[0]}; run `speccompat verify {src}`")
    if not m.entries:
        raise Rejected(f"{src}: its manifest lists no sample: nothing to export")
    prov = m.provenance or {}
    src_spec = StoredSpec.of_provenance(prov)
    src_layer_ids = list(src_spec.layer_ids)
    src_layout = layout_named(m.header["layout"], src_layer_ids)
    target = EXPORT_FORMATS[to]
    num_layers = prov.get("model", {}).get("num_hidden_layers")
    dtype = dtype or src_spec.dtype
    # what the new set stores: the source's, in the layers the target reads, as --dtype/--fp8-scale say
    spec = StoredSpec.of_options(dtype, _plan_layers(src_layer_ids, num_layers, target), src_spec.hidden_size,
                                 fp8_scale or src_spec.granularity)
    layer_ids = list(spec.layer_ids)
    if why := fp8.refuse(dtype, target):
        raise Rejected(why + ("" if dtype != src_spec.dtype else f" (the source is {src_spec.dtype}: pass --dtype "
                                                                   "bfloat16 to dequantize it)"))
    if os.path.lexists(out) and not out.is_dir():
        raise Rejected(f"{out} exists and is not a directory: export writes a new data set into a directory")
    if _is_within(out, src) or _is_within(src, out):
        raise Rejected(f"{out} and the source {src} overlap: export writes a new data set into a directory of its own")
    stage_path = staging_dir(out)
    if _is_within(stage_path, src):
        raise Rejected(f"{stage_path} (where export builds the new set) is inside the source {src}")
    ddir, stage = DatasetDir(out), DatasetDir(stage_path)
    layout = layout_named(target, layer_ids, num_layers)
    freq_final = ddir.token_freq_path() if layout.token_freq_beside else None
    freq_staged = stage.token_freq_path() if freq_final is not None else None
    if os.path.lexists(out):
        extra = [n for n in os.listdir(out) if n != LOCK_NAME]
        if extra:
            if freq_final is not None and freq_staged is not None and os.path.lexists(freq_staged) \
                    and MANIFEST_NAME in extra and not os.path.lexists(stage_path) and not os.path.lexists(freq_final):
                os.replace(freq_staged, freq_final)  # killed between the two renames of a finished export
                logger.warning("%s: a finished export whose token-frequency file was still at %s: moved it to %s",
                               out, freq_staged, freq_final)
                return []
            what = (f"it holds a data set ({MANIFEST_NAME}); " if MANIFEST_NAME in extra else "") + \
                f"{len(extra)} name(s): {', '.join(sorted(extra)[:3])}{' ...' if len(extra) > 3 else ''}"
            raise Rejected(f"{out} exists and is not empty ({what}): export writes a new data set; remove it or "
                           "export into another directory")
        if LOCK_NAME in os.listdir(out) and ddir.held(LOCK_NAME):
            raise Rejected(f"another command is writing to {out}")
    if freq_final is not None and os.path.lexists(freq_final):
        raise Rejected(f"{freq_final} exists: the {to} layout keeps its token frequencies there; export does not "
                       "replace it (remove it, or export to another directory)")
    parent = stage_path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Rejected(f"cannot create {parent}: {exc.strerror or exc}") from None
    pdir = DatasetDir(parent)
    try:
        pdir.path(stage_path.name)
    except ValueError:
        raise Rejected(f"{out}: its name is too long for the staging folder {stage_path.name!r} beside it") from None
    if os.path.lexists(stage_path):
        _clear_staging(pdir, stage)
    if freq_staged is not None and os.path.lexists(freq_staged):
        os.unlink(freq_staged)  # a leftover of an interrupted export (a file, or a link: removed itself)
    try:
        pdir.fresh_dir(stage_path.name)
    except OSError as exc:
        raise Rejected(f"cannot create {stage_path} (export builds the new set there, beside {out}): "
                       f"{exc.strerror or exc}") from None
    try:
        with stage.lock(busy=f"another export is writing to {stage_path}"), _export_words(out, stage_path):
            problems = _export_staged(sdir, m, src_layout, src_spec, to, stage, layout, spec, prov, freq_staged,
                                      threads=threads, max_in_flight_bytes=max_in_flight_bytes, progress=progress,
                                      tqdm=tqdm, open_dataset=open_dataset, verify=verify)
            if problems:
                return problems
            # published: one rename (an empty out is replaced), then the token frequencies beside it
            if os.path.lexists(out):
                ddir.unlink(LOCK_NAME)  # rename replaces an empty directory only
            os.rename(stage_path, os.path.abspath(out))
            ddir.unlink(LOCK_NAME)  # moved with the folder; still held through its descriptor
            if freq_final is not None and freq_staged is not None:
                os.replace(freq_staged, freq_final)
            fsync_dir(parent)
            return []
    finally:
        if os.path.lexists(stage_path):
            with contextlib.suppress(OSError, Rejected):
                pdir.remove_own_dir(stage_path.name)
        if freq_staged is not None:
            with contextlib.suppress(OSError):
                freq_staged.unlink()


def _export_staged(sdir: DatasetDir, m: Manifest, src_layout: Any, src_spec: StoredSpec, to: str, stage: DatasetDir,
                   layout: Any, spec: StoredSpec, prov: dict[str, Any], freq_staged: Path | None, *, threads: int,
                   max_in_flight_bytes: int, progress: bool, tqdm: Any, open_dataset: Any, verify: Any) -> list[str]:
    """Write and verify the new set in ``stage``; returns verify's problems (empty: ready to publish)."""
    import torch

    from . import fp8

    src, src_dtype, src_layer_ids, layer_ids = sdir.root, src_spec.dtype, list(src_spec.layer_ids), list(spec.layer_ids)
    target = layout.name
    new_prov = prov_mod.with_spec(prov, spec)
    new_prov["layout"] = target
    new_prov["exported_from"] = {"path": str(src.resolve()), "layout": m.header["layout"], "dtype": src_dtype,
                                 "provenance_sha256": m.header.get("provenance_sha256") or prov_mod.digest(prov),
                                 "entries": len(m.entries)}
    manifest = stage.new_manifest()
    manifest.header = {"speccompat_dataset": SCHEMA_VERSION, "layout": target, "checksum": m.header["checksum"],
                       "provenance": new_prov, "provenance_sha256": prov_mod.digest(new_prov)}
    manifest.rewrite()
    entries = sorted(m.entries.values(), key=lambda e: (e.get("line", 0), str(e["id"])))
    files: dict[str, str] = {}
    ds = open_dataset(stage.root, layout, manifest, new_prov, [], [], files, 0, spec)
    # an fp8 source: its values exactly (fp8 * scale in float32), then cast or quantized again
    exact = torch.float32 if src_dtype == fp8.FP8 else None
    digest = digest_fn(m.header["checksum"])
    logger.info("export %s (%s, %d samples) -> %s (%s, layers %s)", src, m.header["layout"], len(entries),
                stage.root, target, layer_ids)
    with ds.writer(threads=threads, max_in_flight_bytes=max_in_flight_bytes, check_cast=spec.dtype != src_dtype) as w:
        for k, e in enumerate(tqdm(entries, desc=f"export {src.name} -> {to}", unit="sample",
                                   disable=not progress)):
            sample, by_layer = _read_source(sdir, e, src_layout, digest, src_layer_ids, exact, prov=prov,
                                            prov_sha=m.header.get("provenance_sha256"))
            files[sample.id] = layout.file_name(sample.id, k)
            w.submit([ds.job(sample, [by_layer[i] for i in layer_ids])])
    if spec.is_fp8 and (note := fp8.flushed_note(w.stats.fp8_flushed, w.stats.fp8_values, spec.granularity)):
        logger.warning("%s", note)
    if w.failed:
        sample, why = w.failed[0]
        raise Rejected(f"{len(w.failed)} sample(s) of {src} could not be written (id {sample.id!r}: {why}); "
                       f"nothing was exported")
    ds.finish(freq_staged)  # the one finish path
    problems, n = verify(stage.root, threads, own_lock=True)  # the staging lock is this export's
    logger.info("export %s: %d samples written and verified, %d problem(s)", stage.root, n, len(problems))
    return [f"{p} (in the staging folder; nothing was exported)" for p in problems]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    e = sub.add_parser("export", help="convert a data set to another layout offline (no GPU), then verify it "
                       "(exit 0 intact, 1 problems found, 2 refused)")
    e.add_argument("dataset", type=Path, help="the source data set's directory (holds manifest.jsonl)")
    e.add_argument("--to", required=True, choices=sorted(EXPORT_FORMATS), type=renamed_value("--to", RENAMED),
                   help="the layout, as extract's --layout: speculators-arrow: speculators >= 0.5 "
                        "(Arrow + hidden_states/hs_<row>.safetensors); speculators: data_<i>.pt for 0.3/0.4; "
                        "safetensors: speccompat's default")
    e.add_argument("out", type=Path, help="the new data set's directory (must not exist, or be empty)")
    e.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "fp8"), default=None,
                   help="stored dtype of the result (default: the source's); fp8 <-> bfloat16 converts "
                        "(fp8: float8_e4m3fn with float32 scales, as speccompat extract --dtype fp8)")
    e.add_argument("--fp8-scale", choices=("token", "token-layer"), default=None,
                   help="--dtype fp8: the scales' granularity (default: the source's, else token)")
    e.add_argument("--threads", type=int, default=4, help="files written and verified in parallel")
    e.add_argument("--max-in-flight-bytes", type=int, default=2 << 30,
                   help="bound on the samples held in memory while they are written")
    return e


def speculators_missing(layout: str) -> str | None:
    """Why ``layout`` cannot be written here before any sample is converted: the speculators (0.3/0.4)
    layout's data_config.json is made by speculators' own code, so speculators must be importable."""
    import importlib.util

    if layout != SPECULATORS or importlib.util.find_spec("speculators") is not None:
        return None
    return ("--to speculators needs speculators 0.3 or 0.4 installed (its data_config.json is written by "
            "speculators' own code), and it is not; nothing was exported")


def main(args: argparse.Namespace) -> int:
    if (why := speculators_missing(args.to)) is not None:  # before any sample is converted
        print(f"export {args.dataset}: {why}", file=sys.stderr)
        return 2
    try:
        problems = export_dataset(args.dataset, args.to, args.out, threads=args.threads,
                                  max_in_flight_bytes=args.max_in_flight_bytes, dtype=args.dtype,
                                  fp8_scale=args.fp8_scale)
    except Rejected as exc:
        print(f"export {args.dataset}: {exc}", file=sys.stderr)
        return 2
    except DatasetError as exc:
        print(f"export {args.dataset}: {exc}", file=sys.stderr)
        return exc.exit_status
    except OSError as exc:
        print(f"export {args.dataset}: {exc}; nothing was exported", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"export {args.dataset}: interrupted; nothing was exported", file=sys.stderr)
        return 130
    for line in problems:
        print(f"{args.out}/{line}")
    print(f"export {args.dataset} -> {args.out} ({args.to}): {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0
