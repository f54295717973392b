"""The tests' own layering: test modules share helpers through ``tests/support/`` only, never by
importing another test module or ``conftest`` (which would run its tests' module-level code, and
ties a test to where another one happens to define a helper)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported(path: Path) -> list[str]:
    """The module of every absolute import statement of ``path`` (inside functions too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append(node.module)
    return out


def _bad(name: str) -> bool:
    top = name.split(".")[0]
    return top == "conftest" or top.startswith("test_")


def test_no_test_module_imports_another_test_module_or_conftest():
    files = sorted(TESTS.rglob("*.py"))
    assert len([f for f in files if f.name.startswith("test_")]) > 40  # the real tree
    bad = [(str(f.relative_to(TESTS)), name) for f in files for name in _imported(f) if _bad(name)]
    assert bad == [], f"imports of test modules or conftest (move the helper into tests/support/): {bad}"


def test_the_helpers_live_in_the_support_package():
    support = TESTS / "support"
    assert (support / "__init__.py").is_file()
    assert not [f.name for f in support.glob("test_*.py")], "tests/support/ holds helpers, not tests"
    strays = [f.name for f in TESTS.glob("*.py") if not f.name.startswith("test_") and f.name != "conftest.py"]
    assert strays == [], f"helpers outside tests/support/: {strays}"


def test_the_rule_sees_a_planted_import(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("def test_x():\n    from test_dataset import scan\n    import conftest\n")
    assert [n for n in _imported(planted) if _bad(n)] == ["test_dataset", "conftest"]


#: test modules of the data set library named after a property that spans its modules, not a module
DATASET_PROPERTIES = {
    "fuzz": "no traceback whatever the bytes, across verify, merge, export, check-draft and the resume check",
    "outside": "nothing outside the output directory is touched and no half set is left, across export, merge, verify",
    "package": "the package itself (speccompat/dataset/__init__.py): what importing it imports",
}


def _dataset_test_misnamed(test_names: list[str], modules: set[str]) -> list[str]:
    """The ``test_dataset_<what>`` names whose ``<what>`` neither begins with a module of the
    data set library (``test_dataset_extract_driver``: ``extract``) nor is a declared property."""
    bad = []
    for name in test_names:
        what = name.removeprefix("test_dataset_")
        if what in DATASET_PROPERTIES:
            continue
        if not any(what == m or what.startswith(m + "_") for m in modules):
            bad.append(name)
    return bad


def test_the_data_set_tests_are_named_after_what_they_test():
    """tests/test_dataset_<module>[_<aspect>].py follows speccompat/dataset/<module>.py; the check
    sees a planted misnamed module."""
    modules = {p.stem for p in (TESTS.parent / "speccompat" / "dataset").glob("*.py") if p.stem != "__init__"}
    names = sorted(p.stem for p in TESTS.glob("test_dataset_*.py"))
    assert len(names) >= 15
    assert _dataset_test_misnamed(names, modules) == []
    assert _dataset_test_misnamed(["test_dataset_rest", "test_dataset_shards_speculators"], modules) == ["test_dataset_rest"]
    have = {m for m in modules for n in names if n.removeprefix("test_dataset_") == m
            or n.removeprefix("test_dataset_").startswith(m + "_")}
    assert {"names", "inputs", "provenance", "formats", "arrow_format", "speculators_format", "directory", "store",
            "writer", "reader", "verify", "shards", "extract", "check_draft", "parallel", "fp8", "preflight"} <= have
