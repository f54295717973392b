"""Discovery and selection of adapters (see ``speccompat.adapters``).

Adapter modules are named ``vllm_X_Y_Z`` after the first release they serve, so selection by
version reads file names and imports only the chosen module (and the parents it subclasses).

An adapter's *fingerprint* (:func:`fingerprint`) is its own ``requires`` plus what the registry
derives from the next adapter: every symbol the next one marks ``new`` (first seen in its range)
must be absent here. An adapter therefore never names what came after it; adding a release adds
one module and changes no other.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from functools import lru_cache
from typing import TYPE_CHECKING

from packaging.version import Version

if TYPE_CHECKING:
    from .adapter import Adapter
    from .probe import Mismatch, Symbol

__all__ = ["adapter_modules", "all_adapters", "by_name", "by_version", "fingerprint", "match_live", "successor"]

PACKAGE = "speccompat.adapters"


def _adapters_spec() -> importlib.machinery.ModuleSpec:
    """Spec of ``speccompat.adapters``; from a source checkout, the repository's ``adapters/``.

    Installed (also editable), the package maps ``adapters/`` to ``speccompat.adapters``. Run from
    the repository root without installing, ``speccompat`` is the checkout's folder, which has no
    ``adapters`` subfolder: register the sibling folder under the same name.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None:
        return spec
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init):
        raise ImportError(f"cannot find {PACKAGE} (looked for {folder})")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return spec


@lru_cache(maxsize=1)
def adapter_modules() -> tuple[tuple[Version, str], ...]:
    """``(first release, module name)`` of every adapter module, oldest first (nothing imported)."""
    spec = _adapters_spec()
    found = []
    for folder in spec.submodule_search_locations or ():
        for name in os.listdir(folder):
            stem, ext = os.path.splitext(name)
            if stem.startswith("vllm_") and ext == ".py":
                found.append((Version(stem[len("vllm_"):].replace("_", ".")), stem))
    return tuple(sorted(set(found)))


def _load(module: str) -> type[Adapter]:
    return importlib.import_module(f"{PACKAGE}.{module}").Adapter


def all_adapters() -> tuple[type[Adapter], ...]:
    """Every adapter class, oldest first (imports them all)."""
    return tuple(_load(m) for _, m in adapter_modules())


def by_name(name: str) -> type[Adapter]:
    names = [m for _, m in adapter_modules()]
    if name not in names:
        raise KeyError(f"no adapter named {name!r}; known: {names}")
    return _load(name)


def by_version(version: Version | None) -> type[Adapter] | None:
    """The newest adapter whose range starts at or before ``version`` (``None`` if older than all).

    Dev builds compare by their release: ``0.17.0.dev5`` is served by the 0.17.0 adapter first
    (the live probe then decides), as nightlies of a release already carry most of its changes.
    """
    if version is None:
        return None
    key = Version(version.base_version)
    chosen = None
    for since, module in adapter_modules():
        if since <= key:
            chosen = module
    return _load(chosen) if chosen else None


def successor(adapter: type[Adapter]) -> type[Adapter] | None:
    """The adapter of the next release range (``None`` for the newest)."""
    names = [m for _, m in adapter_modules()]
    if adapter.name() not in names:
        return None
    i = names.index(adapter.name())
    return _load(names[i + 1]) if i + 1 < len(names) else None


def fingerprint(adapter: type[Adapter]) -> dict[str, Symbol]:
    """Every requirement the probes check for ``adapter``: its ``requires``, plus each symbol the
    next adapter introduces (``Symbol(new=True)``) required absent, which tells the two apart."""
    from .probe import Symbol

    out = dict(adapter.requires)
    nxt = successor(adapter)
    for path, sym in (nxt.requires.items() if nxt is not None else ()):
        if sym.new and path not in out:
            out[path] = Symbol(path, absent=True, why=f"introduced in {nxt.name()} (vLLM {nxt.since})")
    return out


def match_live(candidates: tuple[type[Adapter], ...] | None = None) -> dict[str, list[Mismatch]]:
    """Live probe of each candidate's fingerprint: adapter name -> mismatches (empty = match)."""
    from .probe import check_live

    return {a.name(): check_live(fingerprint(a).values()) for a in (candidates or all_adapters())}
