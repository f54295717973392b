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

__all__ = ["INLINE_LIMIT", "pack", "unpack"]

#: Replies up to this many bytes are pickled inline (no file).
INLINE_LIMIT = 4 << 20
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _shm_has_room(nbytes: int) -> bool:
    if _SHM is None:
        return False
    st = os.statvfs(_SHM)
    return st.f_bavail * st.f_frsize > 2 * nbytes + (256 << 20)


def pack(layers: list[Any]) -> dict[str, Any]:
    """Worker side: ``layers`` (same shape [tokens, hidden], any device) -> a small picklable dict."""
    import torch

    first = layers[0]
    shape = (len(layers), *first.shape)
    nbytes = first.element_size() * first.numel() * len(layers)
    if nbytes <= INLINE_LIMIT or not _shm_has_room(nbytes):
        return {"inline": torch.stack([t.cpu() for t in layers])}
    fd, path = tempfile.mkstemp(prefix="speccompat-", suffix=".states", dir=_SHM)
    os.close(fd)
    try:
        numel = first.numel() * len(layers)
        buf = torch.from_file(path, shared=True, size=numel, dtype=first.dtype).view(shape)
        for i, t in enumerate(layers):
            buf[i].copy_(t)  # device -> shared pages, one copy
        del buf
    except BaseException:
        os.unlink(path)
        raise
    return {"file": path, "shape": list(shape), "dtype": str(first.dtype).removeprefix("torch.")}


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
