"""``speccompat verify DIR``: check a finished data set offline, one line per problem.

Checks: the manifest's header and lines (each malformed field named with its line); every
entry's file is there, with the recorded size, tensor names, dtypes, shapes and checksums; shapes
agree with the provenance (layer ids, hidden size, the entry's token count); the input ids and
loss mask hash to the entry's ``input_sha256``; hidden states are finite; every file's provenance
(safetensors metadata) equals the manifest's; ids are unique; no file is in the directory that
the manifest does not list (temporary files included). All of it is
:meth:`~speccompat.dataset.directory.DatasetDir.check_file` at level ``verify``. Exit status 0 when
nothing is wrong, 1 when a problem is found, 2 when DIR is not a data set (no ``manifest.jsonl``, or
one without a header that can be read), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import digest_fn
from .directory import TRASH_NAME, DatasetDir
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_REJECTED, DatasetError
from .fsutil import LOCK_NAME, TMP_SUFFIX
from .layouts import layout_of
from .manifest import MANIFEST_NAME

__all__ = ["add_parser", "check_view", "main", "verify_dataset"]


def check_view(ddir: DatasetDir, m: Any, layout: Any = None) -> list[str]:
    """Problems of a layout's derived files (speculators-arrow: the trainer's view); none for a
    layout without. ``layout``: the manifest's when not given."""
    if layout is None:
        layout = layout_of(m.header)
    return layout.check_view(ddir.root, m) if hasattr(layout, "check_view") else []


def verify_dataset(out_dir: DatasetDir | Path, threads: int = 4, *, view: bool = True,
                   own_lock: bool = False) -> tuple[list[str], int]:
    """(problems, number of entries checked). ``view`` False leaves a layout's derived files
    unchecked (a merge checks them once it has built them). A set a run is writing (its lock held)
    gets that as its first problem, and its names not in the manifest are not listed (they are
    that run's files in progress); ``own_lock``: the caller is that writer, and has finished."""
    ddir = DatasetDir.of(out_dir)
    m = ddir.manifest()
    problems = list(m.problems)
    if m.header is None:
        if m.header_problem:
            return problems, 0
        return [*problems, f"{m.path}: no manifest header: not a speccompat data set"], 0
    prov = m.provenance
    layout = layout_of(m.header)
    digest = digest_fn(m.header["checksum"])
    prov_sha = m.header["provenance_sha256"]
    if prov_mod.digest(prov) != prov_sha:
        problems.append(f"{MANIFEST_NAME}: provenance_sha256 does not match its provenance")
    ids = Counter(e["id"] for e in m.entries.values())
    problems += [f"{MANIFEST_NAME}: id {i!r} has {c} entries" for i, c in ids.items() if c > 1]
    entries = list(m.entries.values())

    def check(e: dict[str, Any]) -> list[str]:
        return ddir.check_file(e, layout, digest, level="verify", provenance=prov, provenance_sha256=prov_sha)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for res in pool.map(check, entries):
            problems += res
    if view:
        problems += check_view(ddir, m, layout)
    known = {MANIFEST_NAME, LOCK_NAME, *m.entries, *layout.derived_names(ddir.root)}
    unknown = [n for n in ddir.names() if n not in known]
    problems += links_outside(ddir, skip={*m.entries, *unknown})
    writing = None if own_lock else being_written(ddir)
    if writing is not None:  # what is not finished yet is no problem of the set: say so, list nothing of it
        return [f"{MANIFEST_NAME}: the data set is being written ({writing}): only the {len(entries)} sample(s) "
                "finished so far were checked; verify it when the run has ended", *problems], len(entries)
    for name in unknown:
        kind = "temporary file of an interrupted run" if name.endswith(TMP_SUFFIX) else "not in the manifest"
        if (target := _outside_target(ddir, name)) is not None:
            kind = f"a symbolic link to {target}, outside the data set"
        if name.startswith("manifest.shard-"):
            kind = f"a manifest part not merged: run `speccompat merge {out_dir}`"
        if name == TRASH_NAME:
            kind = "an interrupted --overwrite: re-run it"
        problems.append(f"{name}: extra file ({kind})")
    return problems, len(entries)


def being_written(ddir: DatasetDir) -> str | None:
    """Who holds the data set's lock or a shard's lock now (None: no run is writing it). Probed with a
    shared flock on a read-only descriptor: nothing is created or written, no link followed."""
    import fcntl

    from .directory import PART_LOCK_RE

    for name in [LOCK_NAME, *(n for n in ddir.names() if PART_LOCK_RE.match(n))]:
        try:
            fd = os.open(ddir.path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            return f"pid {pid} holds {name}"
        finally:
            os.close(fd)
    return None


def _outside_target(ddir: DatasetDir, rel: str) -> str | None:
    """The target of ``DIR/rel`` when it is a symbolic link resolving outside ``DIR`` (else None)."""
    path = ddir.root / rel
    if not os.path.islink(path):
        return None
    root = os.path.realpath(ddir.root)
    target = os.path.realpath(path)
    if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
        return None
    return os.readlink(path)


def links_outside(ddir: DatasetDir, skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """A problem for every symbolic link among the data set's own names (manifest, lock, side and view
    files, and the files in the folders speccompat keeps in it) that points outside the data set: a
    reader of the set follows it. ``skip``: names already checked (the manifest's sample files)."""
    from .directory import OWN_DIRS

    found = []
    for name in ddir.names():
        rels = [name]
        if name in OWN_DIRS and os.path.isdir(ddir.root / name) and not os.path.islink(ddir.root / name):
            rels += [f"{name}/{n}" for n in sorted(os.listdir(ddir.root / name))]
        for rel in rels:
            if rel in skip:
                continue
            target = _outside_target(ddir, rel)
            if target is not None:
                found.append(f"{rel}: a symbolic link to {target}, outside the data set (a reader of the set "
                             "reads that file; replace the link by the file)")
    return found


def add_parser(sub: Any) -> argparse.ArgumentParser:
    v = sub.add_parser("verify", help="check a data set written by speccompat.dataset offline "
                       "(exit 0 intact, 1 problems found, 2 not a data set, 130 interrupted)")
    v.add_argument("dir", type=Path, help="the data set's directory (holds manifest.jsonl)")
    v.add_argument("--threads", type=int, default=4, help="files checked in parallel")
    return v


def main(args: argparse.Namespace) -> int:
    out_dir: Path = args.dir
    ddir = DatasetDir(out_dir)
    if not out_dir.is_dir() or not ddir.path(MANIFEST_NAME).is_file():
        parts = ddir.parts() if out_dir.is_dir() else []
        hint = f"; it holds {len(parts)} manifest part(s): run `speccompat merge {out_dir}`" if parts else ""
        if out_dir.is_dir() and (writing := being_written(ddir)) is not None:
            hint = f"; it is being written ({writing}): verify it when the run has ended"
        print(f"{out_dir}: not a data set directory (no {MANIFEST_NAME}){hint}", file=sys.stderr)
        return EXIT_REJECTED
    try:
        problems, n = verify_dataset(ddir, args.threads)
    except DatasetError as exc:  # e.g. a manifest that is a symbolic link
        print(f"verify {out_dir}: {exc}", file=sys.stderr)
        return exc.exit_status
    except OSError as exc:
        print(f"verify {out_dir}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"verify {out_dir}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    for line in problems:
        print(f"{out_dir}/{line}" if not line.startswith(str(out_dir)) else line)
    print(f"verify {out_dir}: {n} entries, {len(problems)} problem(s)", file=sys.stderr)
    if _no_header(problems):  # not a data set: its manifest has no header that can be read
        return EXIT_REJECTED
    return EXIT_FAILED if problems else EXIT_OK


def _no_header(problems: list[str]) -> bool:
    return any(p.startswith(f"{MANIFEST_NAME} line 1 (the header)") or p.endswith("not a speccompat data set")
               for p in problems)
