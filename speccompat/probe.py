"""Signature probes: does this vLLM have the symbols an adapter relies on, shaped as it expects?

An adapter declares its *fingerprint*: a set of :class:`Symbol` requirements (``accepts`` these
parameters, ``rejects`` those, or must be ``absent``). The same requirements are checked two ways:

- **live** (:func:`check_live`): import the module and ``inspect`` the object. Used by ``apply()``
  (when speculators imports vLLM, never earlier) and by ``speccompat doctor``.
- **static** (:func:`speccompat.static_probe.check_static`): parse the sources of a vLLM release
  with ``ast`` without importing it, following re-exports and base classes. Used by
  ``scripts/static_check.py`` and the test suite over every release; it builds on this module
  (never the other way round) and is not loaded by the runtime package.

Both return a list of :class:`Mismatch` (empty when the fingerprint matches).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["Mismatch", "Symbol", "check_live", "fingerprint", "judge"]


class Symbol(NamedTuple):
    """A requirement on one vLLM symbol.

    ``path`` is ``"module:Name"`` or ``"module:Class.attr"``. For a class, the parameters are its
    constructor's (``__init__`` or dataclass fields); for a function or method, its own.
    Parameter checks look at names only; ``**kwargs`` does not count as accepting a name.

    ``new`` marks a symbol that first appears in the release range of the adapter declaring it:
    the registry then requires it to be *absent* from the previous range (see
    :func:`speccompat.registry.fingerprint`), so neighbouring adapters tell each other apart
    without the older one naming what came after it.
    """

    path: str
    accepts: tuple[str, ...] = ()
    rejects: tuple[str, ...] = ()
    absent: bool = False
    why: str = ""
    new: bool = False

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":", 1)[1]

    def describe(self) -> str:
        if self.absent:
            return f"{self.path} must not exist"
        parts = []
        if self.accepts:
            parts.append("accepts " + ", ".join(self.accepts))
        if self.rejects:
            parts.append("does not accept " + ", ".join(self.rejects))
        return f"{self.path}" + (f" ({'; '.join(parts)})" if parts else " exists")


class Mismatch(NamedTuple):
    symbol: Symbol
    problem: str

    def __str__(self) -> str:
        why = f" [{self.symbol.why}]" if self.symbol.why else ""
        return f"{self.symbol.path}: {self.problem}{why}"


def fingerprint(*groups: Iterable[Symbol] | Mapping[str, Symbol]) -> dict[str, Symbol]:
    """Merge symbol groups into one fingerprint; later groups replace earlier ones by path."""
    out: dict[str, Symbol] = {}
    for group in groups:
        items = group.values() if isinstance(group, Mapping) else group
        for sym in items:
            out[sym.path] = sym
    return out


def judge(sym: Symbol, found: bool, params: list[str] | None) -> Mismatch | None:
    """The verdict on one symbol, from what a probe found: ``found`` (it exists) and ``params``
    (its parameter names; ``None`` when they cannot be read). ``None`` means it matches."""
    if sym.absent:
        return Mismatch(sym, "exists, but this adapter expects it to be gone") if found else None
    if not found:
        return Mismatch(sym, "not found")
    if params is None:
        if sym.accepts or sym.rejects:
            return Mismatch(sym, "exists, but its parameters could not be determined")
        return None
    missing = [p for p in sym.accepts if p not in params]
    extra = [p for p in sym.rejects if p in params]
    problems = []
    if missing:
        problems.append("missing parameter(s) " + ", ".join(missing))
    if extra:
        problems.append("has parameter(s) " + ", ".join(extra) + " this adapter expects to be gone")
    if problems:
        return Mismatch(sym, "; ".join(problems) + f" (has: {', '.join(params)})")
    return None


# ----------------------------------------------------------------------------------------- live


def _live_params(obj: Any) -> list[str] | None:
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [
        n
        for n, p in sig.parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def check_live(symbols: Iterable[Symbol]) -> list[Mismatch]:
    """Check ``symbols`` against the importable vLLM in this process."""
    out = []
    for sym in symbols:
        try:
            obj: Any = importlib.import_module(sym.module)
            for part in sym.qualname.split("."):
                obj = getattr(obj, part)
            found = True
        except (ImportError, AttributeError):
            found, obj = False, None
        m = judge(sym, found, _live_params(obj) if found else None)
        if m:
            out.append(m)
    return out

