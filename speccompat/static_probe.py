"""Static side of the signature probe: check a fingerprint against a release's sources.

The sources are parsed with ``ast``, never imported, so every release can be checked from one
environment. A name is resolved the way Python binds it at run time, as far as that can be read
from the sources:

- ``from x import y`` (absolute and relative), ``from x import *`` (honouring ``__all__``),
  ``import a.b [as c]``, and ``from pkg import submodule`` are followed;
- ``if`` branches are all considered (``if TYPE_CHECKING:`` bodies are not: they never run);
  ``try`` bodies win over their ``except`` handlers, which are used only when the body's binding
  cannot be resolved (``try: from x import y`` / ``except ImportError: y = None``); ``with``
  bodies run;
- a module-level ``__getattr__`` serves the names it compares ``name`` against (``name == "x"``,
  ``name in ("x", ...)``, ``name in MAPPING`` with a literal dict/set/list/tuple), following a
  ``MAPPING`` of names to (sub)module names when it has one;
- ``X = Y`` / ``X = mod.Y`` aliases are followed;
- class attributes are looked up in the class body (last binding wins) and then in its bases,
  across modules;
- a class's constructor parameters are its own ``__init__``'s, or its fields when it is a
  dataclass, a vLLM ``@config`` (pydantic) dataclass, a ``msgspec.Struct``, a ``NamedTuple`` or a
  pydantic ``BaseModel`` (fields of such bases included), or else the nearest base's constructor.

Names bound to something outside the tree (``import torch``, ``from msgspec import Struct``) are
*found* but opaque: their parameters are unknown.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .probe import Mismatch, Params, Symbol, judge

__all__ = ["check_static", "facts", "signatures"]


class _Opaque(ast.AST):
    """Something that exists at run time but cannot be read: an object outside the tree, or a
    value produced by a module ``__getattr__``. ``origin`` is a dotted name when known."""

    _fields = ("origin",)

    def __init__(self, origin: str = "") -> None:
        super().__init__()
        self.origin = origin


class _ModuleRef(ast.AST):
    """A module object (``import a.b``, or a submodule reached as an attribute of its package)."""

    _fields = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


Hit = tuple  # (module name, node): node is a def/class/assign, a _ModuleRef or an _Opaque

_FIELD_BASES = {"Struct", "NamedTuple", "BaseModel", "TypedDict"}  # constructor = annotated fields
_DEPTH = 200  # recursion guard only; import cycles are caught by the in-progress set


def _is_type_checking(test: ast.expr) -> bool:
    src = ast.unparse(test)
    return src in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _str_items(node: ast.AST | None) -> list[str] | None:
    """The string elements of a literal list/tuple/set (or the keys of a dict), else None."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        elts = node.elts
    elif isinstance(node, ast.Dict):
        elts = node.keys
    else:
        return None
    out = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return out


_parsed: dict[bytes, ast.Module] = {}


def _parse(data: bytes) -> ast.Module:
    """Parse module source; identical files (most of them, between neighbouring releases) once.

    The trees are shared between :class:`_Source` instances and never modified.
    """
    key = hashlib.blake2b(data, digest_size=16).digest()
    tree = _parsed.get(key)
    if tree is None:
        tree = _parsed[key] = ast.parse(data.decode("utf-8", errors="replace"))
    return tree


class _Source:
    """A read-only view of one source tree (``root`` contains top-level packages, e.g. ``vllm/``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._modules: dict[str, ast.Module | None] = {}
        self._lookups: dict[tuple[str, str], Hit | None] = {}
        self._in_progress: set[tuple[str, str]] = set()
        self._alls: dict[str, list[str] | None] = {}
        self._cycles = 0  # lookups cut short by an import cycle (their callers are not cached)

    # ------------------------------------------------------------------------------ modules
    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            tree = None
            base = self.root.joinpath(*name.split("."))
            for f in (base / "__init__.py", base.with_suffix(".py")):  # a package wins, as at run time
                if f.is_file():
                    tree = _parse(f.read_bytes())
                    break
            self._modules[name] = tree
        return self._modules[name]

    def is_package(self, name: str) -> bool:
        return (self.root.joinpath(*name.split(".")) / "__init__.py").is_file()

    def is_external(self, name: str) -> bool:
        """``name`` belongs to a top-level package that is not in this tree (torch, msgspec...)."""
        top = name.split(".", 1)[0]
        return not (self.root / top).is_dir() and not (self.root / f"{top}.py").is_file()

    def _resolve_from(self, modname: str, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        pkg = modname if self.is_package(modname) else modname.rpartition(".")[0]
        parts = pkg.split(".")
        if node.level > 1:
            parts = parts[: -(node.level - 1)]
        base = ".".join(parts)
        return f"{base}.{node.module}" if node.module else base

    def _all(self, modname: str) -> list[str] | None:
        """``__all__`` of a module when it is a literal (``+=`` of literals included)."""
        if modname not in self._alls:
            self._alls[modname] = self._read_all(modname)
        return self._alls[modname]

    def _read_all(self, modname: str) -> list[str] | None:
        tree = self.module(modname)
        if tree is None:
            return None
        names: list[str] | None = None
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                items = _str_items(node.value)
                if items is not None:
                    names = items
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == "__all__":
                items = _str_items(node.value)
                if items is not None:
                    names = items
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == "__all__":
                items = _str_items(node.value)
                if items is not None:
                    names = (names or []) + items
        return names

    # ------------------------------------------------------------------------------ lookups
    def lookup(self, modname: str, name: str, depth: int = 0) -> Hit | None:
        """Find what ``name`` is bound to in module ``modname`` (as ``modname.name`` at run time)."""
        key = (modname, name)
        if key in self._lookups:
            return self._lookups[key]
        if key in self._in_progress or depth > _DEPTH:
            self._cycles += 1
            return None  # an import cycle: this path does not bind it
        self._in_progress.add(key)
        cycles = self._cycles
        try:
            hit = self._lookup(modname, name, depth)
        finally:
            self._in_progress.discard(key)
        if self._cycles == cycles or not self._in_progress:
            self._lookups[key] = hit
        return hit

    def _lookup(self, modname: str, name: str, depth: int) -> Hit | None:
        tree = self.module(modname)
        if tree is None:
            if self.is_external(modname):
                return (modname, _Opaque(f"{modname}.{name}"))
            return None
        found = self._scan(modname, tree.body, name, depth)
        if found is None and self.is_package(modname) and self.module(f"{modname}.{name}") is not None:
            found = (modname, _ModuleRef(f"{modname}.{name}"))
        if found is None:
            found = self._module_getattr(modname, tree, name, depth)
        return found

    def _scan(self, modname: str, body: list[ast.stmt], name: str, depth: int,
              cls: ast.ClassDef | None = None) -> Hit | None:
        """The last binding of ``name`` among ``body``'s statements (``None`` if none)."""
        found: Hit | None = None
        for node in body:
            hit = self._binding(modname, node, name, depth, cls)
            if hit is not None:
                found = hit
        return found

    def _binding(self, modname: str, node: ast.AST, name: str, depth: int,
                 cls: ast.ClassDef | None = None) -> Hit | None:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return (modname, node) if node.name == name else None
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if self._target_binds(t, name):
                    if isinstance(t, ast.Name):
                        return self._alias(modname, node.value, depth, cls) or (modname, node)
                    return (modname, node)
            return None
        if isinstance(node, ast.AnnAssign):
            # `x: T` without a value binds nothing at run time.
            if node.value is not None and self._target_binds(node.target, name):
                return self._alias(modname, node.value, depth, cls) or (modname, node)
            return None
        if isinstance(node, ast.ImportFrom):
            src = None
            for alias in node.names:
                if alias.name == "*":
                    src = src or self._resolve_from(modname, node)
                    if src and self._star_exports(src, name):
                        hit = self.lookup(src, name, depth + 1)
                        if hit is not None:
                            return hit
                elif (alias.asname or alias.name) == name:
                    src = src or self._resolve_from(modname, node)
                    if not src:
                        return None
                    return self.lookup(src, alias.name, depth + 1)
            return None
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name:
                    return self._module_ref(modname, alias.name)
                if alias.asname is None and alias.name.split(".", 1)[0] == name:
                    return self._module_ref(modname, name)
            return None
        if isinstance(node, ast.If):
            branches = node.orelse if _is_type_checking(node.test) else node.body + node.orelse
            return self._scan(modname, branches, name, depth, cls)
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            hit = self._scan(modname, node.body + node.orelse, name, depth, cls)
            if hit is None:
                for handler in node.handlers:
                    h = self._scan(modname, handler.body, name, depth, cls)
                    if h is not None:
                        hit = h
            h = self._scan(modname, node.finalbody, name, depth, cls)
            return h if h is not None else hit
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return self._scan(modname, node.body, name, depth, cls)
        return None

    @staticmethod
    def _target_binds(target: ast.expr, name: str) -> bool:
        if isinstance(target, ast.Name):
            return target.id == name
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(_Source._target_binds(e, name) for e in target.elts)
        if isinstance(target, ast.Starred):
            return _Source._target_binds(target.value, name)
        return False

    def _module_ref(self, modname: str, target: str) -> Hit:
        if self.module(target) is None and self.is_external(target):
            return (modname, _Opaque(target))
        return (target, _ModuleRef(target))

    def _star_exports(self, src: str, name: str) -> bool:
        if self.module(src) is None:
            return False  # `from external import *`: cannot tell what it binds
        exported = self._all(src)
        return name in exported if exported is not None else not name.startswith("_")

    def _alias(self, modname: str, value: ast.expr, depth: int, cls: ast.ClassDef | None) -> Hit | None:
        """``X = Y`` or ``X = a.b.Y``: what ``Y`` is (None when ``value`` is not a plain name)."""
        if depth > _DEPTH:  # `x = x` in a class body
            return None
        if isinstance(value, ast.Name):
            if cls is not None:  # class body first, then the module's globals
                hit = self._scan(modname, cls.body, value.id, depth + 1)
                if hit is not None:
                    return hit
            return self.lookup(modname, value.id, depth + 1)
        if isinstance(value, ast.Attribute):
            return self.expr(modname, value, depth + 1)
        return None

    def expr(self, modname: str, node: ast.expr, depth: int = 0) -> Hit | None:
        """Resolve a ``Name`` / ``Attribute`` chain / ``Subscript`` (``Generic[T]``) in a module."""
        if depth > _DEPTH:
            return None
        if isinstance(node, ast.Subscript):
            return self.expr(modname, node.value, depth + 1)
        if isinstance(node, ast.Name):
            return self.lookup(modname, node.id, depth + 1)
        if isinstance(node, ast.Attribute):
            base = self.expr(modname, node.value, depth + 1)
            if base is None:
                return None
            return self.member(base, node.attr, depth + 1)
        return None

    def member(self, hit: Hit, attr: str, depth: int = 0) -> Hit | None:
        """``attr`` of a resolved object: a module's global, a class attribute, or opaque."""
        mod, node = hit
        if isinstance(node, _ModuleRef):
            return self.lookup(node.name, attr, depth + 1)
        if isinstance(node, ast.ClassDef):
            return self.class_attr(mod, node, attr, depth + 1)
        if isinstance(node, _Opaque):
            return (mod, _Opaque(f"{node.origin}.{attr}" if node.origin else attr))
        return None

    def _module_getattr(self, modname: str, tree: ast.Module, name: str, depth: int) -> Hit | None:
        """Names served by a module-level ``def __getattr__(name)``."""
        fn = next((n for n in reversed(tree.body) if isinstance(n, ast.FunctionDef)
                   and n.name == "__getattr__"), None)
        if fn is None or not fn.args.args:
            return None
        arg = fn.args.args[0].arg
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name)
                    and node.left.id == arg and len(node.ops) == 1):
                continue
            op, right = node.ops[0], node.comparators[0]
            if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and right.value == name:
                return (modname, _Opaque(f"{modname}.{name}"))
            if not isinstance(op, ast.In):
                continue
            items = _str_items(right)
            mapping = None
            if items is None and isinstance(right, ast.Name):
                mapping = self._scan(modname, tree.body, right.id, depth + 1)
                mnode = mapping[1] if mapping else None
                value = getattr(mnode, "value", None) if isinstance(mnode, (ast.Assign, ast.AnnAssign)) else None
                items = _str_items(value)
                mapping = value if isinstance(value, ast.Dict) else None
            if items is None or name not in items:
                continue
            if mapping is not None:  # {"name": "submodule"}: try to find the real definition
                for k, v in zip(mapping.keys, mapping.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant) \
                            and isinstance(v.value, str):
                        target = v.value.split(":", 1)[0]
                        pkg = modname if self.is_package(modname) else modname.rpartition(".")[0]
                        for cand in (f"{pkg}.{target}", target):
                            if self.module(cand) is not None:
                                hit = self.lookup(cand, name, depth + 1)
                                if hit is not None:
                                    return hit
            return (modname, _Opaque(f"{modname}.{name}"))
        return None

    # ------------------------------------------------------------------------------ classes
    def bases(self, modname: str, cls: ast.ClassDef, depth: int = 0) -> list[Hit | None]:
        return [self.expr(modname, b, depth + 1) for b in cls.bases]

    def class_attr(self, modname: str, cls: ast.ClassDef, attr: str, depth: int = 0) -> Hit | None:
        """Find ``attr`` in ``cls`` or its bases; returns (module, node) or None."""
        if depth > _DEPTH:
            return None
        hit = self._scan(modname, cls.body, attr, depth + 1, cls)
        if hit is not None:
            return hit
        for base in self.bases(modname, cls, depth):
            if base is None:
                continue
            if isinstance(base[1], ast.ClassDef):
                h = self.class_attr(base[0], base[1], attr, depth + 1)
                if h is not None:
                    return h
            elif isinstance(base[1], _Opaque):
                continue  # an external base (object, ABC, torch.nn.Module...): unknown members
        return None

    def field_kind(self, modname: str, cls: ast.ClassDef, depth: int = 0) -> str | None:
        """``"dataclass"`` / ``"fields"`` when the constructor is made of fields, else None."""
        for d in cls.decorator_list:
            src = ast.unparse(d)
            if "dataclass" in src or src == "config" or src.startswith("config(") or src.endswith(".config") \
                    or ".config(" in src:
                if "init=False" in src.replace(" ", ""):
                    return None
                return "dataclass"
        if depth > _DEPTH:
            return None
        for b, base in zip(cls.bases, self.bases(modname, cls, depth), strict=True):
            if base is None:
                last = ast.unparse(b).rsplit(".", 1)[-1].split("[", 1)[0]
                if last in _FIELD_BASES:
                    return "fields"
                continue
            if isinstance(base[1], _Opaque):
                if base[1].origin.rsplit(".", 1)[-1] in _FIELD_BASES:
                    return "fields"
            elif isinstance(base[1], ast.ClassDef) and self.field_kind(base[0], base[1], depth + 1) == "fields":
                return "fields"  # subclasses of a Struct / NamedTuple / BaseModel are ones too
        return None

    def fields(self, modname: str, cls: ast.ClassDef, depth: int = 0) -> list[tuple[str, bool, bool]]:
        """Constructor fields of a field-based class, bases' (that are field-based) first:
        ``(name, required, keyword-only)``."""
        out: dict[str, tuple[str, bool, bool]] = {}
        if depth < _DEPTH:
            for base in reversed(self.bases(modname, cls, depth)):
                if base is not None and isinstance(base[1], ast.ClassDef) \
                        and self.field_kind(base[0], base[1], depth + 1):
                    for f in self.fields(base[0], base[1], depth + 1):
                        out.setdefault(f[0], f)
        kw_only = any("kw_only=True" in ast.unparse(d).replace(" ", "") for d in cls.decorator_list)
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = ast.unparse(node.annotation)
            if ann.startswith(("ClassVar", "typing.ClassVar")):
                continue
            if "KW_ONLY" in ann:
                kw_only = True
                continue
            if isinstance(node.value, ast.Call) and any(
                kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False
                for kw in node.value.keywords
            ):
                continue
            out[node.target.id] = (node.target.id, not _has_default(node.value), kw_only)
        return list(out.values())

    def class_params(self, modname: str, cls: ast.ClassDef, depth: int = 0) -> Params | None:
        """Parameters of ``cls(...)``: own ``__init__``, own fields, else the nearest base's."""
        if depth > _DEPTH:
            return None
        init = self._scan(modname, cls.body, "__init__", depth + 1, cls)
        if init is not None and isinstance(init[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _func_params(init[1])
        if init is not None:
            return None
        if self.field_kind(modname, cls, depth):
            fields = self.fields(modname, cls, depth)
            return Params(tuple(f[0] for f in fields), tuple(f[0] for f in fields if not f[2]),
                          tuple(f[0] for f in fields if f[1]))
        bases = self.bases(modname, cls, depth)
        for b, base in zip(cls.bases, bases, strict=True):
            if base is not None and isinstance(base[1], ast.ClassDef):
                return self.class_params(base[0], base[1], depth + 1)
            src = ast.unparse(b)
            if src in ("object", "ABC", "abc.ABC", "Protocol", "typing.Protocol") or src.startswith(
                ("Generic[", "typing.Generic[")
            ):
                continue
            return None  # an external base: its constructor is unknown
        return Params(())  # only object-like bases: no parameters


def _has_default(value: ast.expr | None) -> bool:
    """Whether a field assigned ``value`` has a default: any value but ``field(...)`` /
    ``Field(...)`` without ``default``/``default_factory`` (or with ``...``, pydantic's "required")."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and ast.unparse(value.func).rsplit(".", 1)[-1] in ("field", "Field"):
        if any(kw.arg in ("default", "default_factory") for kw in value.keywords):
            return True
        return bool(value.args) and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is ...)
    return True


def _func_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Params:
    a = fn.args
    pos = a.posonlyargs + a.args
    pos_required = [x.arg for x in pos[: len(pos) - len(a.defaults)]]
    kw_required = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    skip = ("self", "cls")
    return Params(
        tuple(x.arg for x in pos + a.kwonlyargs if x.arg not in skip),
        tuple(x.arg for x in pos if x.arg not in skip),
        tuple(n for n in pos_required + kw_required if n not in skip),
    )


def _static_params(src: _Source, modname: str, node: ast.AST) -> Params | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _func_params(node)
    if isinstance(node, ast.ClassDef):
        return src.class_params(modname, node)
    return None


_sources: dict[Any, _Source] = {}


def source(root: str | Path) -> _Source:
    """The (cached) parsed view of the tree under ``root``; parsed modules are kept per root."""
    src = _sources.get(root)  # type: ignore[call-overload]
    if src is None:
        resolved = Path(root).resolve()
        src = _sources.get(resolved) or _Source(resolved)
        _sources[resolved] = _sources[root] = src  # type: ignore[index]
    return src


def resolve(sym: Symbol, root: str | Path) -> Hit | None:
    """What ``sym.path`` names in the tree under ``root``: ``(module, node)``, or None if unbound."""
    src = source(root)
    parts = sym.qualname.split(".")
    hit = src.lookup(sym.module, parts[0])
    for attr in parts[1:]:
        if hit is None:
            break
        hit = src.member(hit, attr)
    return hit


def check_static(symbols: Iterable[Symbol], root: str | Path) -> list[Mismatch]:
    """Check ``symbols`` against the sources under ``root`` (the folder holding ``vllm/``)."""
    src = source(root)
    out = []
    for sym in symbols:
        hit = resolve(sym, root)
        found = hit is not None
        params = _static_params(src, hit[0], hit[1]) if found else None
        m = judge(sym, found, params)
        if m:
            out.append(m)
    return out


def facts(paths: Iterable[str], root: str | Path, names: Iterable[str] | None = None) -> dict[str, list[str] | bool]:
    """What the sources under ``root`` say about each symbol path: its parameter names (a list;
    only those in ``names`` when given), ``True`` when it exists but its parameters cannot be
    read, ``False`` when it does not exist.

    Recorded per release by ``scripts/static_check.py``; the unit tests build fake vLLM packages
    from these facts of real releases (not from the fingerprints they are meant to test).
    """
    keep = set(names) if names is not None else None
    out: dict[str, list[str] | bool] = {}
    for path, params in signatures(paths, root).items():
        out[path] = params if isinstance(params, bool) else [p for p in params.names if keep is None or p in keep]
    return out


def signatures(paths: Iterable[str], root: str | Path) -> dict[str, Params | bool]:
    """Each symbol path's :class:`~speccompat.probe.Params` in the sources under ``root``
    (``True``: it exists, parameters unreadable; ``False``: it does not exist)."""
    src = source(root)
    out: dict[str, Params | bool] = {}
    for path in sorted(set(paths)):
        hit = resolve(Symbol(path), root)
        if hit is None:
            out[path] = False
            continue
        params = _static_params(src, hit[0], hit[1])
        out[path] = True if params is None else params
    return out
