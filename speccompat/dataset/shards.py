"""One data set written by many processes at once: deterministic shards, manifest parts, merge.

A sample's shard is a stable function of its id alone (:func:`shard_of`: the first 8 bytes of the
SHA-256 of the id's exact UTF-8 bytes, mod N), so adding samples to the input never moves a
finished one to another shard, and every process computes the same split without talking to the
others. Shard K of N (:func:`open_shard`):

- holds a shared lock on the directory (``.speccompat-dataset.lock``: a single, unsharded run and
  ``speccompat merge`` take it exclusively, so neither runs beside shards) and an exclusive lock on
  its own part (``.speccompat-shard-KKKKK-of-NNNNN.lock``: the same shard cannot run twice);
- appends only to its own manifest part, ``manifest.shard-KKKKK-of-NNNNN.jsonl`` (same header and
  entries as ``manifest.jsonl``; no two processes ever append to one file);
- agrees with the other shards on the header (``created``, checksum algorithm) through
  ``manifest.header.json``, created once, atomically, by the first shard to start (or taken from
  an existing ``manifest.jsonl``);
- plans its resume from every part and ``manifest.jsonl`` together: a sample finished by any
  shard of any earlier split (2 shards, then 3) is skipped once its file checks out against its
  entry (size, dtypes, shapes, checksums: the single-run resume's check), so re-sharding loses no
  work; the input of every id already in the data set is compared, as a single run does.

:func:`merge_dataset` (``speccompat merge DIR``, with no shard running) joins the parts into one
``manifest.jsonl`` (entries in input order, as a single run writes them), removes the parts, and
checks the result with :func:`speccompat.dataset.verify.verify_dataset`; with the input given,
that every input sample is present exactly once (:func:`check_inputs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import default_algorithm, digest_fn
from .directory import (
    HEADER_LOCK_NAME,
    HEADER_NAME,
    PART_LOCK_RE,
    PART_RE,
    DatasetDir,
    part_lock_name,
    part_name,
    plan_resume,
)
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_REJECTED, DatasetError, Rejected
from .fsutil import LOCK_NAME, fsync_dir, human, write_atomic
from .inputs import Sample
from .layouts import layout_named, layout_of
from .manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from .spec import StoredSpec
from .store import OpenDataset, differences, expected_bytes, refuse_differences, run_facts, run_info, run_spec
from .verify import check_view, verify_dataset

__all__ = ["HEADER_NAME", "PART_RE", "ShardSpec", "check_inputs", "find_parts", "merge_dataset", "open_shard",
           "part_name", "resolve_shard", "shard_of"]

logger = logging.getLogger("speccompat.dataset")

#: the environment variables a job scheduler or launcher sets, read only with ``--num-shards auto``
ENV_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP", "RANK",
            "WORLD_SIZE")


def shard_of(sample_id: str, num_shards: int) -> int:
    """The shard (0 .. num_shards-1) of ``sample_id``: depends on the id's bytes and N only."""
    raw = str(sample_id).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") % num_shards


@dataclass(frozen=True)
class ShardSpec:
    num_shards: int
    index: int
    source: str  # where the values came from, for the log

    def __str__(self) -> str:
        return f"shard {self.index} of {self.num_shards} ({self.source})"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise Rejected(f"{name}={raw!r} is not an integer") from None


def resolve_shard(num_shards: int | str | None, shard_index: int | None,
                  env: Mapping[str, str] | None = None) -> ShardSpec:
    """This process's shard. ``--num-shards N --shard-index K``: shard K of N. ``--num-shards auto``:
    from a SLURM job array (``SLURM_ARRAY_TASK_ID`` - ``SLURM_ARRAY_TASK_MIN``, in steps of
    ``SLURM_ARRAY_TASK_STEP``, of ``SLURM_ARRAY_TASK_COUNT``), else from ``RANK``/``WORLD_SIZE``
    (:class:`Rejected` when neither is set). Neither flag: the whole input (shard 0 of 1); the
    environment is never read then, and a warning names the variables it ignored (a job inside an
    unrelated allocation or ``torchrun`` must not silently write a part of the input)."""
    env = os.environ if env is None else env
    if num_shards is None:
        if shard_index is not None:
            raise Rejected("--shard-index without --num-shards: pass --num-shards N (or --num-shards auto)")
        seen = [f"{k}={env[k]}" for k in ENV_VARS if (env.get(k) or "").strip()]
        if seen:
            logger.warning("%s set in the environment but ignored: this process extracts the whole input. Pass "
                           "--num-shards auto to take its shard from them", ", ".join(seen))
        return ShardSpec(1, 0, "default: one shard")
    if num_shards == "auto":
        if shard_index is not None:
            raise Rejected("--num-shards auto takes the shard index from the environment: drop --shard-index")
        n, i, src = _from_env(env)
    else:
        n, src = int(num_shards), "--num-shards"
        if shard_index is None:
            if n != 1:
                raise Rejected(f"--num-shards {n} without --shard-index: pass --shard-index (or --num-shards auto "
                               "to take both from a SLURM array or RANK/WORLD_SIZE)")
            i = 0
        else:
            i, src = shard_index, "--num-shards and --shard-index"
    if n < 1:
        raise Rejected(f"the number of shards must be at least 1, got {n} ({src})")
    if not 0 <= i < n:
        raise Rejected(f"shard index {i} is outside 0..{n - 1} for {n} shards ({src})")
    return ShardSpec(n, i, src)


def _from_env(env: Mapping[str, str]) -> tuple[int, int, str]:
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        lo = _env_int(env, "SLURM_ARRAY_TASK_MIN") or 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
        if count is None:
            raise Rejected("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not: pass --num-shards N "
                           "--shard-index K")
        if (task - lo) % step or not 0 <= (task - lo) // step < count:
            raise Rejected(f"cannot derive a shard index from SLURM_ARRAY_TASK_ID={task} (min {lo}, step {step}, "
                           f"count {count}): an array of evenly spaced ids is needed, or pass --num-shards and "
                           "--shard-index")
        return count, (task - lo) // step, ("SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
                                            + (" (from SLURM_ARRAY_TASK_MIN)" if lo else ""))
    n, i = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
    if n is None and i is None:
        raise Rejected("--num-shards auto: neither a SLURM job array (SLURM_ARRAY_TASK_ID) nor RANK/WORLD_SIZE is "
                       "set in the environment")
    if n is None or i is None:
        raise Rejected("only one of RANK and WORLD_SIZE is set: set both, or pass --num-shards/--shard-index")
    return n, i, "RANK/WORLD_SIZE"


def find_parts(out_dir: DatasetDir | Path) -> list[Path]:
    """The manifest parts in ``out_dir``, in name order."""
    ddir = DatasetDir.of(out_dir)
    return [ddir.path(n) for n in ddir.parts()]


def _warn(m: Manifest) -> Manifest:
    for problem in m.problems:
        logger.warning("%s: dropped (its sample is redone)", problem)
    return m


def _stored(ddir: DatasetDir, own: Manifest) -> tuple[list[Manifest], dict[str, list[dict[str, Any]]]]:
    """The other manifests (``manifest.jsonl`` first, then the parts) and id -> entries of all,
    this shard's own first."""
    manifests = []
    base = _warn(ddir.manifest())
    if base.header is not None or base.entries or base.header_problem:
        manifests.append(base)
    manifests += [_warn(ddir.manifest(n)) for n in ddir.parts() if n != own.path.name]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for m in [own, *manifests]:
        for e in m.entries.values():
            by_id.setdefault(e["id"], []).append(e)
    return manifests, by_id


def _header_differences(stored_header: dict[str, Any], provenance: dict[str, Any]) -> list[str]:
    diffs = []
    if stored_header.get("speccompat_dataset") != SCHEMA_VERSION:
        diffs.append(f"manifest schema {stored_header.get('speccompat_dataset')} -> {SCHEMA_VERSION}")
    return diffs + differences(stored_header, provenance, [], {})


def _no_sample_yet(ddir: DatasetDir, layout: Any, stored_header: dict[str, Any], manifests: list[Manifest]) -> bool:
    """No manifest of the directory has an entry and no file of this run's layout or the stored
    header's is there: the directory holds only headers of runs that wrote no sample."""
    if any(m.entries for m in manifests):
        return False
    layouts = [layout]
    with contextlib.suppress(ValueError, Rejected):
        layouts.append(layout_named(str(stored_header.get("layout"))))
    return not any(lay.is_sample_file(n) for n in ddir.names() for lay in layouts)


def open_shard(out_dir: Path, samples: list[Sample], provenance: dict[str, Any], shard: ShardSpec, *,
               spec: StoredSpec | None = None, overwrite: bool = False, check_threads: int = 4,
               speculators_version: str | None = None, extra: dict[str, Any] | None = None) -> Any:
    """:func:`speccompat.dataset.store.open_dataset` for shard ``shard.index`` of ``shard.num_shards``:
    ``samples`` is the whole input (the same in every shard); the result's ``todo`` holds this
    shard's samples that no shard has finished, and its manifest is this shard's part. The locks
    are released when it is refused."""
    if overwrite:
        raise Rejected("--overwrite cannot be combined with shards: a shard can start anew only its own part. "
                       "Delete the data set or use another --output-dir")
    ddir = DatasetDir(out_dir)
    out_dir = ddir.root
    spec = run_spec(provenance, spec)
    layout = run_facts(ddir, provenance, spec)
    K, N = shard.index, shard.num_shards
    with contextlib.ExitStack() as stack:
        dir_lock = stack.enter_context(ddir.lock(LOCK_NAME, exclusive=False, busy=(
            f"{out_dir} is held by an unsharded extraction or a `speccompat merge` (only shards can run beside "
            "shards)")))
        if ddir.interrupted_overwrite():
            raise Rejected(f"{out_dir} holds an interrupted --overwrite: finish it with an unsharded run and "
                           "--overwrite, or use another --output-dir")
        mine = [s for s in samples if shard_of(s.id, N) == K]
        own = _warn(ddir.manifest(part_name(K, N)))
        manifests, by_id = _stored(ddir, own)
        for m in [own, *manifests]:
            if m.header_problem:
                raise Rejected(f"{out_dir}/{m.header_problem}: the data set cannot be resumed; use another "
                               "--output-dir")

        # the shared header: manifest.jsonl's when there is one, else manifest.header.json
        base = next((m for m in manifests if m.path.name == MANIFEST_NAME and m.header is not None), None)
        fresh = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": default_algorithm(),
                 "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance)}

        def shared() -> dict[str, Any]:  # read again only while the set holds no sample (a small file)
            if base is None:
                return ddir.shared_header(fresh)
            return ddir.manifest().header or fresh

        def differ(header: dict[str, Any]) -> list[str]:
            # a part without entries says nothing about the samples: only parts that hold some must agree
            return _header_differences(header, provenance) + differences(None, provenance, samples, by_id) + [
                f"{m.path.name}: made with another provenance: "
                + "; ".join(prov_mod.differences(m.header.get("provenance") or {}, provenance)[:3])
                for m in [own, *manifests] if m.header is not None and m.entries
                and m.header.get("provenance_sha256") != header.get("provenance_sha256")]

        busy = f"shard {K} of {N} is already running on {out_dir}"
        stored_header = base.header if base is not None else shared()
        diffs = differ(stored_header)
        running: list[str] = []
        empty = _no_sample_yet(ddir, layout, stored_header, [own, *manifests])
        if diffs and empty:
            # Every earlier shard stopped before its first sample (e.g. its engine did not start) and
            # left only the header: nothing can be mixed or lost, so this command's settings replace
            # it, unless a shard runs with them. One shard at a time decides, and takes its part's
            # lock before the next one looks: a part lock held is a shard that runs with the header.
            with ddir.lock(HEADER_LOCK_NAME, wait=True):
                stored_header = shared()  # as another shard may have left it meanwhile
                diffs = differ(stored_header)
                running = [n for n in ddir.names() if PART_LOCK_RE.match(n) and ddir.held(n)]
                if diffs and not running:
                    logger.info("%s holds no sample yet, only the header of an earlier run that wrote none; this "
                                "run's settings replace it (%s)", out_dir, "; ".join(diffs[:3]))
                    if base is not None:
                        base.header = fresh
                        base.rewrite()
                    else:
                        write_atomic(ddir.path(HEADER_NAME), (json.dumps(fresh, ensure_ascii=False) + "\n").encode())
                    stored_header, diffs = fresh, []
                part_lock = stack.enter_context(ddir.lock(part_lock_name(K, N), busy=busy))
        else:
            part_lock = stack.enter_context(ddir.lock(part_lock_name(K, N), busy=busy))
            if not diffs and empty and shared().get("provenance_sha256") != stored_header.get("provenance_sha256"):
                raise Rejected(f"the header of {out_dir} was replaced by another shard while this one started "
                               "(the earlier run had written no sample): run this shard again")
        refuse_differences(out_dir, diffs, "Use another --output-dir" + (
            f" ({len(running)} shard(s) are running with the stored settings: {', '.join(running[:3])})"
            if running else ""))
        checksum = stored_header.get("checksum")
        try:
            digest = digest_fn(checksum)
        except ValueError as exc:
            raise Rejected(str(exc)) from None
        created = (stored_header.get("provenance") or {}).get("created")
        if created:
            provenance = {**provenance, "created": created}
        own.header = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": checksum,
                      "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance),
                      "run": run_info(extra)}

        # leftovers of this shard's own interrupted writes (other shards may be writing theirs now)
        def progress_facts(plan: Any) -> None:
            # what the job's progress is read from (speccompat.dataset.parallel.DataSetProgress): the shard's samples,
            # those done now, and the entries the part holds now (each one appended after is one more)
            own.header["shard"] = {"index": K, "num_shards": N, "samples": len(mine), "done": len(plan.done_ids),
                                   "entries": len(own.entries)}

        plan = plan_resume(ddir, own, samples, mine, by_id, layout, digest, index=K, num_shards=N,
                           check_threads=check_threads, what="of this shard against the manifests",
                           annotate=progress_facts)
        ddir.remove_leftovers(set(plan.files.values()))
        need = expected_bytes(plan.todo, spec)
        free = ddir.free()
        logger.info("shard %d of %d: %d of the input's %d samples; %d already done (by any shard); %d to extract "
                    "(layers %s, hidden %d, %s, %s layout); %s still to write, free in %s: %s", K, N, len(mine),
                    len(samples), len(plan.done_ids), len(plan.todo), list(spec.layer_ids), spec.hidden_size, spec.dtype,
                    layout.name, human(need), out_dir, human(free))
        if need > free:
            raise Rejected(f"not enough disk space in {out_dir}: {human(need)} needed by this shard, "
                           f"{human(free)} free")
        ds = OpenDataset(out_dir, layout, own, provenance, mine, plan.todo, plan.files, len(plan.done_ids),
                         spec, (dir_lock, part_lock), speculators_version)
        ds.extra.update(extra or {})
        ds.extra["shard"] = shard
        stack.pop_all()
    return ds


@dataclass
class MergeResult:
    problems: list[str]
    entries: int
    parts: list[str]


#: ``--shard-index K`` (or ``=K``) in a recorded command: what tells one shard's command from the job's.
_SHARD_INDEX = re.compile(r"\s--shard-index(?:=|\s+)\S+")


def job_command(command: str) -> str:
    """A shard's recorded command without its ``--shard-index``: the job's command."""
    return _SHARD_INDEX.sub("", command)


def merged_run(sources: list[Manifest], parts: int, command: str | None = None) -> dict[str, Any]:
    """The ``run`` record of a merged header: the run facts of the first source with entries, the
    distinct commands of the sources (each without ``--shard-index``; those of an earlier merge
    included), ``command``: the given job's command, else the one command they share (else all,
    ``; ``-separated), and ``merged_from``: how many shards (manifest parts) were merged."""
    runs = [(m.header or {}).get("run") for m in sources if m.header is not None and m.entries]
    runs = [r for r in runs if isinstance(r, dict)]
    commands: list[str] = []
    shards = parts
    for r in runs:
        before = r.get("merged_from")
        if isinstance(before, dict):
            shards += int(before.get("shards") or 0)
            found = [c for c in before.get("commands") or [] if isinstance(c, str)]
        else:
            found = [job_command(r["command"])] if isinstance(r.get("command"), str) else []
        commands += [c for c in found if c not in commands]
    run = {k: v for k, v in (runs[0] if runs else {}).items() if k not in ("command", "merged_from")}
    run["command"] = command or "; ".join(commands)
    run["merged_from"] = {"shards": shards, "commands": commands}
    return run


def merge_dataset(out_dir: DatasetDir | Path, threads: int = 4, *, command: str | None = None) -> MergeResult:
    """Join the manifest parts of ``out_dir`` (and its ``manifest.jsonl``) into one ``manifest.jsonl``;
    raises :class:`Rejected` while a shard is running. Returns the join's problems (nothing is
    written when the parts disagree on provenance); verify the result with ``verify_dataset``.
    The merged header's ``run`` says what made the set (:func:`merged_run`; ``command``: the job's
    command, when the caller is the job)."""
    ddir = DatasetDir.of(out_dir)
    out_dir = ddir.root
    if not out_dir.is_dir():
        raise Rejected(f"{out_dir} is not a directory")
    try:
        lock = ddir.lock()
    except Rejected as exc:
        raise Rejected(f"{exc}: merge when every shard has ended") from None
    with lock:
        ddir.check_own_dirs()  # before anything is joined, deleted or moved
        parts = [ddir.manifest(n) for n in ddir.parts()]
        base = ddir.manifest()
        shared = ddir.read_json(HEADER_NAME)
        sources = ([base] if base.header is not None or base.entries or base.header_problem else []) + parts
        names = [m.path.name for m in parts]
        if not parts:
            return MergeResult([] if base.header is not None else
                               [base.header_problem or f"{out_dir}: neither {MANIFEST_NAME} nor manifest parts: "
                                "not a data set"], len(base.entries), [])
        # the data set's header: manifest.jsonl's, else that of a part holding entries, else the shared one
        ref = base.header or next((m.header for m in parts if m.header is not None and m.entries), None) or shared \
            or next((m.header for m in parts if m.header is not None), None)
        problems: list[str] = []
        for m in sources:
            problems += [f"{p} (dropped)" for p in m.problems]
        if not isinstance(ref, dict):
            return MergeResult([*problems, "no manifest part has a header"], 0, names)
        for m in sources:
            h = m.header
            if h is None or not m.entries:  # a part without entries: a shard that wrote no sample
                if m.entries:
                    problems.append(f"{m.path.name}: entries but no header")
                continue
            for key in ("speccompat_dataset", "layout", "checksum"):
                if h.get(key) != ref.get(key):
                    problems.append(f"{m.path.name}: {key} {h.get(key)!r}, the data set's is {ref.get(key)!r}")
            if h.get("provenance_sha256") != ref.get("provenance_sha256"):
                diffs = prov_mod.differences(ref.get("provenance") or {}, h.get("provenance") or {})
                problems.append(f"{m.path.name}: provenance differs from the data set's: " + "; ".join(diffs[:5]))
        if problems:
            return MergeResult(problems, 0, names)

        layout = layout_of(ref)
        check = ddir.check_fn(layout, digest_fn(ref["checksum"]))
        by_file: dict[str, list[dict[str, Any]]] = {}
        for m in sources:
            for f, e in m.entries.items():
                if e not in by_file.setdefault(f, []):
                    by_file[f].append(e)
        conflicts = {f: es for f, es in by_file.items() if len(es) > 1}

        def resolve(item: tuple[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
            return next((e for e in item[1] if check(e) is None), None)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            chosen = dict(zip(conflicts, pool.map(resolve, conflicts.items()), strict=True))
        merged: list[dict[str, Any]] = []
        for f, es in by_file.items():
            if f not in conflicts:
                merged.append(es[0])
            elif chosen[f] is not None:
                merged.append(chosen[f])
            else:
                problems.append(f"{f}: {len(es)} different entries in the parts and the file matches none; "
                                "it is left out (a re-run redoes it)")
        merged.sort(key=lambda e: (e["line"], str(e["id"])))
        out = ddir.new_manifest()
        out.header = {**{k: v for k, v in ref.items() if k != "shard"}, "run": merged_run(sources, len(names), command)}
        out.entries = {e["file"]: e for e in merged}
        out.rewrite()
        fsync_dir(out_dir)
        for n in [*names, HEADER_NAME]:
            ddir.unlink(n)
        for n in ddir.names():
            if PART_LOCK_RE.match(n) or n == HEADER_LOCK_NAME:
                ddir.unlink(n)
        fsync_dir(out_dir)
        logger.info("merged %d manifest part(s) into %s: %d entries", len(names), out.path, len(merged))
        return MergeResult(problems, len(merged), names)


def _on_long(prov: dict[str, Any]) -> str:
    t = prov.get("truncation", "truncate")
    return t.get("on_long_line", "truncate") if isinstance(t, dict) else str(t)


def _scan_as_run(prov: dict[str, Any], inputs: Path, limit: int | None) -> Any:
    from .inputs import scan_jsonl

    on_long = _on_long(prov)
    return scan_jsonl(Path(inputs), vocab_size=int(prov["model"]["vocab_size"]), max_seq_len=int(prov["max_seq_len"]),
                      on_bad="skip", on_long="skip" if on_long == "fail" else on_long, limit=limit)


def check_inputs(out_dir: DatasetDir | Path, inputs: Path, limit: int | None = None) -> tuple[list[str], int]:
    """Every sample of ``inputs`` (read as the run read it: the provenance's vocabulary, length and
    truncation) is in the data set exactly once, made from the same ids and mask, and the data set
    holds nothing else. (problems, number of input samples)."""
    problems, samples = _against_inputs(DatasetDir.of(out_dir).manifest(), inputs, limit)
    return problems, len(samples)


def _against_inputs(m: Manifest, inputs: Path, limit: int | None) -> tuple[list[str], list[Sample]]:
    """:func:`check_inputs` on a manifest already read: (problems, the input's samples, scanned once; what a
    merge then counts into the layout's side files)."""
    if m.header is None:
        return [m.header_problem or f"{m.path}: no manifest header"], []
    samples = _scan_as_run(m.provenance or {}, inputs, limit).samples
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in m.entries.values():
        by_id.setdefault(str(e["id"]), []).append(e)
    problems = []
    for s in samples:
        es = by_id.pop(s.id, [])
        if not es:
            problems.append(f"id {s.id!r} (line {s.line} of {inputs}): missing from the data set")
        elif len(es) > 1:
            problems.append(f"id {s.id!r} (line {s.line}): present {len(es)} times ({', '.join(e['file'] for e in es)})")
        elif es[0].get("input_sha256") != s.digest:
            problems.append(f"id {s.id!r} (line {s.line}): its file {es[0]['file']} was made from other input_ids/"
                            "loss_mask than the input's")
    problems += [f"id {i!r} ({es[0]['file']}): in the data set but not in {inputs}" for i, es in by_id.items()]
    return problems, samples


def add_parser(sub: Any) -> Any:
    m = sub.add_parser("merge", help="join the manifest parts of a sharded extraction into manifest.jsonl, write the "
                       "layout's side files and verify the data set (exit 0 intact, 1 problems found, 2 refused: not "
                       "a data set or a shard running, 130 interrupted)")
    m.add_argument("dir", type=Path, help="the data set's directory")
    m.add_argument("--inputs", type=Path, default=None,
                   help="the extraction's input (JSONL): check that every sample is present exactly once")
    m.add_argument("--limit", type=int, default=None, help="the extraction's --limit, if it had one")
    m.add_argument("--threads", type=int, default=4, help="files checked in parallel")
    m.add_argument("--token-freq-path", type=Path, default=None,
                   help="--layout speculators: token-frequency file (default: <dir>.token_freq.pt)")
    m.add_argument("--no-verify", action="store_true", help="join only; do not read the files back")
    return m


def main(args: Any) -> int:
    import sys

    out_dir: Path = args.dir
    ddir = DatasetDir(out_dir)
    why = ddir.token_freq_problem(args.token_freq_path)
    if why is not None:
        print(f"merge {out_dir}: {why}", file=sys.stderr)
        return EXIT_REJECTED
    try:
        res = merge_dataset(ddir, args.threads)
        problems = list(res.problems)
        m = ddir.manifest() if ddir.path(MANIFEST_NAME).is_file() else None
        if m is None or m.header is None:  # not a data set (or not one yet): nothing to verify or finish
            for line in problems or [f"{MANIFEST_NAME}: no header that can be read: not a data set"]:
                print(f"{out_dir}/{line}" if not line.startswith(str(out_dir)) else line)
            return EXIT_REJECTED
        print(f"merge {out_dir}: {len(res.parts)} part(s) joined, {res.entries} entries", file=sys.stderr)
        n = res.entries
        if not args.no_verify:  # the files; a layout's derived files once they are built
            found, n = verify_dataset(ddir, args.threads, view=False)
            problems += found
        samples = None
        if args.inputs is not None:  # the input is scanned once: checked, then what the side files count
            found, samples = _against_inputs(m, args.inputs, args.limit)
            problems += found
            print(f"merge {out_dir}: {len(samples)} input samples checked against the data set", file=sys.stderr)
        if not problems:
            try:
                _finish(ddir, samples, args.token_freq_path,
                        {"train_data_path": str(args.inputs)} if args.inputs is not None else {})
            except Rejected as exc:  # a file the layout's side files are built from is not as recorded
                problems.append(str(exc))
        if not problems and not args.no_verify:
            problems += check_view(ddir, ddir.manifest())  # read again: finishing rewrites the header
    except Rejected as exc:
        print(f"merge {out_dir}: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except DatasetError as exc:
        print(f"merge {out_dir}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"merge {out_dir}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"merge {out_dir}: interrupted (the manifest parts or the merged manifest are intact: run it again)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    for line in problems:
        print(f"{out_dir}/{line}" if not line.startswith(str(out_dir)) else line)
    print(f"merge {out_dir}: {n} entries, {len(problems)} problem(s)", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def _finish(ddir: DatasetDir, samples: list[Any] | None, token_freq_path: Path | None,
            extra: dict[str, Any] | None) -> None:
    """The data set's one finish path (:func:`speccompat.dataset.finish.finish_dataset`), after a merge."""
    from .finish import finish_dataset

    finish_dataset(ddir, samples=samples, token_freq_path=token_freq_path, extra=extra)


def check_present(ddir: DatasetDir, m: Manifest) -> list[str]:
    """Cheap: every entry of ``m`` has its file in ``ddir`` with the recorded size (no file is read)."""
    problems = []
    for f, e in m.entries.items():
        try:
            size = os.lstat(ddir.path(f)).st_size
        except FileNotFoundError:
            problems.append(f"{f}: missing (id {e['id']!r})")
            continue
        if size != e["bytes"]:
            problems.append(f"{f}: {size} bytes, the manifest says {e['bytes']}")
    return problems


def finish_job(out_dir: DatasetDir | Path, inputs: Path, *, limit: int | None = None, token_freq_path: Path | None = None,
               extra: dict[str, Any] | None = None, command: str | None = None) -> int:
    """After every shard of a job succeeded: merge the parts, check that every input sample is
    present once (and every file with its size; each shard checked what it skipped and wrote the
    rest with checksums, so no file is read again: ``speccompat verify`` does that), and write the
    layout's side files (the one finish path). 0 when all is well, 1 otherwise."""
    ddir = DatasetDir.of(out_dir)
    res = merge_dataset(ddir, command=command)
    problems = list(res.problems)
    samples: list[Any] = []
    if ddir.path(MANIFEST_NAME).is_file():  # the merged manifest is read once and the input scanned once
        m = ddir.manifest()
        found, samples = _against_inputs(m, inputs, limit)
        problems += (check_present(ddir, m) if m.header is not None else []) + found
    for line in problems[:50]:
        logger.error("%s: %s", out_dir, line)
    if problems:
        logger.error("the merged data set %s has %d problem(s)%s", out_dir, len(problems),
                     " (first 50 shown)" if len(problems) > 50 else "")
        return EXIT_FAILED
    _finish(ddir, samples, token_freq_path, extra)
    logger.info("data set %s complete: %d manifest part(s) merged, all %d input samples present once", out_dir,
                len(res.parts), len(samples))
    return EXIT_OK
