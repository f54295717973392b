"""scripts/mkenv.py: which releases' CPU engines need libraries preloaded, and the error without them."""

from __future__ import annotations

import importlib.util
import subprocess
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
