"""Moving captured hidden states from a worker process to the driver without pickling them.

``collective_rpc`` pickles its reply and pushes it through vLLM's message queue: for hidden states
that is several copies of every byte (layers x tokens x hidden x 2 bytes: 29 MB for 4 layers of 512
Kimi-K2.5 tokens, gigabytes per batch). Instead the worker writes the packed states once, straight
from the device, into a file in shared memory (``/dev/shm``) and replies with its name; the driver
maps the file, unlinks it at once (the mapping stays valid) and copies each sequence out.
Small replies travel inline, and so does any reply that would not fit in ``/dev/shm`` with room
to spare (containers often mount a small one; a full tmpfs kills the writer with SIGBUS).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

__all__ = ["INLINE_LIMIT", "allocate", "discard", "pack", "unpack"]

#: Replies up to this many bytes are pickled inline (no file).
INLINE_LIMIT = 4 << 20
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _shm_has_room(nbytes: int) -> bool:
    if _SHM is None:
        return False
    st = os.statvfs(_SHM)
    return st.f_bavail * st.f_frsize > 2 * nbytes + (256 << 20)


def allocate(shape: tuple[int, ...], dtype: Any) -> tuple[dict[str, Any], Any]:
    """Worker side: a CPU tensor to fill, and the small picklable dict that will carry it.

    Fill the tensor completely before sending the dict (it is the shared file, or the inline copy).
    """
    import torch

    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes <= INLINE_LIMIT or not _shm_has_room(nbytes):
        buf = torch.empty(shape, dtype=dtype)
        return {"inline": buf}, buf
    fd, path = tempfile.mkstemp(prefix="speccompat-", suffix=".states", dir=_SHM)
    os.close(fd)
    try:
        buf = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        os.unlink(path)
        raise
    return {"file": path, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}, buf


def discard(desc: dict[str, Any]) -> None:
    """Worker side: drop an allocation that will not be sent (an error while filling it)."""
    if "file" in desc:
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


def unpack(desc: dict[str, Any]) -> Any:
    """Driver side: the packed states as one tensor [layers, tokens, hidden] (file removed)."""
    import torch

    if "inline" in desc:
        return desc["inline"]
    path = desc["file"]
    try:
        numel = 1
        for d in desc["shape"]:
            numel *= d
        return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, desc["dtype"])).view(desc["shape"])
    finally:
        os.unlink(path)  # the mapping outlives the name
