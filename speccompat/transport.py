"""Moving captured hidden states from a worker process to the driver without pickling them.

``collective_rpc`` pickles its reply and pushes it through vLLM's message queue: for hidden states
that is several copies of every byte (layers x tokens x hidden x 2 bytes: 29 MB for 4 layers of 512
Kimi-K2.5 tokens, gigabytes per batch). Instead the worker writes the packed states once, straight
from the device, into a file in shared memory (``/dev/shm``) and replies with its name; the driver
maps the file, unlinks it at once (the mapping stays valid) and copies each sequence out.

Two kinds of file:

* :func:`allocate` / :func:`pack`: a new file per reply (the driver's mapping is the only one left
  once it has unlinked it).
* :class:`Staging`: the worker keeps one file per process and reuses it for every reply, grown when
  a batch needs more. Fresh shared pages are slow to write (a page fault per 4 KiB, and a GPU can
  only copy into them through a bounce buffer: 1.3 GB/s measured on an H200 host); reused pages are
  already there, and when the states come from a GPU the file is registered with CUDA once (pinned),
  so each reply is one DMA copy (55 GB/s measured). The driver keeps its mapping of the file, so a
  reply's tensor is only valid until the next reply of the same worker: copy out what you keep.

Small replies travel inline, and so does any reply that would not fit in ``/dev/shm`` with room
to spare (containers often mount a small one; a full tmpfs kills the writer with SIGBUS).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import tempfile
import uuid
from typing import Any

__all__ = ["INLINE_LIMIT", "Staging", "allocate", "discard", "pack", "unpack"]

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
    os.close(fd)
    try:
        return path, torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except BaseException:
        os.unlink(path)
        raise


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
    if nbytes <= INLINE_LIMIT or not _shm_has_room(nbytes):
        buf = torch.empty(shape, dtype=dtype)
        return {"inline": buf}, buf
    path, flat = _new_file(".states", math.prod(shape), dtype)
    return {"file": path, "shape": list(shape), "dtype": _dtype_name(dtype)}, flat.view(shape)


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


class Staging:
    """Worker side: one reusable shared-memory file, pinned for CUDA copies when states come from a GPU.

    ``allocate`` returns the reply dict and a tensor view of the file to fill (with
    ``copy_(..., non_blocking=True)`` from a GPU: call :meth:`ready` before replying). The file
    grows when a batch needs more and is removed by the driver's first mapping, or at exit.
    """

    def __init__(self) -> None:
        self.path: str | None = None
        self.id = ""
        self.flat: Any = None  # uint8 view of the whole file
        self.capacity = 0
        self.pinned: bool | None = None  # None: not tried for this file
        self.cuda = False
        atexit.register(self.release)

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: Any = None) -> tuple[dict[str, Any], Any]:
        import torch

        self.cuda = getattr(device, "type", device) == "cuda"
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= INLINE_LIMIT or (nbytes > self.capacity and not _shm_has_room(nbytes)):
            buf = torch.empty(shape, dtype=dtype)
            return {"inline": buf}, buf
        if nbytes > self.capacity:
            self._grow(nbytes)
        if self.cuda and self.pinned is None:
            self._pin()
        buf = self.flat[:nbytes].view(dtype).view(shape)
        desc = {"file": self.path, "staging": self.id, "owner": os.getpid(), "capacity": self.capacity,
                "shape": list(shape), "dtype": _dtype_name(dtype)}
        return desc, buf

    def ready(self) -> None:
        """Wait for the asynchronous device copies into the buffer."""
        if self.cuda:
            import torch

            torch.cuda.current_stream().synchronize()

    def _grow(self, nbytes: int) -> None:
        import torch

        capacity = max(nbytes, self.capacity + self.capacity // 4)
        capacity = -(-capacity // _ROUND) * _ROUND
        self.release()
        path, flat = _new_file(".staging", capacity, torch.uint8)
        self.path, self.flat, self.capacity, self.id = path, flat, capacity, uuid.uuid4().hex

    def _pin(self) -> None:
        import torch

        self.pinned = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.capacity, 0) == 0
        if not self.pinned:
            logger.warning("speccompat: could not pin the %d MB staging file for CUDA copies; "
                           "copies will be slower", self.capacity >> 20)

    def release(self) -> None:
        if self.flat is not None and self.pinned:
            import torch

            try:
                torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            except Exception:  # noqa: BLE001, S110 - at exit CUDA may be gone already
                pass
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # the driver removed it on its first mapping
                pass
        self.path, self.flat, self.capacity, self.pinned, self.id = None, None, 0, None, ""


#: Driver side: the mapping of each worker's staging file, by owner pid: (staging id, uint8 view).
_MAPPED: dict[int, tuple[str, Any]] = {}


def unpack(desc: dict[str, Any]) -> Any:
    """Driver side: the packed states as one tensor [layers, tokens, hidden].

    A per-reply file is removed at once. A staging file is removed on its first mapping and the
    mapping kept: the returned tensor then stays valid only until the next reply of that worker.
    """
    import torch

    if "inline" in desc:
        return desc["inline"]
    dtype = getattr(torch, desc["dtype"])
    shape = desc["shape"]
    if not desc.get("staging"):
        return _map_and_unlink(desc["file"], math.prod(shape), dtype).view(shape)
    owner, sid = desc["owner"], desc["staging"]
    known = _MAPPED.get(owner)
    if known is None or known[0] != sid:
        _MAPPED.pop(owner, None)  # the worker grew its file: drop the old mapping
        known = _MAPPED[owner] = (sid, _map_and_unlink(desc["file"], desc["capacity"], torch.uint8))
    return known[1][: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
