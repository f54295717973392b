"""The three wings of the tree and the walls between them, read from the sources (no import runs).

- the core: ``apply()``, the patches, the adapters and what runs in vLLM's workers
  (``speccompat.evidence.capture_path.HOT_PATH``, ``speccompat/patches/``, ``adapters/``) plus the status report
  (``report``, ``registry``, ``matrix`` reads ``compat_matrix.yaml`` for it) and the static probe
  (``static_probe``: doctor's fingerprint check against the installed sources). At module level it
  imports the standard library, ``packaging`` and ``wrapt`` only (vLLM, torch and speculators are the
  user's: imported inside functions, when there); it never imports the data product or dev tooling.
- the data product: ``speccompat/dataset/`` (and ``parallel``, the scale-out of its extraction, and
  ``speccompat/serve/``, the online server): it may use the core, never dev tooling.
- dev tooling: the test harness (``speccompat.testing``), the evidence behind the matrix
  (``speccompat.evidence``), the release watch and ``demo``: nothing in the core or the data
  product imports them (``python -m speccompat.matrix`` reaches ``speccompat.evidence`` from the
  ``__main__`` block of ``matrix``, which never runs on import).

The command line (``cli``, ``__main__``) stands on top of all three: it runs the core's ``doctor``, the
data product's commands and dev tooling's ``demo``. The floors inside each wing and the import graph:
``speccompat.testing.layering`` (``WINGS``); the tests at the end check that no arrow runs up a floor and
that no imports run in a circle.
"""

from __future__ import annotations

import sys
from pathlib import Path

from speccompat.evidence import capture_path
from speccompat.testing import layering

REPO = Path(__file__).resolve().parent.parent
TOOLING = ("speccompat.testing", "speccompat.evidence", "speccompat.demo", "speccompat.watch")
DATA = ("speccompat.dataset", "speccompat.parallel", "speccompat.serve")
#: speccompat modules outside HOT_PATH that belong to the core: the status apply() and doctor report,
#: and the static probe doctor checks the adapters' fingerprints with
CORE_EXTRA = ("report", "registry", "matrix", "static_probe")
#: function-level imports of dev tooling allowed in the core, with the reason
CORE_EXEMPT: dict[tuple[str, str], str] = {}


def _module(path: Path) -> str:
    return layering.module_name(REPO, path)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute name, at module level) for every import statement of ``path`` (its ``__main__``
    block aside: an entry point, never run on import)."""
    return layering.imports(REPO, path)


def _core_files() -> list[Path]:
    files = [REPO / f for f in capture_path.hot_path_files(REPO)]
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
    monkeypatch.setattr(capture_path, "hot_path_files", lambda root: ["speccompat/patches/planted.py"])
    assert _imports(planted) == [("os", True), ("speccompat.testing.models", False)]
    try:
        test_the_core_never_imports_the_data_product_or_dev_tooling()
    except AssertionError as exc:
        assert "('speccompat.patches.planted', 'speccompat.testing.models')" in str(exc)
    else:
        raise AssertionError("the planted import was not caught")


# --------------------------------------------------------------------------- floors and circles

def test_every_module_stands_on_a_declared_floor():
    graph = layering.import_graph(REPO)
    assert len(graph) > 80 and sum(len(v) for v in graph.values()) > 200  # the real tree
    assert [m for m in graph if layering.floor_of(m) is None] == []
    wings = {w for w, _, _ in layering.floors()}
    assert wings == {"core", "data", "dev", "entry"}  # three wings, the command line on top
    assert layering.floors()[-1] == ("entry", "command line", ("speccompat.cli", "speccompat.__main__"))
    # the core's floors hold exactly the core of the walls above (the capture path and CORE_EXTRA)
    core = {i for i, (w, _, _) in enumerate(layering.floors()) if w == "core"}
    assert {m for m in graph if layering.floor_of(m) in core} == {_module(f) for f in _core_files()}


def test_no_arrow_runs_up_a_floor():
    graph = layering.import_graph(REPO)
    assert layering.upward_arrows(graph) == [], "imports that run up a floor (speccompat.testing.layering)"


def test_no_module_imports_in_a_circle():
    assert layering.circles(layering.import_graph(REPO)) == []


def _dataset_floor(module: str) -> int:
    """The index of ``module``'s floor among the data set library's floors (:data:`layering.WINGS`)."""
    floors = [names for floor, names in layering.WINGS["data"] if floor.startswith("data set")]
    for i, names in enumerate(floors):
        if module in names:
            return i
    return len(floors) - 1  # the package itself and anything not placed lower: the commands' floor


def test_the_data_set_library_stands_in_layers():
    """Leaves (names, spec, errors, file helpers) import nothing above them; records (manifest,
    provenance, inputs, fp8) no layout; the layouts neither the directory nor a command; the
    directory no command. Every module of speccompat/dataset/ is on one of these floors."""
    graph = layering.import_graph(REPO)
    floors = [floor for floor, _ in layering.WINGS["data"] if floor.startswith("data set")]
    assert floors == ["data set: names and spec", "data set: records", "data set: layouts", "data set: directory",
                      "data set: commands"]
    mods = [m for m in graph if m == "speccompat.dataset" or m.startswith("speccompat.dataset.")]
    assert len(mods) > 20
    up = [(m, t) for m in mods for t in graph[m]
          if t.startswith("speccompat.dataset") and _dataset_floor(t) > _dataset_floor(m)]
    assert up == [], f"arrows up the data set library's layers: {up}"
    leaves = {m for m in mods if _dataset_floor(m) == 0}
    assert {"speccompat.dataset.names", "speccompat.dataset.spec", "speccompat.dataset.errors"} <= leaves
    for m in ("speccompat.dataset.names", "speccompat.dataset.spec", "speccompat.dataset.errors"):
        assert [t for t in graph[m] if t.startswith("speccompat.dataset")] == [], m


def _one_place_offences(source: str) -> list[str]:
    """What of ``source`` only the directory and the spec may do: build a ``Manifest(...)``, read
    the provenance's ``hidden_states`` ``dtype``/``layer_ids`` or ``model`` ``hidden_size`` by key."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "Manifest"
                                           or getattr(node.func, "attr", None) == "Manifest"):
            out.append(f"line {node.lineno}: Manifest(...)")
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Subscript):
            keys = (getattr(node.value.slice, "value", None), getattr(node.slice, "value", None))
            if keys in {("hidden_states", "dtype"), ("hidden_states", "layer_ids"), ("model", "hidden_size")}:
                out.append(f"line {node.lineno}: [{keys[0]!r}][{keys[1]!r}]")
    return out


def test_the_directory_builds_manifests_and_the_spec_reads_what_is_stored():
    """``DatasetDir`` is the one place that builds a manifest (``manifest()``, ``new_manifest()``);
    what a set stores (dtype, layers, width) is read from a provenance in ``StoredSpec`` only (and
    in check-draft, which also reads other tools' files). The check sees a planted offence."""
    planted = 'm = Manifest(d)\nx = prov["hidden_states"]["dtype"]\ny = p["model"]["hidden_size"]\np["model"]["hidden_size"] = 1'
    assert _one_place_offences(planted) == ["line 1: Manifest(...)", "line 2: ['hidden_states']['dtype']",
                                            "line 3: ['model']['hidden_size']"]  # a write (line 4) is no read
    allowed = {"speccompat/dataset/directory.py", "speccompat/dataset/manifest.py", "speccompat/dataset/spec.py",
               "speccompat/dataset/check_draft.py"}
    found = {str(f.relative_to(REPO)): _one_place_offences(f.read_text())
             for f in sorted((REPO / "speccompat").rglob("*.py"))}
    assert {f: o for f, o in found.items() if o and f not in allowed} == {}


def test_the_graph_sees_a_planted_circle_and_an_arrow_up(tmp_path):
    pkg = tmp_path / "speccompat"
    pkg.mkdir()
    (tmp_path / "adapters").mkdir()
    (pkg / "__init__.py").write_text("from .api import apply\n")
    (pkg / "api.py").write_text("from . import errors\n\n\ndef apply():\n    pass\n")
    (pkg / "errors.py").write_text("def f():\n    from .api import apply\n")
    (pkg / "matrix.py").write_text("import os\n\nif __name__ == '__main__':\n    from speccompat.evidence import cli\n")
    (pkg / "evidence").mkdir()
    (pkg / "evidence" / "__init__.py").write_text("")
    (pkg / "evidence" / "cli.py").write_text("")
    graph = layering.import_graph(tmp_path)
    assert graph["speccompat.errors"] == {"speccompat.api": False}
    assert graph["speccompat.matrix"] == {}  # the __main__ block is no arrow
    assert graph["speccompat"] == {"speccompat.api": True}
    assert layering.upward_arrows(graph) == [("speccompat.errors", "speccompat.api")]
    assert layering.circles(graph) == [["speccompat.api", "speccompat.errors"]]
