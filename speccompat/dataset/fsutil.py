"""File-system helpers: atomic small files, directory fsync, the output directory's checks.

The writer's own file operations go through :class:`FileOps`, so tests can make them fail the way
a full disk does (ENOSPC) without filling one.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path

from .errors import Rejected
from .names import LOCK_NAME, TMP_SUFFIX, bad_name, tmp_name

__all__ = ["FileOps", "LOCK_NAME", "TMP_SUFFIX", "check_output_dir", "fsync_dir", "human", "is_no_space",
           "write_atomic"]

logger = logging.getLogger("speccompat.dataset")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


class FileOps:
    """The writer's system calls (one object, replaceable in tests)."""

    open = staticmethod(os.open)
    write = staticmethod(os.write)
    fsync = staticmethod(os.fsync)
    close = staticmethod(os.close)
    replace = staticmethod(os.replace)
    unlink = staticmethod(os.unlink)

    @staticmethod
    def fsync_dir(path: str) -> None:
        fsync_dir(Path(path))

    @staticmethod
    def drop_cache(fd: int) -> None:
        """Drop the pages of ``fd``'s file from the page cache once it is fsync'd (clean). Nobody
        reads a sample file again soon; without this, every file written takes fresh pages, which a
        virtual machine may have to be handed by its host first, and a long extraction evicts
        everything else cached on the host (the model's weights, the input). Advisory: a file system
        or platform without it (tmpfs, macOS) keeps its pages and the write goes on."""
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                logger.debug("posix_fadvise(DONTNEED) failed (%s); the file's pages stay cached", exc)

    @staticmethod
    def reserve(fd: int, size: int) -> None:
        """Reserve ``size`` bytes (a full disk fails here, before any byte is written)."""
        if size <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise
            # EOPNOTSUPP/EINVAL: a file system without fallocate (some network ones); write anyway


def write_all(ops: FileOps, fd: int, buf: memoryview) -> None:
    chunk = 1 << 30
    view = buf.cast("B") if buf.ndim != 1 or buf.format != "B" else buf
    pos, end = 0, len(view)
    while pos < end:
        pos += ops.write(fd, view[pos : min(end, pos + chunk)])


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, flags: int = os.O_TRUNC) -> None:
    """Write ``data`` to a new ``path`` and fsync it (``flags``: ``os.O_EXCL`` to refuse an existing one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        write_all(FileOps(), fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` has either its old content or ``data``, whenever the process dies."""
    tmp = path.with_name(tmp_name(path.name))
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_output_dir(out_dir: Path) -> None:
    """Create ``out_dir`` if needed and make sure this process can write files in it; raise
    :class:`Rejected` (naming the directory and the reason) otherwise."""
    if out_dir.exists() and not out_dir.is_dir():
        raise Rejected(f"--output-dir {out_dir} exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Rejected(f"cannot create --output-dir {out_dir}: {exc.strerror or exc}") from None
    probe = out_dir / tmp_name(".speccompat-write-test")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        why = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted", errno.ENOSPC: "no space left"}.get(exc.errno, exc.strerror)
        raise Rejected(f"cannot write files in --output-dir {out_dir}: {why}") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


# -- the folders speccompat creates and deletes inside a data set -------------------------------

def _own(root: Path, name: str) -> Path:
    why = bad_name(name)
    if why is not None:
        raise ValueError(f"{name!r} {why}: not a file name inside {root}")
    return Path(root) / name


def own_dir_problem(root: Path, name: str) -> str | None:
    """Why ``root/name``, a folder this code creates and deletes (a build folder, the Arrow view's
    ``hidden_states/``), must not be touched: it is a symbolic link or not a folder (None: it is
    absent or a plain folder)."""
    try:
        st = os.lstat(_own(root, name))
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{Path(root) / name} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{Path(root) / name} is not a folder"
    return None


def check_own_dirs(root: Path, names: tuple[str, ...] | list[str]) -> None:
    """:class:`Rejected`, before anything is deleted or moved, when one of the folders ``names`` is a
    symbolic link or not a folder: nothing outside the directory is ever followed into."""
    found = [why for n in names if (why := own_dir_problem(root, n))]
    if found:
        raise Rejected("; ".join(found) + f": refused (speccompat creates and deletes that folder itself inside "
                       f"{root}, and never follows a link out of it); remove it and run again")


def fresh_dir(root: Path, name: str) -> Path:
    """Create the folder ``root/name`` anew (``mkdir``: nothing of that name may exist, a symbolic
    link included, so nothing is followed)."""
    path = _own(root, name)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        raise Rejected(f"{path} exists: refused (it is created anew by this command; remove it)") from None
    return path


def remove_own_dir(root: Path, name: str) -> None:
    """Delete the folder ``root/name`` that this code created (a leftover of an interrupted build):
    refused when it is a symbolic link or not a folder."""
    check_own_dirs(root, [name])
    if os.path.lexists(_own(root, name)):
        shutil.rmtree(_own(root, name))
