"""speccompat: keep speculators 0.3/0.4 hidden-state extraction working on every vLLM release.

    import speccompat
    speccompat.apply()          # before importing speculators (see apply() for "after")
    from speculators.data_generation import VllmHiddenStatesGenerator

``apply()`` detects the installed vLLM and speculators, selects a versioned adapter, and patches the
names speculators imported from vLLM (never vLLM itself), in this process and in vLLM's worker
processes. ``status()`` says what it did, ``revert()`` undoes it; ``speccompat doctor`` prints it all.

Importing this package is cheap: it imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = [
    "DriftError",
    "HiddenStatesError",
    "PatchError",
    "SpeccompatError",
    "UnsupportedError",
    "WorkerPatchError",
    "__version__",
    "apply",
    "revert",
    "status",
]

if TYPE_CHECKING:  # pragma: no cover
    from .api import apply, revert, status
    from .errors import (
        DriftError,
        HiddenStatesError,
        PatchError,
        SpeccompatError,
        UnsupportedError,
        WorkerPatchError,
    )

_LAZY = {
    "apply": "api",
    "revert": "api",
    "status": "api",
    "DriftError": "errors",
    "HiddenStatesError": "errors",
    "PatchError": "errors",
    "SpeccompatError": "errors",
    "UnsupportedError": "errors",
    "WorkerPatchError": "errors",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'speccompat' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"speccompat.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
