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
