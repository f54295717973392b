"""Exceptions raised by speccompat. Every message names what was expected and what was found."""

from __future__ import annotations

__all__ = [
    "DriftError",
    "HiddenStatesError",
    "KVCacheTooSmall",
    "PatchError",
    "SpeccompatError",
    "UnsupportedError",
    "WorkerPatchError",
]


class SpeccompatError(RuntimeError):
    """Base class of every speccompat error."""


class UnsupportedError(SpeccompatError):
    """The installed (speculators, vLLM) combination has no adapter or no compat_matrix row."""


class DriftError(SpeccompatError):
    """A vLLM symbol that the selected adapter relies on does not look the way it expects.

    ``symbol`` is the dotted path (``module:Qualified.name``); ``problem`` says what differs.
    """

    def __init__(self, message: str, *, symbol: str = "", problem: str = "") -> None:
        super().__init__(message)
        self.symbol = symbol
        self.problem = problem


class PatchError(SpeccompatError):
    """A patch could not be applied; everything applied in the same step was rolled back."""


class WorkerPatchError(SpeccompatError):
    """vLLM's worker processes run without speccompat's patches (or with a different adapter)."""


class HiddenStatesError(SpeccompatError):
    """Captured hidden states failed validation (count, order, shape or finiteness)."""


class KVCacheTooSmall(HiddenStatesError):
    """The engine's KV cache cannot hold the sequences of a call: a setting of the engine, not a
    transient failure (the same command fails the same way). ``longest`` is the longest sequence
    (tokens) the call could not schedule."""

    def __init__(self, message: str, *, longest: int = 0) -> None:
        super().__init__(message)
        self.longest = longest
