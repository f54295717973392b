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

__all__ = ["Mismatch", "Params", "Symbol", "check_live", "fingerprint", "judge"]


class Symbol(NamedTuple):
    """A requirement on one vLLM symbol.

    ``path`` is ``"module:Name"`` or ``"module:Class.attr"``. For a class, the parameters are its
    constructor's (``__init__`` or dataclass fields); for a function or method, its own.
    ``**kwargs`` does not count as accepting a name.

    A symbol is *called* (``called=True``, the default) with ``positional`` passed by position, in
    that order (each entry a parameter name, or ``"a|b"`` where either name is right), and any of
    ``accepts`` by keyword. Its required parameters (no default) must then all be among those: a
    new required parameter is refused, naming it, before the engine starts, instead of failing
    with a TypeError after the model loaded. ``called=False``: its parameters are read (fields of
    an object vLLM builds), never passed, so what they require does not matter.

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
    positional: tuple[str, ...] = ()
    called: bool = True

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
        if self.positional:
            parts.append("takes " + ", ".join(self.positional) + " by position")
        if self.rejects:
            parts.append("does not accept " + ", ".join(self.rejects))
        return f"{self.path}" + (f" ({'; '.join(parts)})" if parts else " exists")


class Params(NamedTuple):
    """The parameters of a callable as a probe reads them (``self``/``cls``, ``*args`` and
    ``**kwargs`` left out): ``names`` in order, those a caller may pass by ``positional``
    (in order) and those ``required`` (without a default)."""

    names: tuple[str, ...]
    positional: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    def render(self) -> str:
        """``(a, b, c=, *, d, e=)``: positional order, keyword-only after ``*``, ``=`` a default."""
        out = []
        for name in self.names:
            if name not in self.positional and "*" not in out:
                out.append("*")
            out.append(name if name in self.required else f"{name}=")
        return f"({', '.join(out)})"


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


def judge(sym: Symbol, found: bool, params: Params | None) -> Mismatch | None:
    """The verdict on one symbol, from what a probe found: ``found`` (it exists) and ``params``
    (``None`` when they cannot be read). ``None`` means it matches."""
    if sym.absent:
        return Mismatch(sym, "exists, but this adapter expects it to be gone") if found else None
    if not found:
        return Mismatch(sym, "not found")
    if params is None:
        if sym.accepts or sym.rejects or sym.positional:
            return Mismatch(sym, "exists, but its parameters could not be determined")
        return None
    names = params.names
    missing = [p for p in (*sym.accepts, *(w for w in sym.positional if "|" not in w)) if p not in names]
    extra = [p for p in sym.rejects if p in names]
    problems = []
    if missing:
        problems.append("missing parameter(s) " + ", ".join(dict.fromkeys(missing)))
    if extra:
        problems.append("has parameter(s) " + ", ".join(extra) + " this adapter expects to be gone")
    if sym.called:
        for i, want in enumerate(sym.positional):
            if i >= len(params.positional):
                problems.append(f"takes {len(params.positional)} positional parameter(s), "
                                f"{len(sym.positional)} are passed by position")
                break
            if params.positional[i] not in want.split("|"):
                problems.append(f"positional parameter {i + 1} is {params.positional[i]}, not {want}")
        passed = {*sym.accepts, *params.positional[: len(sym.positional)]}
        new_required = [p for p in params.required if p not in passed]
        if new_required:
            problems.append("new required parameter(s) " + ", ".join(new_required) + " that no caller passes")
    if problems:
        return Mismatch(sym, "; ".join(problems) + f" (has: {', '.join(names)})")
    return None


# ----------------------------------------------------------------------------------------- live


def _live_params(obj: Any) -> Params | None:
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    ps = [p for n, p in sig.parameters.items()
          if n not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return Params(
        tuple(p.name for p in ps),
        tuple(p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
        tuple(p.name for p in ps if p.default is p.empty),
    )


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

