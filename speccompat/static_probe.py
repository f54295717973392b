"""Static side of the signature probe: check a fingerprint against a vLLM release's sources.

The sources are parsed with ``ast``, never imported, so every release can be checked from one
environment. Lookups follow ``from x import y`` re-exports, ``if``/``try`` branches, class bases
across modules, and dataclass-style config classes (whose constructor is their fields).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from .probe import Mismatch, Symbol, _judge

__all__ = ["check_static"]


class _Source:
    """A read-only view of one release's source tree (``root`` contains ``vllm/``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @lru_cache(maxsize=None)  # noqa: B019 - one instance per release, kept for the test session
    def module(self, name: str) -> ast.Module | None:
        base = self.root.joinpath(*name.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        return None

    @staticmethod
    def _package_of(modname: str, tree_is_pkg: bool) -> str:
        return modname if tree_is_pkg else modname.rpartition(".")[0]

    def is_package(self, name: str) -> bool:
        return (self.root.joinpath(*name.split(".")) / "__init__.py").is_file()

    def lookup(self, modname: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Find the definition of ``name`` as seen from module ``modname``."""
        if depth > 12:
            return None
        tree = self.module(modname)
        if tree is None:
            return None
        found: tuple[str, ast.AST] | None = None
        for node in tree.body:  # last binding wins, like at run time
            hit = self._binding(modname, node, name, depth)
            if hit is not None:
                found = hit
        if found is None and self.is_package(modname) and self.module(f"{modname}.{name}") is not None:
            found = (f"{modname}.{name}", ast.Module(body=[], type_ignores=[]))
        return found

    def _binding(self, modname: str, node: ast.AST, name: str, depth: int):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return (modname, node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return (modname, node)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    src = self._resolve_from(modname, node)
                    return self.lookup(src, alias.name, depth + 1) if src else None
        if isinstance(node, ast.If):  # `if TYPE_CHECKING: ... else: ...` and version branches
            hit = None
            for sub in node.body + node.orelse:
                h = self._binding(modname, sub, name, depth)
                if h is not None:
                    hit = h
            return hit
        if isinstance(node, ast.Try):
            hit = None
            for sub in node.body:
                h = self._binding(modname, sub, name, depth)
                if h is not None:
                    hit = h
            return hit
        return None

    def _resolve_from(self, modname: str, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        pkg = self._package_of(modname, self.is_package(modname))
        parts = pkg.split(".")
        if node.level > 1:
            parts = parts[: -(node.level - 1)]
        base = ".".join(parts)
        return f"{base}.{node.module}" if node.module else base

    def class_attr(self, modname: str, cls: ast.ClassDef, attr: str, depth: int = 0):
        """Find ``attr`` in ``cls`` or its bases; returns (module, node) or None."""
        if depth > 12:
            return None
        for node in cls.body:
            hit = self._binding(modname, node, attr, 99)  # depth 99: no import following in bodies
            if hit is not None:
                return hit
        for base in cls.bases:
            bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if not bname:
                continue
            found = self.lookup(modname, bname)
            if found and isinstance(found[1], ast.ClassDef):
                hit = self.class_attr(found[0], found[1], attr, depth + 1)
                if hit is not None:
                    return hit
        return None

    def dataclass_fields(self, modname: str, cls: ast.ClassDef, depth: int = 0) -> list[str]:
        fields: list[str] = []
        for base in cls.bases:
            bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            found = self.lookup(modname, bname) if bname else None
            if found and isinstance(found[1], ast.ClassDef) and depth < 12:
                fields += self.dataclass_fields(found[0], found[1], depth + 1)
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ann = ast.unparse(node.annotation)
                if ann.startswith("ClassVar") or "ClassVar[" in ann:
                    continue
                if node.value is not None and "init=False" in ast.unparse(node.value).replace(" ", ""):
                    continue
                if node.target.id not in fields:
                    fields.append(node.target.id)
        return fields


def _func_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        src = ast.unparse(d)
        if "dataclass" in src or src in ("config",) or src.startswith("config("):
            return True
    return False


def _static_params(src: _Source, modname: str, node: ast.AST) -> list[str] | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _func_params(node)
    if isinstance(node, ast.ClassDef):
        init = src.class_attr(modname, node, "__init__")
        if init is not None and isinstance(init[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _func_params(init[1])
        if _is_dataclass(node):
            return src.dataclass_fields(modname, node)
        return None
    return None


_sources: dict[Path, _Source] = {}


def check_static(symbols: Iterable[Symbol], root: str | Path) -> list[Mismatch]:
    """Check ``symbols`` against the vLLM sources under ``root`` (the folder holding ``vllm/``)."""
    root = Path(root).resolve()
    src = _sources.setdefault(root, _Source(root))
    out = []
    for sym in symbols:
        parts = sym.qualname.split(".")
        hit = src.lookup(sym.module, parts[0])
        for attr in parts[1:]:
            if hit is None or not isinstance(hit[1], ast.ClassDef):
                hit = None
                break
            hit = src.class_attr(hit[0], hit[1], attr)
        found = hit is not None
        params = _static_params(src, hit[0], hit[1]) if found else None
        m = _judge(sym, found, params)
        if m:
            out.append(m)
    return out
