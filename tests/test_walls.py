"""The three wings of the tree and the walls between them, read from the sources (no import runs).

- the core: ``apply()``, the patches, the adapters and what runs in vLLM's workers
  (``speccompat.matrix.HOT_PATH``, ``speccompat/patches/``, ``adapters/``) plus the status report
  (``report``, ``registry``, ``matrix`` reads ``compat_matrix.yaml`` for it). At module level it
  imports the standard library, ``packaging`` and ``wrapt`` only (vLLM, torch and speculators are the
  user's: imported inside functions, when there); it never imports the data product or dev tooling.
- the data product: ``speccompat/dataset/`` (and ``parallel``, the scale-out of its extraction, and
  ``speccompat/serve/``, the online server): it may use the core, never dev tooling.
- dev tooling: the test harness (``speccompat.testing``), the static probe, the release watch and
  ``demo``: nothing in the core or the data product imports them; ``matrix`` reads
  ``speccompat.testing``'s recipe table only while it generates the matrix, and runs the watch for
  ``--watch`` (function-level imports, never at module level).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from speccompat import matrix

REPO = Path(__file__).resolve().parent.parent
TOOLING = ("speccompat.testing", "speccompat.static_probe", "speccompat.demo", "speccompat.watch")
DATA = ("speccompat.dataset", "speccompat.parallel", "speccompat.serve")
#: speccompat modules outside HOT_PATH that belong to the core: the status apply() and doctor report
CORE_EXTRA = ("report", "registry", "matrix")
#: function-level imports of dev tooling allowed in the core, with the reason
CORE_EXEMPT = {("speccompat.matrix", "speccompat.testing.models"): "generation of the architectures table",
               ("speccompat.matrix", "speccompat.watch"): "the release watch behind --watch"}


def _module(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "adapters":
        parts = ["speccompat", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module name, at module level) for every import statement of ``path``."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level count as module level
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if node.module is None:  # `from . import x`: the names are modules
                out += [(f"{name}.{a.name}", id(node) in top) for a in node.names]
            else:
                out.append((name, id(node) in top))
    return out


def _core_files() -> list[Path]:
    files = [REPO / f for f in matrix.hot_path_files(REPO)]
    return files + [REPO / "speccompat" / f"{m}.py" for m in CORE_EXTRA]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_imports_only_stdlib_packaging_and_wrapt_at_module_level():
    allowed = set(sys.stdlib_module_names) | {"packaging", "wrapt", "speccompat", "__future__"}
    bad = [(_module(f), name) for f in _core_files() for name, top in _imports(f)
           if top and name.split(".")[0] not in allowed]
    assert not bad, f"module-level imports outside packaging/wrapt in the core: {bad}"
    assert len(_core_files()) > 20  # the rule reads the real tree


def test_the_core_never_imports_the_data_product_or_dev_tooling():
    bad = []
    for f in _core_files():
        me = _module(f)
        for name, _ in _imports(f):
            if _under(name, DATA + TOOLING + ("speccompat.cli",)) and (me, name) not in CORE_EXEMPT:
                bad.append((me, name))
    assert not bad, f"the core imports the data product or dev tooling: {bad}"
    for (me, name), why in CORE_EXEMPT.items():  # each exemption is still a function-level import
        path = REPO / (me.replace(".", "/") + ".py")
        assert (name, False) in _imports(path) and (name, True) not in _imports(path), (me, name, why)


def test_the_data_product_never_imports_dev_tooling():
    files = (list((REPO / "speccompat" / "dataset").glob("*.py")) + [REPO / "speccompat" / "parallel.py"]
             + list((REPO / "speccompat" / "serve").glob("*.py")))
    bad = [(_module(f), name) for f in files for name, _ in _imports(f) if _under(name, TOOLING)]
    assert not bad, f"the data product imports dev tooling: {bad}"
    assert any(_under(name, ("speccompat.dataset",)) for f in files for name, _ in _imports(f))


def test_the_rule_sees_a_planted_import(tmp_path, monkeypatch):
    """The reader resolves relative imports: a core module planted with one is caught (the test can fail)."""
    planted = tmp_path / "speccompat" / "patches" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("import os\n\n\ndef f():\n    from ..testing import models\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "CORE_EXTRA", ())
    monkeypatch.setattr(matrix, "hot_path_files", lambda root: ["speccompat/patches/planted.py"])
    assert _imports(planted) == [("os", True), ("speccompat.testing", False)]
    try:
        test_the_core_never_imports_the_data_product_or_dev_tooling()
    except AssertionError as exc:
        assert "('speccompat.patches.planted', 'speccompat.testing')" in str(exc)
    else:
        raise AssertionError("the planted import was not caught")
