"""Test configuration.

Unit tests run anywhere (no torch, no vLLM). Tests marked ``engine`` need an environment built by
``scripts/mkenv.py`` (it writes ``speccompat-env.json`` into the venv): they are skipped elsewhere,
with that reason. ``SPECCOMPAT_TEST_NO_APPLY=1`` starts every engine without ``speccompat.apply()``,
to show that the engine tests fail without it.

Tests marked ``engine_full`` repeat, with engines of their own, what the gate proves another way
(e.g. speculators releases whose extraction modules are byte-identical to a neighbour's, checked
by hash) or scenarios whose parts the gate covers in one chain: they are deselected unless
``--engine-full`` is given (``nox -s engine_full``). Tests marked ``train_serve`` (extraction, draft
training and serving end to end, minutes of CPU) are deselected unless ``--train-serve`` is given
(``nox -s train_serve``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENV_FILE = Path(os.environ.get("SPECCOMPAT_ENV_FILE") or Path(sys.prefix) / "speccompat-env.json")
ENGINE_ENV = json.loads(ENV_FILE.read_text()) if ENV_FILE.exists() else None
NO_APPLY = os.environ.get("SPECCOMPAT_TEST_NO_APPLY") == "1"


def pytest_addoption(parser):
    parser.addoption("--engine-full", action="store_true",
                     help="also run the tests marked engine_full (what nox -s engine_full runs)")
    parser.addoption("--train-serve", action="store_true",
                     help="also run the tests marked train_serve (what nox -s train_serve runs)")


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_full: leaves the gate (scripts/test); runs with --engine-full")
    config.addinivalue_line("markers", "train_serve: extraction -> training -> serving, end to end; leaves the "
                            "gate; runs with --train-serve")
    if "SPECCOMPAT_CACHE_DIR" not in os.environ:  # the model identity's digests: not into the user's cache
        import tempfile

        os.environ["SPECCOMPAT_CACHE_DIR"] = config._speccompat_cache = tempfile.mkdtemp(prefix="speccompat-test-cache-")


def pytest_unconfigure(config):
    made = getattr(config, "_speccompat_cache", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for marker, option in (("engine_full", "--engine-full"), ("train_serve", "--train-serve")):
        if not config.getoption(option):
            out = [item for item in items if marker in item.keywords]
            if out:
                config.hook.pytest_deselected(items=out)
                items[:] = [item for item in items if marker not in item.keywords]
    if ENGINE_ENV is not None:
        return
    skip = pytest.mark.skip(
        reason=f"no real-vLLM environment ({ENV_FILE} missing): build one with scripts/mkenv.py "
        "and run pytest with its python"
    )
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)


def _bare_site(root: Path) -> Path:
    """A folder holding only speccompat and its runtime dependencies (symlinks), no vLLM/torch.

    Interpreters started with ``-S`` and this folder on ``PYTHONPATH`` see exactly what a fresh
    machine with ``pip install speccompat`` would see, whatever else this venv holds.
    """
    import packaging
    import wrapt

    site = root / "site"
    site.mkdir()
    for mod in (packaging, wrapt):  # the runtime dependencies (pyproject.toml), nothing else
        src = Path(mod.__file__).parent
        (site / src.name).symlink_to(src)
    pkg = site / "speccompat"
    pkg.mkdir()
    for f in (REPO / "speccompat").iterdir():
        if f.name != "__pycache__":
            (pkg / f.name).symlink_to(f)
    (pkg / "adapters").symlink_to(REPO / "adapters")
    dist = site / "speccompat-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speccompat\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nspeccompat = speccompat.plugin:register\n"
        "[console_scripts]\nspeccompat = speccompat.cli:main\n"
    )
    return site


@pytest.fixture(scope="session")
def bare_site(tmp_path_factory):
    return _bare_site(tmp_path_factory.mktemp("bare"))


@pytest.fixture
def py(bare_site):
    """Run code in a fresh interpreter that sees only speccompat, its deps and ``path``."""

    def run_python(code: str, *, path: list[Path] = (), env: dict[str, str] | None = None,
                   check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECCOMPAT_", "PYTHON"))}
        full_env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(bare_site)])
        full_env.update(env or {})
        proc = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, env=full_env, timeout=timeout, cwd=bare_site.parent)
        if check and proc.returncode != 0:
            raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run_python
