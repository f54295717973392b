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
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import default_algorithm, digest_fn
from .errors import Rejected
from .formats import layout_named
from .fsutil import (
    LOCK_NAME,
    TMP_SUFFIX,
    fsync_dir,
    human,
    lock_output_dir,
    write_durable,
)
from .inputs import Sample
from .manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest

__all__ = ["HEADER_NAME", "ShardSpec", "check_inputs", "find_parts", "merge_dataset", "open_shard", "part_name",
           "resolve_shard", "shard_of"]

logger = logging.getLogger("speccompat.dataset")

#: The header every shard of a data set shares (created once by the first shard).
HEADER_NAME = "manifest.header.json"
PART_RE = re.compile(r"^manifest\.shard-(\d+)-of-(\d+)\.jsonl$")
PART_LOCK_RE = re.compile(r"^\.speccompat-shard-(\d+)-of-(\d+)\.lock$")


def shard_of(sample_id: str, num_shards: int) -> int:
    """The shard (0 .. num_shards-1) of ``sample_id``: depends on the id's bytes and N only."""
    raw = str(sample_id).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") % num_shards


def part_name(index: int, num_shards: int) -> str:
    return f"manifest.shard-{index:05d}-of-{num_shards:05d}.jsonl"


def part_lock_name(index: int, num_shards: int) -> str:
    return f".speccompat-shard-{index:05d}-of-{num_shards:05d}.lock"


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


def resolve_shard(num_shards: int | None, shard_index: int | None,
                  env: Mapping[str, str] | None = None) -> ShardSpec:
    """This process's shard: ``--num-shards``/``--shard-index`` when given, else from a SLURM job
    array (``SLURM_ARRAY_TASK_ID`` - ``SLURM_ARRAY_TASK_MIN``, in steps of ``SLURM_ARRAY_TASK_STEP``,
    of ``SLURM_ARRAY_TASK_COUNT``), else from ``RANK``/``WORLD_SIZE``, else shard 0 of 1."""
    env = os.environ if env is None else env
    n_src = i_src = None
    n_env = i_env = None
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        lo = _env_int(env, "SLURM_ARRAY_TASK_MIN") or 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
        if count is None:
            raise Rejected("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not: pass --num-shards")
        if (task - lo) % step or not 0 <= (task - lo) // step < count:
            raise Rejected(f"cannot derive a shard index from SLURM_ARRAY_TASK_ID={task} (min {lo}, step {step}, "
                           f"count {count}): an array of evenly spaced ids is needed, or pass --num-shards and "
                           "--shard-index")
        n_env, i_env = count, (task - lo) // step
        src = "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT" + (" (from SLURM_ARRAY_TASK_MIN)" if lo else "")
    elif _env_int(env, "WORLD_SIZE") is not None or _env_int(env, "RANK") is not None:
        n_env, i_env = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
        if n_env is None or i_env is None:
            raise Rejected("only one of RANK and WORLD_SIZE is set: set both, or pass --num-shards/--shard-index")
        src = "RANK/WORLD_SIZE"
    else:
        src = None
    if num_shards is not None:
        n, n_src = num_shards, "--num-shards"
    elif n_env is not None:
        n, n_src = n_env, src
    else:
        n = 1
    if shard_index is not None:
        i, i_src = shard_index, "--shard-index"
    elif i_env is not None and (num_shards is None or num_shards == n_env):
        i, i_src = i_env, src
    elif n == 1:
        i = 0
    else:
        raise Rejected(f"--num-shards {n} without --shard-index (and no SLURM array or RANK/WORLD_SIZE of "
                       f"{n} in the environment): pass --shard-index")
    if n < 1:
        raise Rejected(f"the number of shards must be at least 1, got {n} ({n_src})")
    if not 0 <= i < n:
        raise Rejected(f"shard index {i} ({i_src}) is outside 0..{n - 1} for {n} shards ({n_src})")
    if n_src is None and i_src is None:
        source = "default: one shard"
    elif n_src == i_src:
        source = n_src
    else:
        source = f"{n_src or 'default'} and {i_src or 'default'}"
    return ShardSpec(n, i, source)


def find_parts(out_dir: Path) -> list[Path]:
    """The manifest parts in ``out_dir``, in name order."""
    try:
        return sorted(p for p in Path(out_dir).iterdir() if PART_RE.match(p.name))
    except FileNotFoundError:
        return []


def _part(out_dir: Path, name: str) -> Manifest:
    m = Manifest(out_dir)
    m.path = Path(out_dir) / name
    return m.load()


def _lock(path: Path, exclusive: bool, what: str) -> Any:
    try:
        handle = open(path, "a+")  # noqa: SIM115 - held for the life of the process
    except OSError as exc:
        raise Rejected(f"cannot create the lock file {path}: {exc.strerror}") from None
    try:
        fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise Rejected(what) from None
    return handle


def _shared_header(out_dir: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The header all shards use: ``manifest.header.json`` if present, else ``header``, written
    there atomically unless another shard was first (then theirs)."""
    path = out_dir / HEADER_NAME
    data = (json.dumps(header, ensure_ascii=False) + "\n").encode("utf-8")
    tmp = out_dir / f"{HEADER_NAME}.{os.getpid()}{TMP_SUFFIX}"
    if not path.exists():
        write_durable(tmp, data)
        try:
            os.link(tmp, path)  # atomic and exclusive: fails with EEXIST when another shard was first
            fsync_dir(out_dir)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            with contextlib.suppress(FileExistsError):  # no hard links here: exclusive create
                write_durable(path, data, os.O_EXCL)
        finally:
            tmp.unlink(missing_ok=True)
    for _ in range(50):
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(stored, dict) and "provenance" in stored:
                return stored
        except ValueError:
            pass
        time.sleep(0.1)  # written by another shard just now (without hard links)
    raise Rejected(f"{path} is not a data-set header; remove it if no shard is running")


def _stored_entries(out_dir: Path, own: str | None) -> tuple[list[Manifest], dict[str, list[dict[str, Any]]]]:
    """Every manifest (``manifest.jsonl`` first, then the parts; ``own`` excluded) and id -> entries."""
    manifests = []
    base = Manifest(out_dir).load()
    if base.header is not None or base.entries:
        manifests.append(base)
    manifests += [_part(out_dir, p.name) for p in find_parts(out_dir) if p.name != own]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for m in manifests:
        for problem in m.problems:
            logger.warning("%s: dropped", problem)
        for e in m.entries.values():
            by_id.setdefault(e["id"], []).append(e)
    return manifests, by_id


def open_shard(out_dir: Path, samples: list[Sample], provenance: dict[str, Any], shard: ShardSpec, *,
               overwrite: bool = False, check_threads: int = 4, speculators_version: str | None = None) -> Any:
    """:func:`speccompat.dataset.store.open_dataset` for shard ``shard.index`` of ``shard.num_shards``:
    ``samples`` is the whole input (the same in every shard); the result's ``todo`` holds this
    shard's samples that no shard has finished, and its manifest is this shard's part."""
    from .store import OpenDataset, _resume, _run_facts, check_file

    if overwrite:
        raise Rejected("--overwrite cannot be combined with shards: a shard can start anew only its own part. "
                       "Delete the data set or use another --output-dir")
    out_dir = Path(out_dir)
    layer_ids, dtype, hidden, layout = _run_facts(out_dir, provenance)
    K, N = shard.index, shard.num_shards
    own_name = part_name(K, N)
    dir_lock = _lock(out_dir / LOCK_NAME, False, f"{out_dir} is held by an unsharded extraction or a "
                     "`speccompat merge` (only shards can run beside shards)")
    part_lock = _lock(out_dir / part_lock_name(K, N), True,
                      f"shard {K} of {N} is already running on {out_dir}")

    mine = [s for s in samples if shard_of(s.id, N) == K]
    own = _part(out_dir, own_name)
    for problem in own.problems:
        logger.warning("%s: dropped", problem)
    manifests, others = _stored_entries(out_dir, own_name)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in own.entries.values():  # this shard's own entries are tried first
        by_id.setdefault(e["id"], []).append(e)
    for i, es in others.items():
        by_id.setdefault(i, []).extend(es)

    # the shared header: manifest.jsonl's when there is one, else manifest.header.json
    base = next((m for m in manifests if m.path.name == MANIFEST_NAME and m.header is not None), None)
    stored_header = base.header if base is not None else None
    if stored_header is None:
        fresh = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": default_algorithm(),
                 "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance)}
        stored_header = _shared_header(out_dir, fresh)
    diffs: list[str] = []
    if stored_header.get("speccompat_dataset") != SCHEMA_VERSION:
        diffs.append(f"manifest schema {stored_header.get('speccompat_dataset')} -> {SCHEMA_VERSION}")
    diffs += prov_mod.differences(stored_header.get("provenance") or {}, provenance)
    for m in [own, *manifests]:
        if m.header is not None and m.header.get("provenance_sha256") != stored_header.get("provenance_sha256"):
            diffs.append(f"{m.path.name}: made with another provenance: " + "; ".join(
                prov_mod.differences(m.header.get("provenance") or {}, provenance)[:3]))
    for s in samples:
        for e in by_id.get(s.id, ()):
            if e.get("input_sha256") != s.digest:
                diffs.append(f"id {s.id!r} (line {s.line}): input_ids/loss_mask differ from the ones its file "
                             f"{e['file']} was made from")
                break
    if diffs:
        shown = diffs[:20] + ([f"... and {len(diffs) - 20} more"] if len(diffs) > 20 else [])
        raise Rejected(f"{out_dir} holds a data set made differently; nothing was started or written. "
                       "Differences (stored -> this run):\n  " + "\n  ".join(shown) +
                       "\nUse another --output-dir")
    checksum = stored_header["checksum"]
    try:
        digest = digest_fn(checksum)
    except ValueError as exc:
        raise Rejected(str(exc)) from None
    created = (stored_header.get("provenance") or {}).get("created")
    if created:
        provenance = {**provenance, "created": created}
    own.header = {"speccompat_dataset": SCHEMA_VERSION, "layout": layout.name, "checksum": checksum,
                  "provenance": provenance, "provenance_sha256": prov_mod.digest(provenance)}

    # file names: as the data set has them, else by id (safetensors) or data_<global index> (speculators)
    files: dict[str, str] = {}
    taken = {e["file"] for es in by_id.values() for e in es}
    index = {s.id: k for k, s in enumerate(samples)}
    extra = 0
    for s in mine:
        if s.id in by_id:
            files[s.id] = by_id[s.id][0]["file"]
            continue
        name = layout.file_name(s.id, index[s.id])
        while name in taken:  # another id has it: a name no other shard of this split can pick
            name = layout.file_name(s.id, len(samples) + K + N * extra)
            extra += 1
        files[s.id] = name
        taken.add(name)

    # leftovers of this shard's own interrupted writes (other shards may be writing theirs now)
    own_files = set(files.values())
    tmp_re = re.compile(r"^(.*)\.\d+" + re.escape(TMP_SUFFIX) + "$")
    leftovers = [p for p in out_dir.iterdir() if (m := tmp_re.match(p.name)) and m.group(1) in own_files]
    for p in leftovers:
        p.unlink(missing_ok=True)
    if leftovers:
        logger.info("removed %d temporary file(s) left by an interrupted run of this shard", len(leftovers))

    # resume: every file this shard would skip is checked against an entry of any part
    candidates = [s for s in mine if s.id in by_id]

    def check(s: Sample) -> str | None:
        why = None
        for e in by_id[s.id]:
            if e["file"] != files[s.id]:
                continue
            why = check_file(out_dir / e["file"], e, layout, digest)
            if why is None:
                return None
        return why or "missing"

    done_ids, todo, need, free = _resume(out_dir, own, mine, candidates, files, check,
                                         checked="of this shard against the manifests", check_threads=check_threads,
                                         layer_ids=layer_ids, hidden=hidden, dtype=dtype)
    logger.info("shard %d of %d: %d of the input's %d samples; %d already done (by any shard); %d to extract "
                "(layers %s, hidden %d, %s, %s layout); %s still to write, free in %s: %s", K, N, len(mine),
                len(samples), len(done_ids), len(todo), layer_ids, hidden, dtype, layout.name, human(need), out_dir,
                human(free))
    if need > free:
        raise Rejected(f"not enough disk space in {out_dir}: {human(need)} needed by this shard, {human(free)} free")
    ds = OpenDataset(out_dir, layout, own, provenance, mine, todo, files, len(done_ids), layer_ids, dtype, hidden,
                     (dir_lock, part_lock), speculators_version)
    ds.extra["shard"] = shard
    return ds


@dataclass
class MergeResult:
    problems: list[str]
    entries: int
    parts: list[str]


def merge_dataset(out_dir: Path, threads: int = 4) -> MergeResult:
    """Join the manifest parts of ``out_dir`` (and its ``manifest.jsonl``) into one ``manifest.jsonl``;
    raises :class:`Rejected` while a shard is running. Returns the join's problems (nothing is
    written when the parts disagree on provenance); verify the result with ``verify_dataset``."""
    from .store import check_file

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise Rejected(f"{out_dir} is not a directory")
    try:
        lock = lock_output_dir(out_dir)
    except Rejected as exc:
        raise Rejected(f"{exc}: merge when every shard has ended") from None
    try:
        parts = [_part(out_dir, p.name) for p in find_parts(out_dir)]
        base = Manifest(out_dir).load()
        header_file = out_dir / HEADER_NAME
        shared = json.loads(header_file.read_text(encoding="utf-8")) if header_file.exists() else None
        sources = ([base] if base.header is not None or base.entries else []) + parts
        names = [m.path.name for m in parts]
        if not parts:
            return MergeResult([] if base.header is not None else
                               [f"{out_dir}: neither {MANIFEST_NAME} nor manifest parts: not a data set"],
                               len(base.entries), [])
        ref = base.header or next((m.header for m in parts if m.header is not None), None) or shared
        problems: list[str] = []
        for m in sources:
            problems += [f"{p} (dropped)" for p in m.problems]
        if ref is None:
            return MergeResult([*problems, "no manifest part has a header"], 0, names)
        for m in sources:
            h = m.header
            if h is None:
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

        prov = ref["provenance"]
        layout = layout_named(ref["layout"], prov["hidden_states"]["layer_ids"])
        digest = digest_fn(ref["checksum"])
        by_file: dict[str, list[dict[str, Any]]] = {}
        for m in sources:
            for f, e in m.entries.items():
                if e not in by_file.setdefault(f, []):
                    by_file[f].append(e)
        conflicts = {f: es for f, es in by_file.items() if len(es) > 1}

        def resolve(item: tuple[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
            f, es = item
            return next((e for e in es if check_file(out_dir / f, e, layout, digest) is None), None)

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
        merged.sort(key=lambda e: (e.get("line", 0), str(e["id"])))
        out = Manifest(out_dir)
        out.header = ref
        out.entries = {e["file"]: e for e in merged}
        out.rewrite()
        fsync_dir(out_dir)
        for p in [*(out_dir / n for n in names), header_file]:
            p.unlink(missing_ok=True)
        for p in out_dir.iterdir():
            if PART_LOCK_RE.match(p.name):
                p.unlink(missing_ok=True)
        fsync_dir(out_dir)
        logger.info("merged %d manifest part(s) into %s: %d entries", len(names), out.path, len(merged))
        return MergeResult(problems, len(merged), names)
    finally:
        lock.close()


def _on_long(prov: dict[str, Any]) -> str:
    t = prov.get("truncation", "truncate")
    return t.get("on_long_line", "truncate") if isinstance(t, dict) else str(t)


def check_inputs(out_dir: Path, inputs: Path, limit: int | None = None) -> tuple[list[str], int]:
    """Every sample of ``inputs`` (read as the run read it: the provenance's vocabulary, length and
    truncation) is in the data set exactly once, made from the same ids and mask, and the data set
    holds nothing else. (problems, number of input samples)."""
    from .inputs import scan_jsonl

    m = Manifest(out_dir).load()
    if m.header is None:
        return [f"{m.path}: no manifest header"], 0
    prov = m.provenance or {}
    on_long = _on_long(prov)
    scan = scan_jsonl(Path(inputs), vocab_size=int(prov["model"]["vocab_size"]), max_seq_len=int(prov["max_seq_len"]),
                      on_bad="skip", on_long="skip" if on_long == "fail" else on_long, limit=limit)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in m.entries.values():
        by_id.setdefault(str(e["id"]), []).append(e)
    problems = []
    for s in scan.samples:
        es = by_id.pop(s.id, [])
        if not es:
            problems.append(f"id {s.id!r} (line {s.line} of {inputs}): missing from the data set")
        elif len(es) > 1:
            problems.append(f"id {s.id!r} (line {s.line}): present {len(es)} times ({', '.join(e['file'] for e in es)})")
        elif es[0].get("input_sha256") != s.digest:
            problems.append(f"id {s.id!r} (line {s.line}): its file {es[0]['file']} was made from other input_ids/"
                            "loss_mask than the input's")
    problems += [f"id {i!r} ({es[0]['file']}): in the data set but not in {inputs}" for i, es in by_id.items()]
    return problems, len(scan.samples)


def add_parser(sub: Any) -> Any:
    m = sub.add_parser("merge", help="join the manifest parts of a sharded extraction into manifest.jsonl and "
                       "verify the data set (exit 0 intact, 1 problems found, 2 not a data set or a shard running)")
    m.add_argument("dir", type=Path, help="the data set's directory")
    m.add_argument("--inputs", type=Path, default=None,
                   help="the extraction's input (JSONL): check that every sample is present exactly once")
    m.add_argument("--limit", type=int, default=None, help="the extraction's --limit, if it had one")
    m.add_argument("--threads", type=int, default=4, help="files checked in parallel")
    m.add_argument("--no-verify", action="store_true", help="join only; do not read the files back")
    return m


def main(args: Any) -> int:
    import sys

    from .verify import verify_dataset

    out_dir: Path = args.dir
    try:
        res = merge_dataset(out_dir, args.threads)
    except Rejected as exc:
        print(f"merge {out_dir}: {exc}", file=sys.stderr)
        return 2
    problems = list(res.problems)
    if not (out_dir / MANIFEST_NAME).is_file():
        for line in problems:
            print(line)
        return 2
    print(f"merge {out_dir}: {len(res.parts)} part(s) joined, {res.entries} entries", file=sys.stderr)
    n = res.entries
    try:
        _finalize(out_dir, Manifest(out_dir).load())
    except Rejected as exc:  # a file the layout's derived files are built from is not as recorded
        problems.append(str(exc))
    if not args.no_verify:
        found, n = verify_dataset(out_dir, args.threads)
        problems += found
    if args.inputs is not None:
        try:
            found, n_in = check_inputs(out_dir, args.inputs, args.limit)
        except Rejected as exc:
            print(f"merge {out_dir}: {exc}", file=sys.stderr)
            return 2
        problems += found
        print(f"merge {out_dir}: {n_in} input samples checked against the data set", file=sys.stderr)
    for line in problems:
        print(f"{out_dir}/{line}" if not line.startswith(str(out_dir)) else line)
    print(f"merge {out_dir}: {n} entries, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


def _finalize(out_dir: Path, m: Manifest) -> None:
    """A layout's derived files over the merged entries (speculators-arrow: the Arrow rows)."""
    if m.header is None:
        return
    layout = layout_named(m.header["layout"], (m.provenance or {}).get("hidden_states", {}).get("layer_ids"))
    if hasattr(layout, "finalize"):
        layout.finalize(out_dir)


def check_present(out_dir: Path) -> list[str]:
    """Cheap: every entry's file exists with the recorded size (no file is read)."""
    m = Manifest(out_dir).load()
    problems = []
    for f, e in m.entries.items():
        try:
            size = (Path(out_dir) / f).stat().st_size
        except FileNotFoundError:
            problems.append(f"{f}: missing (id {e['id']!r})")
            continue
        if size != e.get("bytes"):
            problems.append(f"{f}: {size} bytes, the manifest says {e.get('bytes')}")
    return problems


def finish_job(out_dir: Path, inputs: Path, *, limit: int | None = None, token_freq_path: Path | None = None,
               extra: dict[str, Any] | None = None) -> int:
    """After every shard of a job succeeded: merge the parts, check that every input sample is
    present once (and every file with its size; each shard checked what it skipped and wrote the
    rest with checksums, so no file is read again: ``speccompat verify`` does that), and write the
    layout's side files (speculators). 0 when all is well, 1 otherwise."""
    from types import SimpleNamespace

    from .inputs import scan_jsonl

    out_dir = Path(out_dir)
    res = merge_dataset(out_dir)
    problems = list(res.problems)
    if (out_dir / MANIFEST_NAME).is_file():
        problems += check_present(out_dir)
        found, n = check_inputs(out_dir, inputs, limit)
        problems += found
    else:
        n = 0
    for line in problems[:50]:
        logger.error("%s: %s", out_dir, line)
    if problems:
        logger.error("the merged data set %s has %d problem(s)%s", out_dir, len(problems),
                     " (first 50 shown)" if len(problems) > 50 else "")
        return 1
    m = Manifest(out_dir).load()
    prov = m.provenance or {}
    if m.header and m.header.get("layout") == "speculators":
        from .speculators_format import write_side_files

        on_long = _on_long(prov)
        scan = scan_jsonl(Path(inputs), vocab_size=int(prov["model"]["vocab_size"]),
                          max_seq_len=int(prov["max_seq_len"]), on_bad="skip",
                          on_long="skip" if on_long == "fail" else on_long, limit=limit)
        ds = SimpleNamespace(out_dir=out_dir, manifest=m, provenance=prov, samples=scan.samples,
                             layer_ids=prov["hidden_states"]["layer_ids"], hidden_size=int(prov["model"]["hidden_size"]),
                             speculators_version=None, extra=dict(extra or {}))
        write_side_files(ds, token_freq_path)
    _finalize(out_dir, m)
    logger.info("data set %s complete: %d manifest part(s) merged, all %d input samples present once", out_dir,
                len(res.parts), n)
    return 0
