"""Device memory queries that work on every vLLM platform speculators may meet (CUDA and CPU).

speculators sizes the KV cache from ``mem_get_info()`` of the accelerator; on vLLM's CPU backend
there is none (``torch.cuda.mem_get_info`` raises "Found no NVIDIA driver", and speculators 0.4's
``mem_get_info`` returns ``(0, 0)``, leaving no room for a single KV block). The KV cache then
lives in host memory, so host memory is the right figure there.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["device_kind", "empty_cache", "mem_get_info"]


def device_kind() -> str:
    """``"cpu"`` or ``"cuda"`` (or vLLM's device type name) for the running vLLM platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_type", "cuda") or "cuda")


def _host_memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the memory the KV cache will live in."""
    if device_kind() == "cpu":
        return _host_memory()
    import torch

    return torch.cuda.mem_get_info()


def empty_cache() -> None:
    if device_kind() == "cpu":
        return
    import torch

    torch.cuda.empty_cache()


class _CudaView:
    """``torch.cuda`` as speculators 0.3.0 uses it, answered for the running platform."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return mem_get_info()

    @staticmethod
    def empty_cache() -> None:
        empty_cache()


def torch_view(torch_module: Any) -> Any:
    """A proxy of the ``torch`` module whose ``cuda.mem_get_info``/``empty_cache`` follow the platform."""
    import wrapt

    class TorchView(wrapt.ObjectProxy):
        @property
        def cuda(self) -> Any:  # noqa: D401
            return _CudaView(self.__wrapped__.cuda)

    return TorchView(torch_module)
