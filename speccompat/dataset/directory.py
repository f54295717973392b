"""The owner of a data set's output directory: every name in it, its locks, its manifests, the one
file check and the one resume planner.

Guarantees (docs/dataset.md, "The output directory"):

- every path it hands out is ``DIR/<name>`` with ``name`` a plain file name (no ``/``, no ``..``,
  not absolute, no NUL): a manifest entry naming anything else is malformed and dropped, so no
  run ever reads, writes or deletes outside ``DIR`` because of what the directory holds;
- a lock file or sample file that is a symbolic link is refused, naming it (opened with
  ``O_NOFOLLOW``), and so is a lock file with more than one hard link (its pid would be written
  into the other name's file); ``os.replace``/``unlink`` act on the link itself, never on its target;
- locks are context managers (:meth:`DatasetDir.lock`): a refused open releases them;
- a manifest is parsed once (:class:`~speccompat.dataset.manifest.Manifest`), each malformed line
  or field named with its file and line;
- :meth:`DatasetDir.check_file` is the one check of a sample file against its entry, at level
  ``resume`` (size, header, tensors, checksums) or ``verify`` (also shapes against the provenance,
  finiteness, the input's hash, the embedded provenance and id);
- :func:`plan_resume` is the one resume plan, for a whole run (shard 0 of 1) and for shard K of N.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import fp8
from . import provenance as prov_mod
from .errors import Rejected
from .fsutil import (
    check_output_dir,
    check_own_dirs,
    free_bytes,
    fresh_dir,
    own_dir_problem,
    remove_own_dir,
    write_atomic,
)
from .inputs import input_digest
from .manifest import Manifest
from .names import (
    EXPORT_STAGING,
    HEADER_LOCK_NAME,
    HEADER_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    OWN_DIRS,
    PART_LOCK_RE,
    PART_RE,
    TMP_SUFFIX,
    TRASH_NAME,
    bad_name,
    part_lock_name,
    part_name,
    tmp_name,
    token_freq_beside,
)
from .spec import StoredSpec

__all__ = ["EXPORT_STAGING", "HEADER_LOCK_NAME", "OWN_DIRS", "HEADER_NAME", "LOCK_NAME", "PART_LOCK_RE", "PART_RE", "TRASH_NAME", "DatasetDir", "DirLock", "Plan",
           "bad_name", "part_lock_name", "part_name", "plan_resume"]

logger = logging.getLogger("speccompat.dataset")

_TMP_RE = re.compile(r"^(.*)\.\d+" + re.escape(TMP_SUFFIX) + "$")


class DirLock:
    """An flock on a plain file of the directory; a context manager (``close()`` releases it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DatasetDir:
    """A data set's directory. Every file name in it goes through :meth:`path`."""

    def __init__(self, path: Path | str) -> None:
        self.root = Path(path)

    @classmethod
    def of(cls, where: DatasetDir | Path | str) -> DatasetDir:
        """``where`` itself when it is a :class:`DatasetDir` (a command builds one and passes it on), else one for it."""
        return where if isinstance(where, DatasetDir) else cls(where)

    def __str__(self) -> str:
        return str(self.root)

    # -- names -------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """``DIR/name``; raises :class:`ValueError` for anything but a plain file name."""
        why = bad_name(name)
        if why is not None:
            raise ValueError(f"{name!r} {why}: not a file name inside {self.root}")
        return self.root / name

    def is_symlink(self, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.lstat(self.path(name)).st_mode)
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def unlink(self, name: str) -> None:
        """Remove ``DIR/name`` (a symbolic link is removed itself, never its target); a folder there
        is not removed: :class:`Rejected`, naming it."""
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass
        except (IsADirectoryError, PermissionError) as exc:
            if not os.path.isdir(self.path(name)) or os.path.islink(self.path(name)):
                raise
            raise Rejected(f"{self.path(name)} is a folder where a file of the data set belongs: refused (remove "
                           "it, or use another --output-dir)") from exc

    def held(self, name: str) -> bool:
        """Whether another process holds the lock file ``name`` now (it is not created when missing)."""
        if not os.path.lexists(self.path(name)):
            return False
        with self._open_lock(name) as fd:  # a link is refused here, not taken for a holder
            os.close(fd)
        try:
            self.lock(name).close()
        except Rejected:
            return True
        return False

    def parts(self) -> list[str]:
        """Names of the manifest parts of a sharded extraction, in name order."""
        return [n for n in self.names() if PART_RE.match(n)]

    def manifest(self, name: str = MANIFEST_NAME) -> Manifest:
        """The manifest ``DIR/name`` as it is on disk (empty when it is missing)."""
        return Manifest(self.root, self.path(name).name).load()

    def new_manifest(self, name: str = MANIFEST_NAME) -> Manifest:
        """An empty manifest for ``DIR/name``, not read: the caller sets its header and rewrites it."""
        return Manifest(self.root, self.path(name).name)

    def token_freq_path(self, override: Path | str | None = None) -> Path:
        """The token-frequency file: ``override``, else ``<DIR>.token_freq.pt`` beside the directory
        (never inside: speculators' loader takes every file ending in ``pt`` under it for a sample).
        The directory is resolved first, so ``--output-dir .`` works."""
        if override is not None:
            return Path(override)
        return token_freq_beside(self.root)

    def own_dir_problem(self, name: str) -> str | None:
        """Why ``DIR/name``, a folder this code creates and deletes, must not be touched
        (:func:`speccompat.dataset.fsutil.own_dir_problem`)."""
        return own_dir_problem(self.root, name)

    def check_own_dirs(self, names: tuple[str, ...] | list[str] = ()) -> None:
        """:class:`Rejected` when one of the folders ``names`` (default: every folder any layout or
        command creates in a data set) is a symbolic link or not a folder."""
        check_own_dirs(self.root, names or OWN_DIRS)

    def fresh_dir(self, name: str) -> Path:
        """Create the folder ``DIR/name`` anew (nothing of that name may exist)."""
        return fresh_dir(self.root, name)

    def remove_own_dir(self, name: str) -> None:
        """Delete the folder ``DIR/name`` that this code created (refused for a link or a file)."""
        remove_own_dir(self.root, name)

    def token_freq_problem(self, path: Path | str | None, flag: str = "--token-freq-path") -> str | None:
        """Why ``path`` cannot be the token-frequency file: it is inside the directory, where
        speculators' loader takes every file ending in ``pt`` for a sample and fails on it."""
        if path is None:
            return None
        root = os.path.realpath(self.root)
        target = os.path.realpath(path)
        if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
            return (f"{flag} {path} is inside the output directory {self.root}: speculators' data loader reads every "
                    f"file ending in pt there as a sample and fails on it; put it beside the directory (the default "
                    f"is {self.token_freq_path()})")
        return None

    def ensure(self) -> None:
        """Create the directory if needed; :class:`Rejected` when it is not writable."""
        if self.root.is_symlink() and not self.root.is_dir():
            raise Rejected(f"--output-dir {self.root} is a dangling symbolic link")
        check_output_dir(self.root)

    # -- locks -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _open_lock(self, name: str) -> Iterator[int]:
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Rejected(f"{path} is a symbolic link: refused (a lock file must be a plain file of the data "
                               "set; remove the link)") from None
            raise Rejected(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Rejected(f"{path} is not a plain file: refused as a lock file")
            if st.st_nlink != 1:  # a hard link: writing the pid would overwrite the other name's file
                raise Rejected(f"{path} has {st.st_nlink} hard links: refused (a lock file must be a file of the data "
                               "set only; nothing was written to it: remove it and run again)")
            yield fd
        except BaseException:
            os.close(fd)
            raise

    def lock(self, name: str = LOCK_NAME, *, exclusive: bool = True, busy: str | None = None,
             wait: bool = False) -> DirLock:
        """Take the flock ``name`` (exclusive or shared) without waiting (``wait``: until it is free);
        :class:`Rejected` with ``busy`` (or the holder's pid) when another process holds it. Use as
        a context manager."""
        import fcntl

        with self._open_lock(name) as fd:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                raise Rejected(busy or f"another extraction is writing to {self.root} (pid {holder})") from None
            if exclusive:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            return DirLock(self.path(name), fd)

    # -- leftovers, header, overwrite -----------------------------------------------------------

    def remove_leftovers(self, only_of: set[str] | None = None) -> list[str]:
        """Remove temporary files of interrupted writes (``only_of``: those of these file names)."""
        gone = []
        for n in self.names():
            m = _TMP_RE.match(n)
            if n.endswith(TMP_SUFFIX) and (only_of is None or (m is not None and m.group(1) in only_of)):
                try:
                    if stat.S_ISDIR(os.lstat(self.path(n)).st_mode):
                        logger.warning("%s is a folder named like a temporary file: left as it is",
                                       self.root / n)
                        continue
                    self.unlink(n)
                except (OSError, ValueError) as exc:
                    logger.warning("cannot remove %s: %s", self.root / n, exc)
                    continue
                gone.append(n)
        if gone:
            logger.info("removed %d temporary file(s) left by an interrupted run: %s", len(gone),
                        ", ".join(gone[:5]) + (" ..." if len(gone) > 5 else ""))
        return gone

    def shared_header(self, header: dict[str, Any]) -> dict[str, Any]:
        """The header all shards use: ``manifest.header.json`` if present, else ``header``, created
        there atomically and exclusively unless another shard was first (then theirs)."""
        path = self.path(HEADER_NAME)
        data = (json.dumps(header, ensure_ascii=False) + "\n").encode("utf-8")
        if not os.path.lexists(path):
            from .fsutil import fsync_dir, write_durable

            tmp = self.path(tmp_name(HEADER_NAME))
            write_durable(tmp, data)
            try:
                os.link(tmp, path)  # atomic and exclusive: EEXIST when another shard was first
                fsync_dir(self.root)
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
            stored = self.read_json(HEADER_NAME)
            if isinstance(stored, dict) and isinstance(stored.get("provenance"), dict):
                return stored
            time.sleep(0.1)  # written by another shard just now (without hard links)
        raise Rejected(f"{path} is not a data-set header; remove it if no shard is running")

    def read_json(self, name: str) -> Any:
        """The JSON in ``DIR/name`` (None when missing, a symbolic link or not JSON)."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder of that name
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                return json.loads(f.read())
            except ValueError:
                return None

    def interrupted_overwrite(self) -> bool:
        return os.path.lexists(self.root / TRASH_NAME)

    def move_aside(self, names: list[str]) -> None:
        """``--overwrite``: move ``names`` (the old set: manifest first, then its files and side
        files) into :data:`TRASH_NAME`, then delete that folder. A reader never sees old and new
        files side by side: nothing new is written before every old file has left the directory,
        and a run interrupted here is finished by the next ``--overwrite`` (a plain run refuses)."""
        trash = self.root / TRASH_NAME
        if trash.is_symlink() or (trash.exists() and not trash.is_dir()):
            raise Rejected(f"{trash} is not a folder of this data set: remove it")
        trash.mkdir(exist_ok=True)
        from .fsutil import fsync_dir

        fsync_dir(self.root)
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path(n), trash / n)
        fsync_dir(self.root)
        for p in trash.iterdir():
            if p.is_dir() and not p.is_symlink():  # a layout's folder (speculators-arrow: hidden_states/)
                shutil.rmtree(p)
            else:
                os.unlink(p)
        trash.rmdir()
        fsync_dir(self.root)

    # -- the one file check ----------------------------------------------------------------------

    def check_file(self, entry: dict[str, Any], layout: Any, digest: Callable[[memoryview], str], *,
                   level: str = "resume", provenance: dict[str, Any] | None = None,
                   provenance_sha256: str | None = None) -> list[str]:
        """Problems of ``entry``'s file (empty: intact). ``level="resume"``: size, header, tensor
        names, dtypes, shapes and checksums against the entry; ``"verify"`` also: shapes against
        ``provenance``, finite hidden states, ``input_sha256``, the embedded provenance and id.
        A problem reads ``"<file>: <what>"``; a missing file gives ``"<file>: missing ..."``."""
        name = entry["file"]
        path = self.path(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return [f"{name}: missing (id {entry['id']!r})"]
        if stat.S_ISLNK(st.st_mode):
            return [f"{name}: is a symbolic link, not a file of this data set (refused)"]
        if not stat.S_ISREG(st.st_mode):
            return [f"{name}: not a plain file"]
        p: list[str] = []
        if st.st_size != entry["bytes"]:
            p.append(f"{name}: {st.st_size} bytes, the manifest says {entry['bytes']}")
            if level == "resume":
                return p
        try:
            meta, tensors, _keep = layout.read(path)
        except (OSError, ValueError) as exc:
            return [*p, f"{name}: unreadable: {exc}"]
        want = entry["tensors"]
        for t, (dtype, shape, buf) in sorted(tensors.items()):
            w = want.get(t)
            if w is None:
                p.append(f"{name}: tensor {t} is not in the manifest")
            elif [dtype, shape] != [w["dtype"], w["shape"]]:
                p.append(f"{name}: {t} is {dtype} {shape}, the manifest says {w['dtype']} {w['shape']}")
            elif digest(buf) != w["checksum"]:
                p.append(f"{name}: {t} checksum differs from the manifest (the file changed after it was written)")
        p += [f"{name}: tensor {t} of the manifest is missing from the file" for t in sorted(set(want) - set(tensors))]
        if level == "verify" and provenance is not None:
            p += _verify_contents(name, entry, layout, meta, tensors, provenance, provenance_sha256)
        return p

    def check_fn(self, layout: Any, digest: Callable[[memoryview], str]) -> Callable[[dict[str, Any]], str | None]:
        """The resume-level check as ``entry -> None | first problem`` (without the file name)."""
        def check(entry: dict[str, Any]) -> str | None:
            found = self.check_file(entry, layout, digest)
            return found[0].removeprefix(f"{entry['file']}: ") if found else None
        return check

    def free(self) -> int:
        return free_bytes(self.root)

    def write_side_file(self, name: str, data: bytes) -> None:
        """Write ``DIR/name`` atomically, unless it already holds ``data``."""
        path = self.path(name)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            if not path.is_symlink() and path.read_bytes() == data:
                return
        write_atomic(path, data)


def _frombuffer(buf: memoryview, dtype: Any) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():  # read-only mmap: the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype)


def _check_scales(name: str, dtype: str, buf: memoryview, granularity: str | None) -> list[str]:
    """Problems of an fp8 sample's ``hidden_states_scales``: float32, finite, positive."""
    import torch

    if granularity is None:
        return [f"{name}: {fp8.SCALES} in a data set that is not fp8"]
    if dtype != "F32":
        return [f"{name}: {fp8.SCALES} is {dtype}, expected F32"]
    if len(buf) % 4:
        return []  # the size check names it
    s = _frombuffer(buf, torch.float32) if len(buf) else torch.empty(0)
    bad = int((~torch.isfinite(s) | (s <= 0)).sum())
    return [f"{name}: {fp8.SCALES} has {bad} value(s) that are not finite and positive"] if bad else []


def _verify_contents(name: str, entry: dict[str, Any], layout: Any, meta: dict[str, Any],
                     tensors: dict[str, Any], prov: dict[str, Any], prov_sha: str | None) -> list[str]:
    """The verify level's checks beyond the entry: shapes from the provenance, finiteness, the
    input's hash, the embedded provenance and id."""
    import torch

    p: list[str] = []
    spec = StoredSpec.of_provenance(prov)
    layer_ids = list(spec.layer_ids)
    n = entry["num_tokens"]
    st_dtype = spec.safetensors_dtype
    expected = layout.expected_tensors(n, layer_ids, spec.hidden_size,
                                       "loss_mask" in entry["tensors"] or "loss_mask" in tensors)
    granularity = spec.granularity
    if granularity is not None:  # fp8: the scales beside the states
        expected[fp8.SCALES] = fp8.scales_shape(n, len(layer_ids), granularity)
    if set(tensors) != set(expected):
        p.append(f"{name}: tensors {sorted(tensors)}, expected {sorted(expected)}")
    torch_of = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    for t, (dtype, shape, buf) in sorted(tensors.items()):
        if t in expected and shape != expected[t]:
            p.append(f"{name}: {t} has shape {shape}, expected {expected[t]}")
        if t == fp8.SCALES:
            p += _check_scales(name, dtype, buf, granularity)
            continue
        if t.startswith("hidden_states") and dtype == "F8_E4M3" and len(buf):
            nan = int(((_frombuffer(buf, torch.uint8) & 0x7F) == 0x7F).sum())  # e4m3fn's NaN: S.1111.111
            if nan:
                p.append(f"{name}: {t} has {nan} NaN values")
        if t.startswith("hidden_states") and dtype != st_dtype:
            p.append(f"{name}: {t} is {dtype}, the data set stores {st_dtype}")
        if t.startswith("hidden_states") and dtype in torch_of and len(buf) % torch_of[dtype].itemsize == 0 \
                and len(buf):
            x = _frombuffer(buf, torch_of[dtype])
            if not bool(torch.isfinite(x).all()):
                p.append(f"{name}: {t} has {int((~torch.isfinite(x)).sum())} non-finite values")

    def ints(t: str) -> list[int] | None:
        if t not in tensors or tensors[t][0] != "I64" or len(tensors[t][2]) % 8:
            return None
        return _frombuffer(tensors[t][2], torch.int64).tolist() if len(tensors[t][2]) else []

    ids = ints("input_ids")
    if ids is not None:
        mask = ints("loss_mask")
        if input_digest(ids, mask) != entry["input_sha256"] and not (
                layout.name != "safetensors" and input_digest(ids, None) == entry["input_sha256"]
                and set(mask or []) <= {1}):
            p.append(f"{name}: input_ids/loss_mask do not hash to the manifest's input_sha256")
    if layout.suffix == ".safetensors":  # the layouts whose files carry their provenance
        raw = meta.get("speccompat_provenance")
        fprov: Any = None
        if raw is None:
            p.append(f"{name}: no provenance in its metadata")
        else:
            try:
                fprov = json.loads(raw)
            except ValueError:
                p.append(f"{name}: provenance metadata is not JSON")
        if isinstance(fprov, dict) and prov_mod.digest(fprov) != prov_sha:
            diffs = prov_mod.differences(prov, fprov)
            p.append(f"{name}: provenance differs from the manifest's: " + "; ".join(diffs[:3]))
        elif fprov is not None and not isinstance(fprov, dict):
            p.append(f"{name}: provenance metadata is not a JSON object")
        try:
            sample = json.loads(meta.get("speccompat_sample") or "{}")
        except ValueError:
            sample = None
        sid = sample.get("id") if isinstance(sample, dict) else None
        if sid != entry["id"]:
            p.append(f"{name}: its metadata names id {sid!r}, the manifest {entry['id']!r}")
    return p


# ---------------------------------------------------------------------------------------------
# the one resume planner
# ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    files: dict[str, str]  # id -> file name, for every sample of this run (or shard)
    done_ids: set[str]
    todo: list[Any]


def plan_resume(ddir: DatasetDir, own: Manifest, samples: list[Any], mine: list[Any],
                stored: dict[str, list[dict[str, Any]]], layout: Any, digest: Callable[[memoryview], str], *,
                index: int = 0, num_shards: int = 1, check_threads: int = 4, fresh: bool = False,
                what: str = "against the manifest", annotate: Callable[[Plan], None] | None = None) -> Plan:
    """The resume plan of shard ``index`` of ``num_shards`` (a whole run: 0 of 1).

    ``samples`` is the whole input, ``mine`` this shard's samples, ``stored`` the entries of every
    manifest of the directory by id (this run's own ``own`` manifest first). A sample is done when
    a stored entry's file checks out (:meth:`DatasetDir.check_file` at level ``resume``); a failed
    one is removed and redone. File names: the stored one, else the layout's (by id; or
    ``data_<input index>.pt``), else one no other shard of this split can pick. ``own`` loses the
    entries of failed or missing files and is rewritten (:class:`Rejected` when it cannot be).
    ``fresh``: nothing stored counts (``--overwrite``). ``annotate(plan)`` runs before ``own`` is
    written (a shard records its progress facts in the header)."""
    files: dict[str, str] = {}
    taken = {e["file"] for es in stored.values() for e in es}
    position = {s.id: k for k, s in enumerate(samples)}
    extra = 0
    for s in mine:
        if s.id in stored:
            files[s.id] = stored[s.id][0]["file"]
            continue
        name = layout.file_name(s.id, position[s.id])
        while name in taken:  # another id has it: a name no other shard of this split can pick
            name = layout.file_name(s.id, len(samples) + index + num_shards * extra)
            extra += 1
        files[s.id] = name
        taken.add(name)

    check = ddir.check_fn(layout, digest)

    def judge(s: Any) -> str | None:
        why = "missing"
        for e in stored[s.id]:
            if e["file"] == files[s.id]:
                why = check(e)
                if why is None:
                    return None
        return why

    candidates = [] if fresh else [s for s in mine if s.id in stored]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max(1, check_threads)) as pool:
        results = list(pool.map(judge, candidates))
    done_ids: set[str] = set()
    for s, why in zip(candidates, results, strict=True):
        if why is None:
            done_ids.add(s.id)
            continue
        own.entries.pop(files[s.id], None)
        if not why.startswith("missing"):
            logger.warning("%s (id %r, line %d): %s; it will be redone", files[s.id], s.id, s.line, why)
            ddir.unlink(files[s.id])
    if candidates:
        logger.info("checked %d finished file(s) %s in %.1f s: %d intact, %d to redo", len(candidates), what,
                    time.monotonic() - t0, len(done_ids), len(candidates) - len(done_ids))
    for f, e in list(own.entries.items()):
        if e["id"] not in done_ids and not os.path.lexists(ddir.path(f)):
            del own.entries[f]
    plan = Plan(files, done_ids, [s for s in mine if s.id not in done_ids])
    if annotate is not None:
        annotate(plan)
    try:
        own.rewrite()
    except OSError as exc:
        raise Rejected(f"cannot write {own.path}: {exc.strerror}") from None
    return plan
