"""Moving captured hidden states from a worker process to the driver without pickling them.

``collective_rpc`` pickles its reply and pushes it through vLLM's message queue: for hidden states
that is several copies of every byte (layers x tokens x hidden x 2 bytes: 29 MB for 4 layers of 512
Kimi-K2.5 tokens, gigabytes per batch). Instead the worker writes the packed states once, straight
from the device, into a file in shared memory (``/dev/shm``) and replies with its name; the driver
maps the file, unlinks it at once (the mapping stays valid) and copies each sequence out.

Two kinds of file:

* :func:`allocate` / :func:`pack`: a new file per reply (the driver's mapping is the only one left
  once it has unlinked it).
* :class:`Staging`: the worker keeps its files and reuses them from reply to reply, grown when a
  batch needs more (made and pinned on a thread of their own while the engine computes, where the
  caller can wait for them: :meth:`Staging.try_allocate`). Fresh shared pages are slow to write (a page fault per 4 KiB, and a GPU can
  only copy into them through a bounce buffer: 1.3 GB/s measured on an H200 host); reused pages are
  already there, and when the states come from a GPU a file is registered with CUDA once (pinned),
  so each reply is one DMA copy (55 GB/s measured). The driver keeps its mapping of each file and
  may hand out views of it: a file with live views is reported :func:`busy` with the next request,
  and the worker then fills another one, so a view is never overwritten.

Small replies travel inline, and so does any reply that would not fit in ``/dev/shm`` with room
to spare (containers often mount a small one; a full tmpfs kills the writer with SIGBUS).
"""

from __future__ import annotations

import atexit
import errno
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from typing import Any

__all__ = ["INLINE_LIMIT", "Staging", "allocate", "busy", "discard", "pack", "unpack"]

logger = logging.getLogger("speccompat")

#: Replies up to this many bytes are pickled inline (no file).
INLINE_LIMIT = 4 << 20
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
#: Growth granularity of a staging file (2 MiB: the huge-page size, keeps regrowth rare).
_ROUND = 2 << 20


def _shm_has_room(nbytes: int) -> bool:
    if _SHM is None:
        return False
    st = os.statvfs(_SHM)
    return st.f_bavail * st.f_frsize > 2 * nbytes + (256 << 20)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _new_file(suffix: str, numel: int, dtype: Any) -> tuple[str, Any]:
    """A new shared-memory file of ``numel`` elements and its mapping (a flat tensor)."""
    import torch

    fd, path = tempfile.mkstemp(prefix="speccompat-", suffix=suffix, dir=_SHM)
    try:
        try:
            # Reserve the pages now: a sparse file passes the free-space check, and two engines on a
            # host could both pass it and then die of SIGBUS writing into a full /dev/shm.
            os.posix_fallocate(fd, 0, numel * dtype.itemsize)
        finally:
            os.close(fd)
        return path, torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except BaseException:
        os.unlink(path)
        raise


def _no_room(exc: OSError) -> bool:
    """``/dev/shm`` filled up between the free-space check and the reservation: reply inline."""
    if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return False
    logger.warning("speccompat: /dev/shm has no room for a reply (%s); sending it inline", exc)
    return True


def _map_and_unlink(path: str, numel: int, dtype: Any) -> Any:
    """Driver side: map a worker's file (a flat tensor) and remove its name; the mapping stays."""
    import torch

    try:
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.unlink(path)


def allocate(shape: tuple[int, ...], dtype: Any) -> tuple[dict[str, Any], Any]:
    """Worker side: a CPU tensor to fill, and the small picklable dict that will carry it.

    Fill the tensor completely before sending the dict (it is the shared file, or the inline copy).
    """
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > INLINE_LIMIT and _shm_has_room(nbytes):
        try:
            path, flat = _new_file(".states", math.prod(shape), dtype)
            return {"file": path, "shape": list(shape), "dtype": _dtype_name(dtype)}, flat.view(shape)
        except OSError as exc:
            if not _no_room(exc):
                raise
    buf = torch.empty(shape, dtype=dtype)
    return {"inline": buf}, buf


def discard(desc: dict[str, Any]) -> None:
    """Worker side: drop an allocation that will not be sent (an error while filling it)."""
    if "file" in desc and not desc.get("staging"):
        try:
            os.unlink(desc["file"])
        except FileNotFoundError:
            pass


def pack(layers: list[Any]) -> dict[str, Any]:
    """Worker side: ``layers`` (same shape [tokens, hidden], any device) -> a small picklable dict."""
    first = layers[0]
    desc, buf = allocate((len(layers), *first.shape), first.dtype)
    try:
        for i, t in enumerate(layers):
            buf[i].copy_(t)  # device -> shared pages, one copy
    except BaseException:
        discard(desc)
        raise
    return desc


class _Buffer:
    """One staging file of a worker: its path (until the driver maps it), id and uint8 view."""

    def __init__(self, capacity: int) -> None:
        import torch

        self.path, self.flat = _new_file(".staging", capacity, torch.uint8)
        self.capacity = capacity
        self.id = uuid.uuid4().hex
        self.pinned: bool | None = None  # None: not tried

    def pin(self) -> bool:
        import torch

        if self.pinned is None:
            self.pinned = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.capacity, 0) == 0
            if not self.pinned:
                logger.warning("speccompat: could not pin the %d MB staging file for CUDA copies; "
                               "copies will be slower", self.capacity >> 20)
        return self.pinned

    def release(self) -> None:
        if self.pinned:
            import torch

            try:
                torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            except Exception:  # noqa: BLE001, S110 - at exit CUDA may be gone already
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # the driver removed it on its first mapping
            pass
        self.flat, self.pinned = None, None


class _Build:
    """A staging file being made (and pinned, for CUDA copies) on a thread of its own: making a
    multi-GB file and registering it with CUDA takes seconds, which the engine's steps can overlap
    (``posix_fallocate`` and ``cudaHostRegister`` release the GIL)."""

    def __init__(self, capacity: int, device: Any) -> None:
        self.capacity = capacity
        self.buffer: _Buffer | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(device,), name="speccompat-staging", daemon=True)
        self.thread.start()

    def _run(self, device: Any) -> None:
        t0 = time.perf_counter()
        try:
            buf = _Buffer(self.capacity)
            if getattr(device, "type", device) == "cuda":
                import torch

                with torch.cuda.device(device):  # registered for this worker's device, not the thread's default
                    buf.pin()
            self.buffer = buf
        except BaseException as exc:  # noqa: BLE001 - handed to the caller that installs the build
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join()


class Staging:
    """Worker side: reusable shared-memory files, pinned for CUDA copies when states come from a GPU.

    ``allocate`` returns the reply dict and a tensor view of a file to fill (with
    ``copy_(..., non_blocking=True)`` from a GPU: call :meth:`ready` before replying). A file is
    reused for the next reply unless the driver says it is ``busy`` (it handed out views of it that
    are still alive); then another file is used, made when none is free. A file that is too small is
    replaced by a larger one. Files are removed by the driver's first mapping, or at exit.

    :meth:`try_allocate` does not wait: where no free file fits it starts making one on a thread
    (:class:`_Build`) and returns None; the caller keeps its rows and asks again later (the capture
    places a call's steps once the file is there), and :meth:`allocate` waits for a build that fits
    instead of making another file. So a call that outgrows every file pays for the new one only
    where the engine's steps did not cover it.
    """

    def __init__(self) -> None:
        self.buffers: list[_Buffer] = []
        self.last: _Buffer | None = None
        self.cuda = False
        self.build: _Build | None = None  # the file being made on a thread (one at a time)
        #: Files made (and pinned) since :meth:`take_made` was last called, and the seconds callers
        #: waited for them: a new multi-GB pinned file costs seconds on a GPU host, so the call stats
        #: report it; ``built_s``: the seconds files took on the build thread (overlapping the steps).
        self.made, self.made_s, self.built_s = 0, 0.0, 0.0
        atexit.register(self.release)

    def take_made(self) -> tuple[int, float]:
        """(files made, seconds spent waiting for them to be made and pinned) since the last call;
        resets both (and ``built_s``, read before: :meth:`take_built`)."""
        out, self.made, self.made_s, self.built_s = (self.made, self.made_s), 0, 0.0, 0.0
        return out

    def take_built(self) -> float:
        """Seconds spent making files on the build thread since the last :meth:`take_made`."""
        return self.built_s

    # the file of the last reply (tests and logs)
    path = property(lambda self: self.last.path if self.last else None)
    pinned = property(lambda self: self.last.pinned if self.last else None)
    capacity = property(lambda self: self.last.capacity if self.last else 0)

    def _install(self, busy: set[str]) -> bool:
        """Take a finished build into the pool, in place of the largest free file smaller than it
        (its pages go back). A build that failed for want of room is dropped and answers False (the
        reply then travels inline); any other failure is raised."""
        build, self.build = self.build, None
        if build is None:
            return True
        self.built_s += build.seconds
        if build.error is not None:
            if isinstance(build.error, OSError) and _no_room(build.error):
                return False
            raise build.error
        smaller = [b for b in self.buffers if b.id not in busy and b.capacity < build.capacity]
        if smaller:
            old = max(smaller, key=lambda b: b.capacity)
            self.buffers.remove(old)
            old.release()
        self.buffers.append(build.buffer)
        self.made += 1
        return True

    def _grown(self, nbytes: int, free: list[_Buffer]) -> int:
        return -(-max([nbytes] + [b.capacity + b.capacity // 4 for b in free]) // _ROUND) * _ROUND

    def _view(self, chosen: _Buffer, shape: tuple[int, ...], dtype: Any, nbytes: int) -> tuple[dict[str, Any], Any]:
        self.last = chosen
        buf = chosen.flat[:nbytes].view(dtype).view(shape)
        desc = {"file": chosen.path, "staging": chosen.id, "owner": os.getpid(), "capacity": chosen.capacity,
                "pool": [b.id for b in self.buffers], "shape": list(shape), "dtype": _dtype_name(dtype)}
        return desc, buf

    def try_allocate(self, shape: tuple[int, ...], dtype: Any, device: Any = None,
                     busy: Any = ()) -> tuple[dict[str, Any], Any] | None:
        """As :meth:`allocate`, without waiting for a file to be made: None while one that fits is
        being made (started here where needed). Inline replies are answered at once."""
        import torch

        self.cuda = getattr(device, "type", device) == "cuda"
        nbytes = math.prod(shape) * dtype.itemsize
        busy = set(busy)
        room = self._install(busy) if self.build is not None and self.build.done() else True
        free = [b for b in self.buffers if b.id not in busy]
        fits = [b for b in free if b.capacity >= nbytes]
        if nbytes <= INLINE_LIMIT or (not fits and not (room and _shm_has_room(nbytes))):
            buf = torch.empty(shape, dtype=dtype)
            return {"inline": buf}, buf
        if not fits:
            if self.build is None or self.build.capacity < nbytes:
                if self.build is not None:  # too small for this reply: let it finish, then make the larger one
                    self.build.join()
                    self._install(busy)
                    free = [b for b in self.buffers if b.id not in busy]
                self.build = _Build(self._grown(nbytes, free), device)
            return None
        chosen = min(fits, key=lambda b: b.capacity)
        if self.cuda and chosen.pinned is None:
            t0 = time.perf_counter()
            chosen.pin()
            self.made_s += time.perf_counter() - t0
        return self._view(chosen, shape, dtype, nbytes)

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: Any = None,
                 busy: Any = ()) -> tuple[dict[str, Any], Any]:
        import torch

        self.cuda = getattr(device, "type", device) == "cuda"
        nbytes = math.prod(shape) * dtype.itemsize
        busy = set(busy)
        if self.build is not None and (self.build.done() or self.build.capacity >= nbytes):
            t0 = time.perf_counter()
            self.build.join()  # a file that fits is on its way: wait for it rather than make another
            self.made_s += time.perf_counter() - t0
            room = self._install(busy)
        else:
            room = True
        free = [b for b in self.buffers if b.id not in busy]
        fits = [b for b in free if b.capacity >= nbytes]
        if nbytes <= INLINE_LIMIT or (not fits and not (room and _shm_has_room(nbytes))):
            buf = torch.empty(shape, dtype=dtype)
            return {"inline": buf}, buf
        t0, made = time.perf_counter(), not fits
        if fits:
            chosen = min(fits, key=lambda b: b.capacity)
        else:
            # Replace the largest free file that is too small (its pages go back), else add one.
            grown = self._grown(nbytes, free)
            if free:
                old = max(free, key=lambda b: b.capacity)
                self.buffers.remove(old)
                old.release()
            try:
                chosen = _Buffer(grown)
            except OSError as exc:
                if not _no_room(exc):
                    raise
                buf = torch.empty(shape, dtype=dtype)
                return {"inline": buf}, buf
            self.buffers.append(chosen)
            self.made += 1
        if self.cuda:
            made = made or chosen.pinned is None  # registering a file with CUDA costs about as much
            chosen.pin()
        if made:
            self.made_s += time.perf_counter() - t0
        return self._view(chosen, shape, dtype, nbytes)

    def ready(self) -> None:
        """Wait for the asynchronous device copies into the buffer."""
        if self.cuda:
            import torch

            torch.cuda.current_stream().synchronize()

    def release(self) -> None:
        if self.build is not None:
            self.build.join()
            if self.build.buffer is not None:
                self.buffers.append(self.build.buffer)
            self.build = None
        for b in self.buffers:
            b.release()
        self.buffers, self.last = [], None


#: Driver side: the mappings of each worker's staging files, by owner pid, then staging id:
#: (uint8 view of the whole file, the storage use count of the mapping alone).
_MAPPED: dict[int, dict[str, tuple[Any, int]]] = {}


def _use_count(flat: Any) -> int:
    import torch

    return torch._C._storage_Use_Count(flat.untyped_storage()._cdata)


def unpack(desc: dict[str, Any]) -> Any:
    """Driver side: the packed states as one tensor [layers, tokens, hidden].

    A per-reply file is removed at once. A staging file is removed on its first mapping and the
    mapping kept: the returned tensor is a view of it, valid until the worker reuses that file,
    which it does only once :func:`busy` no longer lists it (every view of it was dropped).
    """
    import torch

    if "inline" in desc:
        return desc["inline"]
    dtype = getattr(torch, desc["dtype"])
    shape = desc["shape"]
    if not desc.get("staging"):
        return _map_and_unlink(desc["file"], math.prod(shape), dtype).view(shape)
    owner, sid = desc["owner"], desc["staging"]
    maps = _MAPPED.setdefault(owner, {})
    for gone in [k for k in maps if k not in desc.get("pool", (sid,))]:
        del maps[gone]  # the worker replaced that file; live views keep their pages
    if sid not in maps:
        flat = _map_and_unlink(desc["file"], desc["capacity"], torch.uint8)
        maps[sid] = (flat, _use_count(flat))
    return maps[sid][0][: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def busy() -> list[str]:
    """Driver side: the staging files whose views handed out by :func:`unpack` are still alive
    (a worker must not overwrite them)."""
    return [sid for maps in _MAPPED.values() for sid, (flat, alone) in maps.items() if _use_count(flat) > alone]
