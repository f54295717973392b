"""Adapter fingerprints against the sources of real vLLM releases (``static`` marker).

For a CI sample of releases (the first release of every adapter, plus the vLLM installed in this
environment, whose own package folder is read) the sources are fetched into ``.cache/vllm-sources``
by ``scripts/static_check.py``; ``SPECCOMPAT_STATIC_ALL=1`` checks every release it knows.
``SPECCOMPAT_STATIC_SOURCES=DIR`` reads existing ``DIR/<V>/vllm`` trees instead of downloading.
A release whose sources cannot be downloaded is skipped, with pip's reason
(``SPECCOMPAT_STATIC_REQUIRE=1`` turns that into a failure, for CI with network).

The unmarked tests at the end exercise the resolver on small synthetic trees: every way vLLM binds
a name that the static probe must follow, and the ways it must *not* be fooled.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version
from support.static_check import SOURCES, sc

from speccompat.probe import Symbol, check_live
from speccompat.registry import adapter_modules, all_adapters, by_version
from speccompat.static_probe import check_static

REPO = Path(__file__).resolve().parent.parent
EVIDENCE = REPO / "evidence" / "static" / "releases.json"



#: One release per adapter boundary: the first release of every adapter module.
SAMPLE = sorted({str(since) for since, _ in adapter_modules()}, key=Version)
ALL = os.environ.get("SPECCOMPAT_STATIC_ALL") == "1"
RELEASES = list(sc.RELEASES) if ALL else SAMPLE
REQUIRE = os.environ.get("SPECCOMPAT_STATIC_REQUIRE") == "1"
INSTALLED = sc.installed_vllm()


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """``sources(version)``: the folder holding ``vllm/`` for that release (``"installed"``: this env's)."""
    cache: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in cache:
            if version == "installed":
                # The installed package, seen alone (site-packages would make torch & co. "in tree").
                root = tmp_path_factory.mktemp("installed-vllm")
                (root / "vllm").symlink_to(INSTALLED[1] / "vllm", target_is_directory=True)
                cache[version] = root
            else:
                try:
                    cache[version] = sc.vllm_sources(version, sc.CACHE, SOURCES)
                except sc.SourcesUnavailable as e:
                    if REQUIRE:
                        pytest.fail(f"sources of vLLM {version} unavailable: {e}")
                    pytest.skip(f"sources of vLLM {version} cannot be obtained (no network?): {e}")
        return cache[version]

    return get


CASES = [pytest.param(v, v, id=v) for v in RELEASES]
if INSTALLED is not None:
    CASES.append(pytest.param(INSTALLED[0], "installed", id=f"installed-{INSTALLED[0]}"))


@pytest.mark.static
@pytest.mark.parametrize(("release", "where"), CASES)
def test_fingerprint_identifies_release(release, where, sources):
    root = sources(where)
    result = sc.check_release(release, root)
    adapter = by_version(Version(release))
    assert adapter is not None, f"no adapter serves vLLM {release}"
    assert result["adapter"] == adapter.name()
    assert result["mismatches"] == [], (
        f"{adapter.name()}'s fingerprint does not match vLLM {release}:\n  " + "\n  ".join(result["mismatches"])
    )
    assert result["other_matches"] == [], (
        f"vLLM {release} also matches the fingerprints of {result['other_matches']}: "
        f"fingerprints must tell adapters apart"
    )
    # Every other adapter is told apart by at least one symbol.
    assert set(result["distinguished_by"]) == {a.name() for a in all_adapters()} - {adapter.name()}


@pytest.mark.static
@pytest.mark.parametrize("release", [pytest.param(v, id=v) for v in RELEASES])
def test_speculators_imports_resolve(release, sources):
    """Every ``from vllm... import x`` of speculators 0.3/0.4 resolves (directly or via moved_names)."""
    root = sources(release)
    spec_imports = {}
    for s in sc.SPECULATORS:
        try:
            spec_imports[s] = sc.speculators_vllm_imports(sc.speculators_sources(s))
        except sc.SourcesUnavailable as e:
            if REQUIRE:
                pytest.fail(str(e))
            pytest.skip(f"sources of speculators {s} cannot be obtained: {e}")
    result = sc.check_release(release, root, spec_imports)
    assert result["import_gaps"] == {}


@pytest.mark.static
@pytest.mark.parametrize("spec", sc.SPECULATORS)
def test_speculators_patch_targets_exist(spec):
    try:
        root = sc.speculators_sources(spec)
    except sc.SourcesUnavailable as e:
        if REQUIRE:
            pytest.fail(str(e))
        pytest.skip(f"sources of speculators {spec} cannot be obtained: {e}")
    result = sc.check_speculators(spec, root)
    assert result["missing"] == [] and result["conflicts"] == [], result


@pytest.mark.static
@pytest.mark.skipif(INSTALLED is None, reason="no vLLM installed in this environment")
def test_static_agrees_with_live(sources):
    """On the installed vLLM, the static probe sees every fingerprint symbol as importing it does."""
    root = sources("installed")
    symbols = {s.path: s for a in all_adapters() for s in a.requires.values()}
    disagree = []
    for path, sym in sorted(symbols.items()):
        live = [str(m) for m in check_live([sym])]
        static = [str(m) for m in check_static([sym], root)]
        if live != static:
            disagree.append(f"{path}\n    live:   {live}\n    static: {static}")
    assert not disagree, "static and live probes disagree:\n" + "\n".join(disagree)


@pytest.mark.static
def test_evidence_agrees_with_a_fresh_check(sources):
    """evidence/static/releases.json says, for the sampled releases, what a fresh check says."""
    assert EVIDENCE.is_file(), "evidence/static/releases.json missing: run scripts/static_check.py"
    doc = json.loads(EVIDENCE.read_text())
    for key in ("date", "releases", "speculators", "results"):
        assert key in doc, f"evidence lacks {key!r} (speccompat.evidence.generate reads it)"
    assert set(doc["releases"]) == set(doc["results"]) == set(sc.RELEASES)
    for v, r in doc["results"].items():  # cheap: no sources needed
        assert r["adapter"] == by_version(Version(v)).name(), f"{v}: evidence names {r['adapter']}"
    for release in RELEASES:
        fresh = sc.check_release(release, sources(release))
        recorded = doc["results"][release]
        assert (recorded["ok"], recorded["adapter"]) == (fresh["ok"], fresh["adapter"]), (
            f"vLLM {release}: evidence says ok={recorded['ok']} ({recorded['adapter']}), a fresh check "
            f"ok={fresh['ok']} ({fresh['adapter']}): {fresh['mismatches']}; rerun scripts/static_check.py"
        )
        assert recorded["other_matches"] == fresh["other_matches"]


@pytest.mark.static
def test_matrix_generates_from_evidence():
    from speccompat.evidence.generate import generate

    matrix = generate(REPO / "evidence")
    assert matrix.releases == list(sc.RELEASES)
    assert {r.vllm for r in matrix.rows} == set(sc.RELEASES)


# ------------------------------------------------------------------- the resolver, on small trees


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return tmp_path


def _problems(root: Path, *symbols: Symbol) -> list[str]:
    return [str(m) for m in check_static(symbols, root)]


def test_resolver_follows_vllm_binding_styles(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/dist/__init__.py": "from .ops import *\nfrom .state import *\n",
        "pkg/dist/ops.py": "def gather(input_, dim=-1): ...\ndef _private(): ...\n",
        "pkg/dist/state.py": "__all__ = ['get_tp_group']\ndef get_tp_group(): ...\ndef hidden(): ...\n",
        "pkg/sp.py": """
            import msgspec
            class Mixin: ...
            class SamplingParams(Mixin, msgspec.Struct, omit_defaults=True):
                n: int = 1
                max_tokens: int | None = 16
                flag: ClassVar[bool] = True
            """,
        "pkg/config/__init__.py": "from pkg.config.cache import CacheConfig\n",
        "pkg/config/utils.py": "def config(cls=None, **kw): ...\n",
        "pkg/config/cache.py": """
            from dataclasses import InitVar, field
            from pkg.config.utils import config
            @config(config={})
            class CacheConfig:
                block_size: int = 16
                max_model_len: InitVar[int] = 0
                derived: int = field(default=0, init=False)
            """,
        "pkg/base.py": "class Executor:\n    def shutdown(self): ...\n    def run(self, a, b=1): ...\n",
        "pkg/impl.py": """
            from typing import TYPE_CHECKING
            from pkg import base as b
            if TYPE_CHECKING:
                from pkg.base import Executor as OnlyForTypes
            try:
                from pkg._C import fast_op
            except ImportError:
                def fast_op(x): ...
            class Multiproc(b.Executor):
                def run(self, a, b=1, c=2): ...
                alias = run
            Renamed = Multiproc
            """,
        "pkg/lazy.py": """
            _MOVED = {"old_name": "sub"}
            def __getattr__(name):
                if name == "current":
                    return object()
                if name in _MOVED:
                    return getattr(__import__("pkg.sub"), name)
                raise AttributeError(name)
            """,
        "pkg/sub.py": "def old_name(arg): ...\n",
    })
    ok = [
        Symbol("pkg.dist:gather", accepts=("input_", "dim")),
        Symbol("pkg.dist:get_tp_group"),
        Symbol("pkg.dist:hidden", absent=True),  # not in state.__all__
        Symbol("pkg.dist:_private", absent=True),  # star imports skip private names
        Symbol("pkg.sp:SamplingParams", accepts=("n", "max_tokens"), rejects=("flag",)),
        Symbol("pkg.config:CacheConfig", accepts=("block_size", "max_model_len"), rejects=("derived",)),
        Symbol("pkg.impl:Multiproc.shutdown"),  # inherited from a base in another module
        Symbol("pkg.impl:Multiproc.run", accepts=("a", "b", "c")),
        Symbol("pkg.impl:Multiproc.alias", accepts=("c",), called=False),
        Symbol("pkg.impl:Renamed.shutdown"),
        Symbol("pkg.impl:Multiproc", accepts=()),  # no __init__ anywhere: no parameters
        Symbol("pkg.impl:fast_op", accepts=("x",)),  # the except branch when the body cannot bind
        Symbol("pkg.impl:OnlyForTypes", absent=True),  # TYPE_CHECKING never runs
        Symbol("pkg.lazy:current"),
        Symbol("pkg.lazy:old_name", accepts=("arg",)),
        Symbol("pkg.lazy:nothing", absent=True),
        Symbol("pkg:sub"),  # a submodule is an attribute of its package
    ]
    assert _problems(root, *ok) == []


def test_resolver_reports_what_is_wrong(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/m.py": """
            from pkg.gone import Thing
            class C:
                def __init__(self, a, *, b=None, **kwargs): ...
                def meth(self, x): ...
            """,
    })
    problems = _problems(
        root,
        Symbol("pkg.m:Thing"),  # imported from a module that does not exist in the tree
        Symbol("pkg.m:C", accepts=("a", "c")),  # **kwargs does not accept c
        Symbol("pkg.m:C", rejects=("b",)),
        Symbol("pkg.m:C.meth", absent=True),
        Symbol("pkg.m:C.other"),
        Symbol("pkg.nomodule:X"),
    )
    assert len(problems) == 6, problems
    assert "not found" in problems[0] and "missing parameter(s) c" in problems[1]
    assert "has parameter(s) b" in problems[2] and "expects it to be gone" in problems[3]
    assert "not found" in problems[4] and "not found" in problems[5]


# ------------------------------------------------ required parameters and positional order


_EXEC_BEFORE = """
    class MultiprocExecutor:
        def set_kv_cache_layout(self, layout_name: str) -> None: ...
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, unique_reply_rank=None,
                           kv_output_aggregator=None): ...
"""
_EXEC_AFTER = """
    class MultiprocExecutor:
        def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None: ...
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, unique_reply_rank=None,
                           kv_output_aggregator=None, *, tag): ...
"""


def _exec_tree(tmp_path: Path, body: str) -> Path:
    return _tree(tmp_path, {"vllm/__init__.py": "", "vllm/v1/__init__.py": "", "vllm/v1/executor/__init__.py": "",
                            "vllm/v1/executor/multiproc_executor.py": body})


@pytest.mark.parametrize("probe", ["static", "live"])
def test_a_new_required_parameter_of_a_fingerprinted_callable_is_refused_naming_it(tmp_path, monkeypatch, probe):
    """vLLM 0.33.0 gave Executor.set_kv_cache_layout a required second parameter: the 0.29 adapter's
    fingerprint (which passes only layout_name) must refuse it by name, the 0.33 adapter's accept it;
    a required keyword-only parameter added to collective_rpc is refused the same way."""
    from speccompat.registry import by_name

    ex = "vllm.v1.executor.multiproc_executor:MultiprocExecutor"
    old = by_name("vllm_0_29_0").requires
    new = by_name("vllm_0_33_0").requires
    # Without its rejects=, so that the required-parameter rule alone has to refuse it.
    syms = [old[f"{ex}.set_kv_cache_layout"]._replace(rejects=()), old[f"{ex}.collective_rpc"],
            new[f"{ex}.set_kv_cache_layout"]]

    def problems(body: str, sub: str) -> list[str]:
        root = _exec_tree(tmp_path / sub, body)
        if probe == "static":
            return [str(m) for m in check_static(syms, root)]
        monkeypatch.syspath_prepend(str(root))
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            monkeypatch.delitem(sys.modules, name)
        return [str(m) for m in check_live(syms)]

    before = problems(_EXEC_BEFORE, "before")
    # Before: the 0.33 symbol misses its second parameter; the 0.29 ones match.
    assert len(before) == 1 and "missing parameter(s) cp_kv_cache_interleave_size" in before[0], before
    after = problems(_EXEC_AFTER, "after")
    assert len(after) == 2, after
    assert after[0].startswith(f"{ex}.set_kv_cache_layout: new required parameter(s) cp_kv_cache_interleave_size "
                               "that no caller passes"), after
    assert after[1].startswith(f"{ex}.collective_rpc: new required parameter(s) tag that no caller passes"), after


def test_positional_order_is_part_of_the_fingerprint(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/m.py": """
            def gather(dim, input_): ...
            def gather_ok(input_, dim=-1, *, async_op=False): ...
            def hasher(hash_block_size, caching_hash_fn): ...
            def one(layout_name, /): ...
            """,
    })
    problems = _problems(
        root,
        Symbol("pkg.m:gather", positional=("input_", "dim")),
        Symbol("pkg.m:gather_ok", positional=("input_", "dim")),
        Symbol("pkg.m:hasher", positional=("block_size|hash_block_size", "caching_hash_fn")),
        Symbol("pkg.m:one", positional=("layout_name", "cp")),
    )
    assert problems == [
        "pkg.m:gather: positional parameter 1 is dim, not input_; positional parameter 2 is input_, not dim "
        "(has: dim, input_)",
        "pkg.m:one: missing parameter(s) cp; takes 1 positional parameter(s), 2 are passed by position "
        "(has: layout_name)",
    ]


def test_fields_read_not_passed_do_not_count_as_required(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/m.py": """
            from dataclasses import dataclass, field, KW_ONLY
            @dataclass
            class Out:
                req_ids: list
                input_ids: object = None
                rows: list = field(default_factory=list)
                n: int = field()
                _: KW_ONLY
                flag: bool
            """,
    })
    assert _problems(root, Symbol("pkg.m:Out", accepts=("req_ids", "input_ids"), called=False)) == []
    assert _problems(root, Symbol("pkg.m:Out", accepts=("req_ids", "input_ids"))) == [
        "pkg.m:Out: new required parameter(s) n, flag that no caller passes (has: req_ids, input_ids, rows, n, flag)"]
    from speccompat.static_probe import signatures

    assert signatures(["pkg.m:Out"], root)["pkg.m:Out"].render() == "(req_ids, input_ids=, rows=, n, *, flag)"
