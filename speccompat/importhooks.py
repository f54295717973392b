"""Run code just before and just after a named module executes, in this process.

``before`` callbacks see the fresh module object before its body runs (used to give speculators'
module a scoped ``__import__`` when vLLM moved a name it imports). ``after`` callbacks see the loaded
module (used to patch names in it). If the module is already imported, registering an ``after``
callback does not run it: callers apply to loaded modules themselves.

Unlike patching vLLM's modules, nothing here is visible to any module but the watched ones, and
``unwatch_all()`` removes every trace (the finder, the loader wrappers are gone once the module is
loaded: its ``__loader__`` and ``__spec__.loader`` are restored).
"""

from __future__ import annotations

import builtins
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["redirecting_builtins", "unwatch_all", "watch", "watched"]

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_before: dict[str, list[Callback]] = {}
_after: dict[str, list[Callback]] = {}


class _Loader:
    """Wraps the real loader of a watched module (protocol of importlib.abc.Loader)."""

    def __init__(self, loader: Any, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_code, ...
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _lock:
            before = list(_before.get(self._fullname, ()))
            after = list(_after.get(self._fullname, ()))
        # Leave no trace of this wrapper on the loaded module.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        for cb in before:
            cb(module)
        self._loader.exec_module(module)
        for cb in after:
            cb(module)


class _Finder:
    """A meta path finder (protocol of importlib.abc.MetaPathFinder) for watched modules only."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        with _lock:
            if fullname not in _before and fullname not in _after:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_finder = _Finder()


def watch(fullname: str, *, before: Callback | None = None, after: Callback | None = None) -> None:
    """Call ``before``/``after`` around the next import(s) of ``fullname`` in this process."""
    with _lock:
        if before is not None:
            _before.setdefault(fullname, []).append(before)
        if after is not None:
            _after.setdefault(fullname, []).append(after)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def watched() -> list[str]:
    with _lock:
        return sorted(set(_before) | set(_after))


def unwatch_all() -> None:
    """Forget every callback and remove the finder from ``sys.meta_path``."""
    with _lock:
        _before.clear()
        _after.clear()
        while _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def redirecting_builtins(redirects: dict[tuple[str, str], str]) -> dict[str, Any]:
    """A ``__builtins__`` mapping whose ``__import__`` serves moved names to one module.

    ``redirects`` maps ``(module, name)`` as the module's code imports it to the module that holds
    the name now. ``from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups`` in
    a module given these builtins then binds the object from its new home, while
    ``vllm.v1.core.kv_cache_utils`` itself stays untouched.
    """
    real_import = builtins.__import__
    by_module: dict[str, dict[str, str]] = {}
    for (mod, name), new_home in redirects.items():
        by_module.setdefault(mod, {})[name] = new_home

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A001, A002
        moved = by_module.get(name) if level == 0 else None
        if not moved or not fromlist:
            return real_import(name, globals, locals, fromlist, level)
        try:
            module = real_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError:
            # The whole module is gone (e.g. vllm.utils.hashing before 0.11.1): serve it only if
            # every imported name has a new home.
            if not all(n in moved for n in fromlist):
                raise
            module = None
        wanted = [n for n in fromlist if n in moved and not hasattr(module, n)]
        if not wanted:
            return module
        view = ModuleType(name, f"speccompat view of {name} (moved names redirected)")
        if module is not None:
            view.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        for n in wanted:
            home = real_import(moved[n], None, None, (n,), 0)
            setattr(view, n, getattr(home, n))
        return view

    scoped = dict(vars(builtins))
    scoped["__import__"] = __import__
    scoped["__speccompat_redirects__"] = dict(redirects)
    return scoped
