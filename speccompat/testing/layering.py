"""The layers of speccompat: each module's wing and floor, and the import graph read from the sources.

:data:`WINGS` is the one declaration (``tests/test_walls.py`` checks the tree against it,
``tests/test_docs.py`` checks ``docs/architecture.md``'s picture against it). The wings stand on one
another in this order - the core (``apply()`` and what runs in vLLM's workers: standard library,
``packaging`` and ``wrapt`` at module level), the data product (the data set library, its extraction,
the online server), dev tooling (the test harness, the evidence behind ``compat_matrix.yaml``, the
release watch, the demo) - with the command line on top of all three (``speccompat doctor`` is the
core's, ``extract`` and ``serve`` the data product's, ``demo`` dev tooling's), and each wing's floors
are listed lowest first. A module may import from its own floor and the floors and wings below it,
never from above.

:func:`import_graph` reads every ``import`` of ``speccompat/`` and ``adapters/`` (the package
``speccompat.adapters``) with :mod:`ast`, those inside functions included; a module's
``if __name__ == "__main__":`` block is an entry point that never runs on import and is left out.
Nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

#: wing -> floors, lowest first: (floor, module names; a name covers its submodules, the most
#: specific name wins; ``speccompat`` alone is the package's ``__init__``).
WINGS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "core": [
        ("foundations", ("speccompat._version", "speccompat.errors", "speccompat.probe", "speccompat.platform",
                         "speccompat.patching", "speccompat.layers", "speccompat.detect", "speccompat.importhooks",
                         "speccompat._state", "speccompat.stand_ins")),
        ("adapters", ("speccompat.adapter", "speccompat.adapters", "speccompat.registry", "speccompat.static_probe")),
        ("capture", ("speccompat.transport", "speccompat.capture", "speccompat.streaming", "speccompat.generator")),
        ("patches and status", ("speccompat.patches", "speccompat.report", "speccompat.matrix")),
        ("apply", ("speccompat.api", "speccompat.plugin", "speccompat")),
    ],
    "data": [
        ("data set: names and spec", ("speccompat.dataset.names", "speccompat.dataset.spec", "speccompat.dataset.errors",
                                      "speccompat.dataset.checksum", "speccompat.dataset.contenthash",
                                      "speccompat.dataset.fsutil", "speccompat.dataset.preflight")),
        ("data set: records", ("speccompat.dataset.fp8", "speccompat.dataset.inputs", "speccompat.dataset.provenance",
                               "speccompat.dataset.manifest")),
        ("data set: layouts", ("speccompat.dataset.formats", "speccompat.dataset.speculators_format",
                               "speccompat.dataset.arrow_format", "speccompat.dataset.layouts")),
        ("data set: directory", ("speccompat.dataset.directory", "speccompat.dataset.writer", "speccompat.dataset.finish",
                                 "speccompat.dataset.reader")),
        ("data set: commands", ("speccompat.dataset",)),
        ("scale-out", ("speccompat.dataset.parallel", "speccompat.parallel")),  # the second: its old path
        ("extraction", ("speccompat.dataset.extract",)),
        ("online server", ("speccompat.serve",)),
    ],
    "dev": [
        ("harness", ("speccompat.testing",)),
        ("evidence and release watch", ("speccompat.evidence", "speccompat.watch")),
        ("demo", ("speccompat.demo",)),
    ],
    "entry": [
        ("command line", ("speccompat.cli", "speccompat.__main__")),
    ],
}

#: The wings as the picture in docs/architecture.md names them.
WING_TITLES = {"core": "core: apply() and the workers (packaging + wrapt)",
               "data": "data product: dataset/, serve",
               "dev": "dev tooling: testing/, evidence/ (and scripts/, benchmarks/)",
               "entry": "command line: speccompat's commands over the three wings"}


def floors() -> list[tuple[str, str, tuple[str, ...]]]:
    """(wing, floor, names) for every floor, lowest first across the wings."""
    return [(wing, floor, names) for wing, fl in WINGS.items() for floor, names in fl]


def floor_of(module: str) -> int | None:
    """The index in :func:`floors` of ``module``'s floor (the most specific declared name), or None."""
    best: tuple[int, int] | None = None
    for i, (_, _, names) in enumerate(floors()):
        for name in names:
            hit = module == name if name == "speccompat" else (module == name or module.startswith(name + "."))
            if hit and (best is None or len(name) > best[0]):
                best = (len(name), i)
    return None if best is None else best[1]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "adapters":
        parts = ["speccompat", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for ``speccompat/`` and ``adapters/`` under the repository ``root``."""
    root = Path(root)
    files = sorted(list((root / "speccompat").rglob("*.py")) + list((root / "adapters").glob("*.py")))
    return {module_name(root, f): f for f in files}


def imports(root: Path, path: Path) -> list[tuple[str, bool]]:
    """(absolute name, at module level) of every import of ``path``, outside its ``__main__`` block;
    ``from X import y`` gives ``X.y`` (whether ``y`` is a module or a name: :func:`import_graph`
    resolves it). Module level includes the bodies of module-level ``if`` and ``try`` blocks."""
    tree = ast.parse(path.read_text())
    me = module_name(Path(root), path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    entry: set[int] = set()
    top = {id(n) for n in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            entry |= {id(n) for n in ast.walk(node)}
        elif isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in entry:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out += [(f"{name}.{a.name}", id(node) in top) for a in node.names]
    return out


def import_graph(root: Path) -> dict[str, dict[str, bool]]:
    """module -> {imported speccompat module: whether some import of it is at module level}."""
    mods = module_files(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, bool]] = {}
    for me, path in mods.items():
        arrows = graph.setdefault(me, {})
        for name, top in imports(root, path):
            target = resolve(name) if name.split(".")[0] == "speccompat" else None
            if target is not None and target != me:
                arrows[target] = arrows.get(target, False) or top
    return graph


def upward_arrows(graph: dict[str, dict[str, bool]]) -> list[tuple[str, str]]:
    """The arrows whose target stands on a higher floor than their source (undeclared modules aside)."""
    out = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = floor_of(src), floor_of(dst)
            if a is not None and b is not None and b > a:
                out.append((src, dst))
    return out


def circles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def mermaid() -> str:
    """The picture of :data:`WINGS` that ``docs/architecture.md`` shows (a test compares the two): one
    box per wing, its floors bottom-up, an arrow from each wing's lowest floor to the top of the wing
    below it (it may import all of it)."""
    short = {"speccompat": "speccompat/__init__"}
    lines = ["flowchart BT"]
    for wing, fl in WINGS.items():
        lines.append(f'  subgraph {wing}["{WING_TITLES[wing]}"]')
        for f, (floor, names) in enumerate(fl):
            node = f"{wing}{f}"
            mods = ", ".join(short.get(n, n.removeprefix("speccompat.")) for n in names)
            lines.append(f'    {node}["{floor}: {mods}"]')
        lines += [f"    {wing}{f} --> {wing}{f - 1}" for f in range(len(fl) - 1, 0, -1)]
        lines.append("  end")
    wings = list(WINGS)
    lines += [f"  {upper}0 --> {lower}{len(WINGS[lower]) - 1}" for lower, upper in zip(wings[:-1], wings[1:], strict=True)]
    return "\n".join(lines)
