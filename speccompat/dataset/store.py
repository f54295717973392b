"""Opening an output directory for a run: checks, lock, provenance, resume plan, disk space.

:func:`open_dataset` does everything that must happen before an engine starts and returns an
:class:`OpenDataset` whose ``todo`` are the samples still to extract; :meth:`OpenDataset.writer`
gives the background writer for them and :meth:`OpenDataset.finish` writes a layout's side files.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import default_algorithm, digest_fn
from .errors import Rejected
from .formats import DTYPES, SPECULATORS, Layout, layout_named
from .fsutil import LOCK_NAME, TMP_SUFFIX, check_output_dir, free_bytes, human, lock_output_dir
from .inputs import Sample
from .manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from .writer import DatasetWriter, WriteJob

__all__ = ["OpenDataset", "check_file", "open_dataset"]

logger = logging.getLogger("speccompat.dataset")


def check_file(path: Path, entry: dict[str, Any], layout: Layout, digest: Any) -> str | None:
    """None when ``path`` holds exactly what ``entry`` recorded (sizes, dtypes, shapes, checksums)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry.get("bytes"):
        return f"{size} bytes, the manifest says {entry.get('bytes')}"
    try:
        _meta, tensors, _keep = layout.read(path)
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    want = entry.get("tensors") or {}
    if set(tensors) != set(want):
        return f"tensors {sorted(tensors)}, the manifest says {sorted(want)}"
    for name, (dtype, shape, buf) in tensors.items():
        w = want[name]
        if dtype != w["dtype"] or shape != w["shape"]:
            return f"{name}: {dtype} {shape}, the manifest says {w['dtype']} {w['shape']}"
        if digest(buf) != w["checksum"]:
            return f"{name}: checksum differs from the manifest (the file changed after it was written)"
    return None


@dataclass
class OpenDataset:
    out_dir: Path
    layout: Layout
    manifest: Manifest
    provenance: dict[str, Any]
    samples: list[Sample]
    todo: list[Sample]
    files: dict[str, str]  # id -> file name
    done: int
    layer_ids: list[int]
    dtype: str
    hidden_size: int
    lock: Any = None
    speculators_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def checksum(self) -> str:
        return self.manifest.header["checksum"]

    def job(self, sample: Sample, hidden_states: list[Any]) -> WriteJob:
        entry: dict[str, Any] = {"id": sample.id, "line": sample.line, "num_tokens": sample.num_tokens,
                                 "input_sha256": sample.digest}
        if sample.truncated_from is not None:
            entry["truncated_from"] = sample.truncated_from
        meta: dict[str, str] = {}
        if self.layout.name != SPECULATORS:
            facts = {k: v for k, v in entry.items() if k != "input_sha256"}
            meta = {"speccompat_sample": json.dumps({**facts, "layer_ids": self.layer_ids}, ensure_ascii=True),
                    "speccompat_provenance": json.dumps(self.provenance, sort_keys=True, ensure_ascii=True)}
        return WriteJob(sample, self.files[sample.id], hidden_states, entry, meta)

    def writer(self, *, threads: int = 4, max_in_flight_bytes: int = 8 << 30, **kw: Any) -> DatasetWriter:
        import torch

        return DatasetWriter(self.out_dir, self.layout, self.manifest, layer_ids=self.layer_ids,
                             dtype=getattr(torch, DTYPES[self.dtype][2]), checksum=self.checksum, threads=threads,
                             max_in_flight_bytes=max_in_flight_bytes, **kw)

    def finish(self, token_freq_path: Path | None = None) -> None:
        """The layout's side files, from the manifest (speculators: data_config.json,
        sample_lengths.json for 0.4+, the token-frequency file)."""
        if self.layout.name == SPECULATORS:
            from .speculators_format import write_side_files

            write_side_files(self, token_freq_path)
        elif hasattr(self.layout, "finalize"):  # speculators-arrow: Arrow rows over every finished sample
            self.layout.finalize(self.out_dir)


def _expected_bytes(sample: Sample, n_layers: int, hidden: int, per: int) -> int:
    return n_layers * sample.num_tokens * hidden * per + 16 * sample.num_tokens + 4096


def _resume(out_dir: Path, manifest: Manifest, samples: list[Sample], candidates: list[Sample],
            files: dict[str, str], check: Callable[[Sample], str | None], *, checked: str, check_threads: int,
            layer_ids: list[int], hidden: int, dtype: str, keep_ids: frozenset[str] | set[str] = frozenset()
            ) -> tuple[set[str], list[Sample], int, int]:
    """The resume plan, once the run knows which stored entries are its own.

    ``check`` (None: intact, else why not) runs on every sample of ``candidates`` (those with a stored
    entry, whose file is ``files[id]``); a failed one's entry is dropped from ``manifest`` and its file
    removed (unless it is missing), so the sample is redone. Entries whose file is gone are dropped
    too, except those of the ids done and of ``keep_ids``; then ``manifest`` is rewritten
    (:class:`Rejected` when it cannot be). ``checked`` says in the log what the files were checked against.

    Returns (ids done, the samples of ``samples`` still to extract, their expected bytes, free bytes
    in ``out_dir``).
    """
    t0 = time.monotonic()
    with ThreadPoolExecutor(max(1, check_threads)) as pool:
        results = list(pool.map(check, candidates))
    done_ids: set[str] = set()
    for s, why in zip(candidates, results, strict=True):
        if why is None:
            done_ids.add(s.id)
            continue
        manifest.entries.pop(files[s.id], None)
        if why != "missing":
            logger.warning("%s (id %r, line %d): %s; it will be redone", files[s.id], s.id, s.line, why)
            (out_dir / files[s.id]).unlink(missing_ok=True)
    if candidates:
        logger.info("checked %d finished file(s) %s in %.1f s: %d intact, %d to redo", len(candidates), checked,
                    time.monotonic() - t0, len(done_ids), len(candidates) - len(done_ids))
    for f, e in list(manifest.entries.items()):
        if e["id"] not in done_ids and e["id"] not in keep_ids and not (out_dir / f).exists():
            del manifest.entries[f]
    try:
        manifest.rewrite()
    except OSError as exc:
        raise Rejected(f"cannot write {manifest.path}: {exc.strerror}") from None

    todo = [s for s in samples if s.id not in done_ids]
    per = DTYPES[dtype][0]
    need = sum(_expected_bytes(s, len(layer_ids), hidden, per) for s in todo)
    return done_ids, todo, need, free_bytes(out_dir)


def _run_facts(out_dir: Path, provenance: dict[str, Any]) -> tuple[list[int], str, int, Any]:
    """``(layer ids, dtype, hidden size, layout)`` of a run from its provenance, once ``out_dir``
    is known to be usable (:func:`check_output_dir`)."""
    hs = provenance["hidden_states"]
    layer_ids, dtype = list(hs["layer_ids"]), hs["dtype"]
    layout = layout_named(provenance["layout"], layer_ids, provenance["model"].get("num_hidden_layers"))
    check_output_dir(out_dir)
    return layer_ids, dtype, int(provenance["model"]["hidden_size"]), layout


def open_dataset(out_dir: Path, samples: list[Sample], provenance: dict[str, Any], *, overwrite: bool = False,
                 check_threads: int = 4, speculators_version: str | None = None) -> OpenDataset:
    """Everything before the engine: raises :class:`Rejected` for any reason not to start."""
    out_dir = Path(out_dir)
    layer_ids, dtype, hidden, layout = _run_facts(out_dir, provenance)
    lock = lock_output_dir(out_dir)
    from .shards import find_parts

    if parts := find_parts(out_dir):
        raise Rejected(f"{out_dir} holds {len(parts)} manifest part(s) of a sharded extraction ({parts[0].name} ...): "
                       "run `speccompat merge DIR` first, or keep running it with --num-shards")
    leftovers = sorted(p for p in out_dir.iterdir() if p.name.endswith(TMP_SUFFIX))
    for p in leftovers:
        p.unlink()
    if leftovers:
        logger.info("removed %d temporary file(s) left by an interrupted run: %s", len(leftovers),
                    ", ".join(p.name for p in leftovers[:5]) + (" ..." if len(leftovers) > 5 else ""))

    manifest = Manifest(out_dir).load()
    for problem in manifest.problems:
        logger.warning("%s: dropped", problem)
    ids = {s.id for s in samples}
    by_id = manifest.by_id()
    diffs: list[str] = []
    if manifest.header is None:
        strays = sorted(p.name for p in out_dir.iterdir() if layout.is_sample_file(p.name)
                        or p.name in ("index.jsonl", *layout.side_files))
        if strays and not overwrite:
            raise Rejected(f"{out_dir} holds {len(strays)} file(s) ({', '.join(strays[:3])}"
                           f"{' ...' if len(strays) > 3 else ''}) but no {MANIFEST_NAME}: nothing says what "
                           "produced them. Use another --output-dir, or --overwrite to replace them")
    else:
        if manifest.header.get("speccompat_dataset") != SCHEMA_VERSION:
            diffs.append(f"manifest schema {manifest.header.get('speccompat_dataset')} -> {SCHEMA_VERSION}")
        diffs += prov_mod.differences(manifest.provenance or {}, provenance)
        for s in samples:
            e = by_id.get(s.id)
            if e is not None and e.get("input_sha256") != s.digest:
                diffs.append(f"id {s.id!r} (line {s.line}): input_ids/loss_mask differ from the ones its file "
                             f"{e['file']} was made from")
    if diffs and not overwrite:
        shown = diffs[:20] + ([f"... and {len(diffs) - 20} more"] if len(diffs) > 20 else [])
        raise Rejected(f"{out_dir} holds a data set made differently; nothing was started or written. "
                       "Differences (stored -> this run):\n  " + "\n  ".join(shown) +
                       "\nUse another --output-dir, or --overwrite to redo every sample of this input")

    if overwrite and (manifest.header is not None or diffs):
        keep_created = None
    else:
        keep_created = (manifest.provenance or {}).get("created")
    if keep_created:
        provenance = {**provenance, "created": keep_created}  # the data set's first run
    checksum = (manifest.header or {}).get("checksum") if not overwrite else None
    checksum = checksum or default_algorithm()
    digest = digest_fn(checksum)

    if overwrite:
        old = manifest.entries
        manifest.entries = {}
        if old:
            logger.info("--overwrite: starting the data set anew (%d entries of the old manifest dropped)", len(old))
        gone = [f for f, e in old.items() if e["id"] not in ids]
        for f in gone:
            (out_dir / f).unlink(missing_ok=True)
        if gone:
            logger.info("--overwrite: removed %d file(s) of samples not in this input", len(gone))
    manifest.header = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": checksum,
                       "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance)}

    # file names: by id (safetensors), or the next free data_<i>.pt (speculators; stable on resume)
    files: dict[str, str] = {}
    by_id = manifest.by_id()
    taken = set(manifest.entries)
    for s in samples:
        if s.id in by_id:
            files[s.id] = by_id[s.id]["file"]
    nxt = 0
    for k, s in enumerate(samples):
        if s.id in files:
            continue
        name = layout.file_name(s.id, k)
        if name in taken:
            while (name := layout.file_name(s.id, len(samples) + nxt)) in taken:
                nxt += 1
        files[s.id] = name
        taken.add(name)

    # resume: every file the run would skip is checked against its entry (sizes, shapes, checksums)
    # (entries of samples not in this input, e.g. an earlier --limit, stay while their file does)
    candidates = [s for s in samples if s.id in by_id and not overwrite]
    done_ids, todo, need, free = _resume(
        out_dir, manifest, samples, candidates, files,
        lambda s: check_file(out_dir / files[s.id], by_id[s.id], layout, digest),
        checked="against the manifest", check_threads=check_threads, layer_ids=layer_ids, hidden=hidden,
        dtype=dtype, keep_ids=ids)
    total = sum(_expected_bytes(s, len(layer_ids), hidden, DTYPES[dtype][0]) for s in samples)
    logger.info("%d of %d samples already done; %d to extract (layers %s, hidden %d, %s, %s layout)",
                len(done_ids), len(samples), len(todo), layer_ids, hidden, dtype, layout.name)
    logger.info("expected size: %s for all %d samples, %s still to write; free in %s: %s", human(total),
                len(samples), human(need), out_dir, human(free))
    if need > free:
        raise Rejected(f"not enough disk space in {out_dir}: {human(need)} needed, {human(free)} free "
                       "(free some space, or use --limit for a part of the input)")
    if need > 0.9 * free:
        logger.warning("the output will leave less than 10%% of %s free", out_dir)
    return OpenDataset(out_dir, layout, manifest, provenance, samples, todo, files, len(done_ids), layer_ids,
                       dtype, hidden, lock, speculators_version)


RESERVED = (MANIFEST_NAME, LOCK_NAME)

