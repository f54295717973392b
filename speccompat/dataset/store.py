"""Opening an output directory for a run: checks, lock, provenance, resume plan, disk space.

:func:`open_dataset` does everything that must happen before an engine starts and returns an
:class:`OpenDataset` whose ``todo`` are the samples still to extract; :meth:`OpenDataset.writer`
gives the background writer for them and :meth:`OpenDataset.finish` writes a layout's side files.
The directory itself (names, locks, manifests, the file check, the resume plan) is
:class:`~speccompat.dataset.directory.DatasetDir`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import default_algorithm, digest_fn
from .directory import HEADER_NAME, DatasetDir, plan_resume
from .errors import Rejected
from .formats import Layout
from .fsutil import human
from .inputs import Sample
from .layouts import layout_named
from .manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from .spec import SPECULATORS, StoredSpec
from .writer import DatasetWriter, WriteJob

__all__ = ["OpenDataset", "open_dataset"]

logger = logging.getLogger("speccompat.dataset")


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
    spec: StoredSpec  # what the sample files hold: dtype, fp8 scales, layers, width
    lock: Any = None  # a DirLock (a whole run) or (directory lock, part lock) (a shard)
    speculators_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dir(self) -> DatasetDir:
        return DatasetDir(self.out_dir)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.spec.layer_ids)

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def checksum(self) -> str:
        return self.manifest.header["checksum"]

    def close(self) -> None:
        """Release the directory's lock(s)."""
        for lock in self.lock if isinstance(self.lock, tuple) else (self.lock,):
            if lock is not None:
                lock.close()

    def __enter__(self) -> OpenDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        return DatasetWriter(self.out_dir, self.layout, self.manifest, spec=self.spec, checksum=self.checksum,
                             threads=threads, max_in_flight_bytes=max_in_flight_bytes, **kw)

    def keep_input_order(self) -> None:
        """Rewrite the manifest with its entries in input order (this run's samples first, in order;
        entries of samples not in this run after them, by line) when they are not: a redone sample
        is appended after the others, and a reader of the manifest takes its order for the input's.
        Atomic, and nothing is written when the order is already right."""
        position = {s.id: k for k, s in enumerate(self.samples)}
        entries = list(self.manifest.entries.values())
        ordered = sorted(entries, key=lambda e: (0, position[e["id"]], "") if e["id"] in position
                         else (1, e.get("line", 0), str(e["id"])))
        if ordered != entries:
            self.manifest.entries = {e["file"]: e for e in ordered}
            self.manifest.rewrite()

    def finish(self, token_freq_path: Path | None = None) -> None:
        """The layout's side files (speculators: data_config.json, sample_lengths.json for 0.4+, the
        token-frequency file), from every finished entry of the data set (not only this run's)."""
        from .finish import finish_dataset

        self.keep_input_order()
        finish_dataset(self.dir, self.manifest, samples=self.samples, token_freq_path=token_freq_path,
                       extra=self.extra, speculators_version=self.speculators_version, changed=bool(self.todo))


def expected_bytes(samples: list[Sample], spec: StoredSpec) -> int:
    """What ``samples`` take on disk at most, stored as ``spec`` says."""
    return sum(spec.expected_bytes(s.num_tokens) for s in samples)


def run_spec(provenance: dict[str, Any], spec: StoredSpec | None) -> StoredSpec:
    """The run's spec: ``spec`` as the command built it (its provenance was written from it: they
    must agree), or, for a caller that has only the provenance, the spec it records."""
    recorded = StoredSpec.of_provenance(provenance)
    if spec is not None and spec != recorded:
        raise ValueError(f"the run stores {spec}, its provenance records {recorded}")
    return spec or recorded


def run_facts(ddir: DatasetDir, provenance: dict[str, Any], spec: StoredSpec) -> Layout:
    """The layout of a run that stores ``spec``, once the directory is known to be usable."""
    layout = layout_named(provenance["layout"], list(spec.layer_ids), provenance["model"].get("num_hidden_layers"))
    from .fp8 import refuse

    if why := refuse(spec.dtype, layout.name):
        raise Rejected(why)
    ddir.ensure()
    ddir.check_own_dirs()
    return layout


def differences(stored_header: dict[str, Any] | None, provenance: dict[str, Any], samples: list[Sample],
                stored: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How this run differs from what the directory holds (provenance, each sample's input)."""
    diffs: list[str] = []
    if stored_header is not None:
        diffs += prov_mod.differences(stored_header.get("provenance") or {}, provenance)
    for s in samples:
        for e in stored.get(s.id, ()):
            if e.get("input_sha256") != s.digest:
                diffs.append(f"id {s.id!r} (line {s.line}): input_ids/loss_mask differ from the ones its file "
                             f"{e['file']} was made from")
                break
    return diffs


def refuse_differences(out_dir: Path, diffs: list[str], hint: str) -> None:
    if any(d.startswith("model.weights.method:") for d in diffs):
        hint = ("The model identity's method changed (this version reads every byte of the weights): a data set "
                "begun by an older speccompat is resumed with that version, or redone.\n" + hint)
    if diffs:
        shown = diffs[:20] + ([f"... and {len(diffs) - 20} more"] if len(diffs) > 20 else [])
        raise Rejected(f"{out_dir} holds a data set made differently; nothing was started or written. "
                       "Differences (stored -> this run):\n  " + "\n  ".join(shown) + f"\n{hint}")


def run_info(extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a header records about the command (data_config.json is made from it after a merge)."""
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), **(extra or {})}


def open_dataset(out_dir: Path, samples: list[Sample], provenance: dict[str, Any], *, spec: StoredSpec | None = None,
                 overwrite: bool = False, check_threads: int = 4, speculators_version: str | None = None,
                 extra: dict[str, Any] | None = None) -> OpenDataset:
    """Everything before the engine: raises :class:`Rejected` for any reason not to start (the
    directory's lock is released then). ``spec``: what the run stores (:func:`run_spec`);
    ``extra``: run facts kept in the header (data_config.json)."""
    ddir = DatasetDir(out_dir)
    out_dir = ddir.root
    spec = run_spec(provenance, spec)
    layout = run_facts(ddir, provenance, spec)
    with contextlib.ExitStack() as stack:
        lock = stack.enter_context(ddir.lock())
        ds = _open_locked(ddir, layout, samples, provenance, spec, overwrite=overwrite,
                          check_threads=check_threads, extra=extra)
        ds.lock, ds.speculators_version = lock, speculators_version
        ds.extra.update(extra or {})
        stack.pop_all()
    return ds


def _open_locked(ddir: DatasetDir, layout: Layout, samples: list[Sample], provenance: dict[str, Any],
                 spec: StoredSpec, *, overwrite: bool, check_threads: int, extra: dict[str, Any] | None) -> OpenDataset:
    out_dir = ddir.root
    if parts := ddir.parts():
        raise Rejected(f"{out_dir} holds {len(parts)} manifest part(s) of a sharded extraction ({parts[0]} ...): "
                       "run `speccompat merge DIR` first, or keep running it with --num-shards")
    if ddir.interrupted_overwrite() and not overwrite:
        raise Rejected(f"{out_dir} holds an --overwrite that was interrupted while it moved the old data set aside: "
                       "run the same command with --overwrite again to finish it, or use another --output-dir")
    ddir.remove_leftovers()
    manifest = ddir.manifest()
    if manifest.header_problem and not overwrite:
        raise Rejected(f"{out_dir}/{manifest.header_problem}: the data set cannot be resumed; use another "
                       "--output-dir, or --overwrite to start it anew")
    for problem in manifest.problems:
        if problem != manifest.header_problem:
            logger.warning("%s: dropped (its sample is redone)", problem)
    ids = {s.id for s in samples}
    stored = {e["id"]: [e] for e in manifest.entries.values()}
    derived = layout.derived_names(out_dir)
    sample_names = [n for n in ddir.names() if layout.is_sample_file(n) or n in ("index.jsonl", *derived)
                    or n == MANIFEST_NAME]
    if manifest.header is None and not manifest.header_problem:
        strays = [n for n in sample_names if n != MANIFEST_NAME]
        if strays and not overwrite:
            raise Rejected(f"{out_dir} holds {len(strays)} file(s) ({', '.join(strays[:3])}"
                           f"{' ...' if len(strays) > 3 else ''}) but no {MANIFEST_NAME}: nothing says what "
                           "produced them. Use another --output-dir, or --overwrite to replace them")
    diffs = differences(manifest.header, provenance, samples, stored)
    empty = not manifest.entries and not [n for n in sample_names if n != MANIFEST_NAME]
    if diffs and empty and not overwrite:
        # A run that stopped before its first sample (e.g. its engine did not start) left only its
        # header: nothing can be mixed or lost, so this run's settings replace it.
        logger.info("%s holds no sample yet, only the header of an earlier run that wrote none; this run's "
                    "settings replace it (%s)", out_dir, "; ".join(diffs[:3]))
        diffs, manifest.header = [], None
    if not overwrite:
        refuse_differences(out_dir, diffs, "Use another --output-dir, or --overwrite to redo every sample of this "
                                           "input")
    total = expected_bytes(samples, spec)

    keep_created = None if overwrite else (manifest.provenance or {}).get("created")
    if keep_created:
        provenance = {**provenance, "created": keep_created}  # the data set's first run
    checksum = (manifest.header or {}).get("checksum") if not overwrite else None
    checksum = checksum or default_algorithm()
    try:
        digest = digest_fn(checksum)
    except ValueError as exc:
        raise Rejected(str(exc)) from None

    if overwrite:
        outside = sorted({e["id"] for e in manifest.entries.values()} - ids)
        if outside:
            raise Rejected(f"--overwrite would delete {len(outside)} finished sample(s) that this run does not redo "
                           f"(ids {', '.join(repr(i) for i in outside[:3])}{' ...' if len(outside) > 3 else ''}: not "
                           "in this run's input, e.g. outside --limit). Run --overwrite on the whole input, or "
                           "delete the data set, or use another --output-dir")
        old_bytes = sum(e["bytes"] for e in manifest.entries.values())
        if total > ddir.free() + old_bytes:
            raise Rejected(f"not enough disk space in {out_dir}: {human(total)} needed, "
                           f"{human(ddir.free() + old_bytes)} free once the old data set is gone")
        old = [MANIFEST_NAME, *manifest.entries, *(n for n in sample_names if n != MANIFEST_NAME),
               *(n for n in (HEADER_NAME,) if n in ddir.names())]
        old = list(dict.fromkeys(old))
        if len(old) > 1 or ddir.interrupted_overwrite():
            logger.info("--overwrite: moving the old data set (%d file(s)) aside and deleting it", len(old))
        ddir.move_aside(old)
        manifest = ddir.new_manifest()
        stored = {}
    manifest.header = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": checksum,
                       "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance),
                       "run": run_info(extra)}
    plan = plan_resume(ddir, manifest, samples, samples, stored, layout, digest, check_threads=check_threads,
                       fresh=overwrite)
    need = expected_bytes(plan.todo, spec)
    free = ddir.free()
    logger.info("%d of %d samples already done; %d to extract (layers %s, hidden %d, %s, %s layout)",
                len(plan.done_ids), len(samples), len(plan.todo), list(spec.layer_ids), spec.hidden_size, spec.dtype,
                layout.name)
    logger.info("expected size: %s for all %d samples, %s still to write; free in %s: %s", human(total),
                len(samples), human(need), out_dir, human(free))
    if need > free:
        raise Rejected(f"not enough disk space in {out_dir}: {human(need)} needed, {human(free)} free "
                       "(free some space, or use --limit for a part of the input)")
    if need > 0.9 * free:
        logger.warning("the output will leave less than 10%% of %s free", out_dir)
    return OpenDataset(out_dir, layout, manifest, provenance, samples, plan.todo, plan.files, len(plan.done_ids),
                       spec)
