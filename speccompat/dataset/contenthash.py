"""The full-content digest of large files (a checkpoint's weights), computed in parallel and cached.

:func:`file_digests` reads every byte of every file. A file is cut into :data:`SEGMENT` byte
segments; each segment is hashed on its own with XXH3-128 (``xxhash``), on a pool of threads (the
reads release the GIL, so one thread hashes while the others wait for the disk), and the file's
digest is the XXH3-128 of its size and its segments' digests in order (:data:`METHOD`). Any byte
changed anywhere changes the digest.

A digest is cached per file, keyed by the file's resolved path, size, modification and change
times (nanoseconds), inode and device, in the user's cache directory
(``$SPECCOMPAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/speccompat``, else ``~/.cache/speccompat``;
``SPECCOMPAT_CACHE_DIR=""`` turns the cache off): a resume or a second run on the same checkpoint
reads no weight byte again. Nothing is ever written next to the files (a checkpoint may be
read-only or shared); a cache directory that cannot be written is skipped (the digests are then
computed every time). A file edited in place gets a new modification and change time, so it is
read again; a copy has a new inode, so it is read once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["METHOD", "SEGMENT", "cache_dir", "default_threads", "file_digests"]

logger = logging.getLogger("speccompat.dataset")

#: Bytes per independently hashed segment of a file.
SEGMENT = 64 << 20
#: Bytes read per call within a segment.
CHUNK = 8 << 20
#: Name and version of the digest, stored with it: a change of method is a change.
METHOD = "xxh3-128-segments-64MiB-v1"


def default_threads() -> int:
    """Reading threads: the hashing itself holds the GIL (one core, ~4 GB/s for XXH3), the reads do
    not, so more reads in flight than cores keep a disk's queue full (benchmarks/model_identity.py)."""
    return max(4, min(16, 2 * (os.cpu_count() or 2)))


def cache_dir() -> Path | None:
    """Where digests are cached (None: not cached)."""
    env = os.environ.get("SPECCOMPAT_CACHE_DIR")
    if env is not None:
        return Path(env) / "file-digests" if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "speccompat" / "file-digests"


def _key(path: Path) -> tuple[str, dict[str, Any]]:
    real = os.path.realpath(path)
    st = os.stat(real)
    key = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
           "inode": st.st_ino, "device": st.st_dev, "method": METHOD}
    return real, key


def _entry_name(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40] + ".json"


def _cached(where: Path | None, key: dict[str, Any]) -> str | None:
    if where is None:
        return None
    try:
        fd = os.open(where / _entry_name(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            obj = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if isinstance(obj, dict) and obj.get("key") == key and isinstance(obj.get("digest"), str):
        return obj["digest"]
    return None


def _store(where: Path | None, key: dict[str, Any], digest: str) -> None:
    if where is None:
        return
    tmp = where / f".{_entry_name(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"key": key, "digest": digest}).encode())
        os.replace(tmp, where / _entry_name(key))
    except OSError as exc:
        logger.debug("cannot cache the digest of %s in %s: %s", key["path"], where, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _segment(path: str, start: int, end: int, buffers: threading.local) -> bytes:
    import xxhash

    buf = getattr(buffers, "buf", None)
    if buf is None:
        buf = buffers.buf = bytearray(CHUNK)
    view = memoryview(buf)
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = start
        while pos < end:
            n = os.preadv(fd, [view[: min(CHUNK, end - pos)]], pos)
            if n <= 0:
                raise OSError(f"{path}: ended at byte {pos} while being read (it changed)")
            h.update(view[:n])
            pos += n
    finally:
        os.close(fd)
    return h.digest()


def file_digests(paths: list[Path], *, threads: int | None = None, what: str = "files") -> dict[Path, str]:
    """``{path: hex digest of its whole content}`` (:data:`METHOD`), cached (module documentation).
    Raises ``OSError`` for a file that cannot be read, ``ImportError`` without ``xxhash``."""
    import xxhash

    where = cache_dir()
    keys = {p: _key(p) for p in paths}
    out: dict[Path, str] = {}
    todo = []
    for p, (_real, key) in keys.items():
        hit = _cached(where, key)
        if hit is None:
            todo.append(p)
        else:
            out[p] = hit
    if not todo:
        if paths:
            logger.info("%s: %d file(s), every digest cached (%s)", what, len(paths), where)
        return out
    total = sum(keys[p][1]["size"] for p in todo)
    workers = threads or default_threads()
    logger.info("%s: reading %d file(s), %.1f GB, to hash their whole content (%d cached; %d threads)", what,
                len(todo), total / 1e9, len(out), workers)
    t0 = time.monotonic()
    buffers = threading.local()
    jobs = [(p, a, min(a + SEGMENT, keys[p][1]["size"])) for p in todo
            for a in range(0, max(1, keys[p][1]["size"]), SEGMENT)]
    with ThreadPoolExecutor(workers, thread_name_prefix="speccompat-hash") as pool:
        parts = list(pool.map(lambda j: _segment(keys[j[0]][0], j[1], j[2], buffers), jobs))
    by_file: dict[Path, list[bytes]] = {}
    for (p, _a, _b), d in zip(jobs, parts, strict=True):
        by_file.setdefault(p, []).append(d)
    for p in todo:
        real, key = keys[p]
        if _key(p)[1] != key:
            raise OSError(f"{p} changed while it was read")
        h = xxhash.xxh3_128(f"{key['size']}\0".encode())
        for d in by_file[p]:
            h.update(d)
        out[p] = h.hexdigest()
        _store(where, key, out[p])
    s = time.monotonic() - t0
    logger.info("%s: hashed %.1f GB in %.1f s (%.2f GB/s)", what, total / 1e9, s, total / 1e9 / max(s, 1e-9))
    return out
