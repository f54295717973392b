"""Where ``speccompat serve`` puts a request's hidden states, and what the response points to: exactly
what hs-connectors 0.9's transfers (``hs_connectors/transfer.py``, ``mooncake_store.py``) read.

- ``file``: ``<dir>/<handle>.safetensors`` with ``hidden_states`` ``[n, layers, hidden]`` (the
  engine's dtype, the model's) and ``token_ids`` ``[n]`` int64, no metadata: what vLLM's
  ``ExampleHiddenStatesConnector`` writes (``_write_tensors``: ``save_file``). Written under a
  temporary name and renamed, so a reader never sees a partial file (vLLM's connector uses a
  ``.lock`` file for that; hs-connectors' ``FileTransfer`` and speculators' offline generation wait
  for one only where it exists). Response: ``{"hidden_states_path": <absolute path>}``.
- ``fp8``: the same file with ``hidden_states`` float8_e4m3fn and ``hidden_states_scales`` float32
  ``[n, 1, 1]`` (one scale per token over all layers, hs-connectors' ``FP8HiddenStatesConnector``
  schema; the rule is ``speccompat.dataset.fp8``'s, which ``FP8Transfer`` dequantizes unchanged).
- ``mooncake``: one raw object per request in a Mooncake store, the tensors' bytes packed at
  64-byte-aligned offsets; the response is the versioned transfer manifest hs-connectors'
  ``MooncakeHiddenStatesConnector.request_finished`` returns (``handle``, ``version`` 1, per tensor
  ``shape``, ``dtype``, ``nbytes``, ``offset``; ``metadata.num_tokens``, ``total_aligned_bytes``,
  ``extract_mode``), which ``MooncakeHiddenStatesStore.get_sample`` checks (version, sizes, bounds).
  The put goes through Mooncake's own client (``MooncakeDistributedStore.put_from`` from a
  registered staging buffer, as hs-connectors' store does); it is complete before the response.

Every sample is checked before it is stored (layer count, shapes, finite values); the token ids
stored are the request's, which the engine verified against what it computed. :class:`Handles`
tracks what was stored and not yet claimed: a handle the client deleted (hs-connectors'
``delete``: the file unlinked, or the object removed) is forgotten; one older than the TTL is
removed; while more than ``max_bytes`` are unclaimed new requests are refused (503, retry later).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["BACKENDS", "Backend", "BackendUnavailable", "FileBackend", "FP8Backend", "Handles", "MooncakeBackend",
           "check_states", "packed_layout", "stacked"]

logger = logging.getLogger("speccompat.serve")

BACKENDS = ("file", "fp8", "mooncake")
#: hs-connectors' transfer manifest version (mooncake_store.VERSION) and tensor alignment
MANIFEST_VERSION = 1
ALIGN = 64
#: hs-connectors' status for "object not found" (mooncake_store._OBJECT_NOT_FOUND)
OBJECT_NOT_FOUND = -704
#: handles are named ``<PREFIX><server>-<n>``; a file backend's stale files of this name are removed
PREFIX = "speccompat-"


class BackendUnavailable(Exception):
    """The backend cannot be used with these settings (a refusal before the engine starts)."""


def check_states(states: list[Any], n: int, layers: int, hidden: int) -> None:
    """Raise ``ValueError`` unless ``states`` are ``layers`` finite ``[n, hidden]`` float tensors."""
    import torch

    if len(states) != layers:
        raise ValueError(f"{len(states)} layers of hidden states, expected {layers}")
    for k, h in enumerate(states):
        if tuple(h.shape) != (n, hidden) or not h.is_floating_point():
            raise ValueError(f"layer position {k}: {h.dtype} {tuple(h.shape)}, expected floats of shape {(n, hidden)}")
        lo, hi = torch.aminmax(h)  # NaN propagates; either infinity shows
        if not bool(torch.isfinite(torch.stack((lo, hi))).all()):
            raise ValueError(f"layer position {k}: non-finite hidden states")


def stacked(states: list[Any]) -> Any:
    """``[n, layers, hidden]``, layers in stored order (hs-connectors' ``hidden_states``)."""
    import torch

    return torch.stack(states, dim=1)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def packed_layout(tensors: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """hs-connectors' ``packed_layout``: each tensor's ``shape``, ``dtype`` (``str(torch dtype)``),
    ``nbytes`` and byte ``offset`` (64-aligned) in the object, and the object's size."""
    specs: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = math.prod(t.shape) * t.element_size()
        specs[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "nbytes": nbytes, "offset": offset}
        offset = _align(offset + nbytes)
    return specs, offset


class Backend:
    """One way to publish states. ``put`` returns ``(kv_transfer_params, bytes stored)``."""

    name = ""

    def setup(self) -> None:
        """Connect or prepare; raises :class:`BackendUnavailable` naming the problem."""

    def put(self, handle: str, token_ids: Any, states: list[Any]) -> tuple[dict[str, Any], int]:
        raise NotImplementedError

    def claimed(self, handles: list[str]) -> list[bool]:
        """Whether each handle is gone (the client deleted or moved it)."""
        raise NotImplementedError

    def remove(self, handle: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what setup took."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}


class FileBackend(Backend):
    """``<dir>/<handle>.safetensors`` as vLLM's ``ExampleHiddenStatesConnector`` writes it."""

    name = "file"

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory).absolute()

    def setup(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendUnavailable(f"--hidden-states-dir {self.dir}: cannot create it: {exc.strerror}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise BackendUnavailable(f"--hidden-states-dir {self.dir}: not writable")

    def path(self, handle: str) -> Path:
        return self.dir / f"{handle}.safetensors"

    def tensors(self, token_ids: Any, states: list[Any]) -> dict[str, Any]:
        return {"hidden_states": stacked(states), "token_ids": token_ids}

    def put(self, handle: str, token_ids: Any, states: list[Any]) -> tuple[dict[str, Any], int]:
        from safetensors.torch import save_file

        final = self.path(handle)
        tmp = self.dir / f".{handle}.safetensors.partial"
        try:
            save_file(self.tensors(token_ids, states), str(tmp))
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return {"hidden_states_path": str(final)}, final.stat().st_size

    def claimed(self, handles: list[str]) -> list[bool]:
        return [not self.path(h).exists() for h in handles]

    def remove(self, handle: str) -> None:
        for p in (self.path(handle), Path(f"{self.path(handle)}.lock")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def remove_stale(self, older_than_s: float) -> int:
        """Remove this server's kind of files (``speccompat-*``) older than ``older_than_s``: what a
        killed server left (their TTL is over)."""
        now, count = time.time(), 0
        for p in self.dir.iterdir():
            name = p.name.lstrip(".")
            if name.startswith(PREFIX) and name.endswith((".safetensors", ".safetensors.partial")):
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > older_than_s:
                        p.unlink()
                        count += 1
        return count

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "hidden_states_dir": str(self.dir)}


class FP8Backend(FileBackend):
    """The file backend with hs-connectors' fp8 schema (``FP8HiddenStatesConnector``)."""

    name = "fp8"

    def tensors(self, token_ids: Any, states: list[Any]) -> dict[str, Any]:
        from speccompat.dataset import fp8
        from speccompat.dataset.spec import DEFAULT_GRANULARITY

        values, scales = fp8.quantize(states, DEFAULT_GRANULARITY, stack=True)
        return {"hidden_states": values, fp8.SCALES: scales, "token_ids": token_ids}


class MooncakeBackend(Backend):
    """One packed object per request in a Mooncake store (hs-connectors' ``MooncakeHiddenStatesStore``
    layout), through Mooncake's own client."""

    name = "mooncake"

    def __init__(self, *, master: str, metadata_server: str, local_hostname: str, protocol: str = "tcp",
                 device: str = "", global_segment_bytes: int = 4 << 30, local_buffer_bytes: int = 2 << 30) -> None:
        self.master, self.metadata_server, self.local_hostname = master, metadata_server, local_hostname
        self.protocol, self.device = protocol, device
        self.global_segment_bytes, self.local_buffer_bytes = global_segment_bytes, local_buffer_bytes
        self.store: Any = None
        self._staging = threading.local()
        self._buffers: list[Any] = []

    def setup(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise BackendUnavailable(f"--backend mooncake needs Mooncake's client: pip install "
                                     f"mooncake-transfer-engine-non-cuda (or the CUDA build) ({exc})") from None
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_hostname, self.metadata_server, self.global_segment_bytes,
                         self.local_buffer_bytes, self.protocol, self.device, self.master)
        if rc != 0:
            raise BackendUnavailable(f"cannot join the Mooncake store: master {self.master}, metadata server "
                                     f"{self.metadata_server} (setup returned {rc}; is mooncake_master running?)")
        self.store = store

    def _buffer(self, nbytes: int) -> Any:
        """This thread's staging buffer, registered with Mooncake (grown in 64 MiB steps)."""
        import torch

        buf = getattr(self._staging, "buffer", None)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if buf is not None:
            self.store.unregister_buffer(buf.data_ptr())
        size = -(-max(nbytes, 1) // (64 << 20)) * (64 << 20)
        buf = torch.empty(size, dtype=torch.uint8)
        rc = self.store.register_buffer(buf.data_ptr(), size)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer of {size} bytes returned {rc}")
        self._staging.buffer = buf
        self._buffers.append(buf)
        return buf

    def put(self, handle: str, token_ids: Any, states: list[Any]) -> tuple[dict[str, Any], int]:
        tensors = {"hidden_states": stacked(states), "token_ids": token_ids}
        specs, total = packed_layout(tensors)
        manifest = {"handle": handle, "version": MANIFEST_VERSION, "tensors": specs,
                    "metadata": {"num_tokens": int(token_ids.numel()), "total_aligned_bytes": total,
                                 "extract_mode": "prompt_only"}}
        buf = self._buffer(total)
        for name, spec in specs.items():
            t = tensors[name]
            buf[spec["offset"]:spec["offset"] + spec["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
        rc = self.store.put_from(handle, buf.data_ptr(), total)
        if rc != 0:
            raise RuntimeError(f"Mooncake put_from of {total} bytes returned {rc} (is the store full? "
                               "--mooncake-global-segment-gib)")
        return manifest, total

    def claimed(self, handles: list[str]) -> list[bool]:
        if not handles:
            return []
        found = self.store.batch_is_exist(list(handles))
        return [f == 0 for f in found]

    def remove(self, handle: str) -> None:
        for key in (handle, handle + ":error"):
            rc = self.store.remove(key, force=True)
            if rc not in (0, OBJECT_NOT_FOUND):
                logger.warning("Mooncake remove %s returned %s", key, rc)

    def close(self) -> None:
        if self.store is not None:
            for buf in self._buffers:
                with contextlib.suppress(Exception):
                    self.store.unregister_buffer(buf.data_ptr())
            with contextlib.suppress(Exception):
                self.store.close()
            self.store = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "mooncake_master": self.master, "mooncake_metadata_server": self.metadata_server}


class Handles:
    """What was stored and not yet claimed: claimed handles are forgotten, expired ones removed."""

    def __init__(self, backend: Backend, ttl_s: float, max_bytes: int) -> None:
        self.backend, self.ttl_s, self.max_bytes = backend, ttl_s, max_bytes
        self.items: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        self.bytes = 0
        self.claimed = self.expired = 0
        self._lock = threading.Lock()

    def add(self, handle: str, nbytes: int) -> None:
        with self._lock:
            self.items[handle] = (time.monotonic(), nbytes)
            self.bytes += nbytes

    def full(self) -> bool:
        return self.bytes > self.max_bytes

    def _drop(self, handle: str) -> None:
        _, nbytes = self.items.pop(handle)
        self.bytes -= nbytes

    def sweep(self, *, expire_all: bool = False) -> None:
        """Forget the claimed handles; remove those past the TTL (all of them with ``expire_all``)."""
        with self._lock:
            names = list(self.items)
        if not names:
            return
        gone = self.backend.claimed(names)
        now = time.monotonic()
        with self._lock:
            for name, was_claimed in zip(names, gone, strict=True):
                if name not in self.items:
                    continue
                if was_claimed:
                    self._drop(name)
                    self.claimed += 1
                elif expire_all or now - self.items[name][0] > self.ttl_s:
                    self._drop(name)
                    self.expired += 1
                    try:
                        self.backend.remove(name)
                    except Exception as exc:  # noqa: BLE001 - logged; the next sweep does not see it again
                        logger.warning("could not remove expired hidden states %s: %s", name, exc)

    def stats(self) -> dict[str, Any]:
        return {"unclaimed": len(self.items), "unclaimed_bytes": self.bytes, "claimed": self.claimed,
                "expired": self.expired}
