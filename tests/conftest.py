"""Test configuration.

Unit tests run anywhere (no torch, no vLLM). Tests marked ``engine`` need an environment built by
``scripts/mkenv.py`` (it writes ``speccompat-env.json`` into the venv): they are skipped elsewhere,
with that reason. ``SPECCOMPAT_TEST_NO_APPLY=1`` starts every engine without ``speccompat.apply()``,
to show that the engine tests fail without it.

``pytest --proof`` selects a release's GPU proof (:data:`PROOF`, ``scripts/gpu/device_run.sh proof``)
and ``--shard K/N`` keeps the K-th of N shards of the selected tests, each group of tests that share
an engine whole (speccompat.testing.proof): the shards run side by side. ``SPECCOMPAT_TEST_TIMES_OUT``
names a file that gets each test's seconds and outcome; ``SPECCOMPAT_TEST_TORCH_THREADS`` bounds the
torch threads of the test process (several shards share the machine's cores).

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
from support.engine_env import ENGINE_ENV, ENV_FILE, pool_key

REPO = Path(__file__).resolve().parent.parent


#: The tests of a release's GPU proof (``--proof``), by file: ``"all"`` of them, ``"gate"`` (those the
#: gate runs: a line's older speculators release is proven by source identity, not its own engines),
#: or the tests of these tiny checkpoints (``kind``). Besides, every test marked ``gpu`` (a CUDA path of
#: the capture without an engine). Parity and silent bugs for Llama and DeepseekV3, Kimi-K2.5 bf16 and
#: INT4 with its planted bugs, the serving-path and native-extraction oracles, Qwen3.
PROOF_KINDS = ("llama", "qwen3", "deepseek_v3", "kimi_k25")
PROOF = {
    "tests/engine/test_parity.py": "gate",
    "tests/engine/test_silent_bugs.py": "all",
    "tests/engine/test_int4.py": "all",
    "tests/engine/test_serving_path.py": PROOF_KINDS,
    "tests/engine/test_native_extract.py": PROOF_KINDS,
    "tests/engine/test_architectures.py": ("qwen3",),
}


def in_proof(item) -> bool:
    if item.get_closest_marker("gpu"):
        return True
    rule = PROOF.get(Path(str(item.fspath)).resolve().relative_to(REPO).as_posix())
    if rule is None:
        return False
    if rule == "all":
        return True
    if rule == "gate":
        return "engine_full" not in item.keywords
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return params.get("kind") in rule


def shard(items: list, k: int, n: int) -> list:
    """The items of shard ``k`` (1-based) of ``n``: groups sharing a pool engine stay whole, each
    costing one engine start plus the engines its tests start themselves (marker ``own_engines``); a
    test outside the pool costs what it starts, at least a tenth of an engine (its imports)."""
    from speccompat.testing.proof import partition

    groups: dict[str, float] = {}
    key_of = {}
    for item in items:
        key = pool_key(item)
        key = repr(key) if key is not None else item.nodeid
        mark = item.get_closest_marker("own_engines")
        own = float(mark.args[0]) if mark else 0.0
        groups[key] = groups.get(key, 1.0 if key != item.nodeid else 0.1) + own
        key_of[item.nodeid] = key
    where = partition(groups.items(), n)
    return [item for item in items if where[key_of[item.nodeid]] == k - 1]


def pytest_addoption(parser):
    parser.addoption("--engine-full", action="store_true",
                     help="also run the tests marked engine_full (what nox -s engine_full runs)")
    parser.addoption("--train-serve", action="store_true",
                     help="also run the tests marked train_serve (what nox -s train_serve runs)")
    parser.addoption("--proof", action="store_true",
                     help="select a release's GPU proof (PROOF in tests/conftest.py; scripts/gpu/device_run.sh proof)")
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="keep the K-th of N shards of the selected tests (groups sharing an engine stay whole)")


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_full: leaves the gate (scripts/test); runs with --engine-full")
    config.addinivalue_line("markers", "train_serve: extraction -> training -> serving, end to end; leaves the "
                            "gate; runs with --train-serve")
    config.addinivalue_line("markers", "gpu: a CUDA path without an engine; part of the GPU proof (--proof)")
    config.addinivalue_line("markers", "own_engines(n): engines the test starts itself, besides the pool's "
                            "(what --shard balances)")
    threads = os.environ.get("SPECCOMPAT_TEST_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    if "SPECCOMPAT_CACHE_DIR" not in os.environ:  # the model identity's digests: not into the user's cache
        import tempfile

        os.environ["SPECCOMPAT_CACHE_DIR"] = config._speccompat_cache = tempfile.mkdtemp(prefix="speccompat-test-cache-")


def pytest_unconfigure(config):
    made = getattr(config, "_speccompat_cache", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def _deselect(config, items, keep) -> None:
    out = [item for item in items if not keep(item)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if keep(item)]


@pytest.hookimpl(trylast=True)  # after tests/engine/conftest.py has put each engine's tests together
def pytest_collection_modifyitems(config, items):
    proof = config.getoption("--proof")
    if proof:
        _deselect(config, items, in_proof)
    for marker, option in (("engine_full", "--engine-full"), ("train_serve", "--train-serve")):
        if not config.getoption(option):
            _deselect(config, items, lambda item, m=marker: m not in item.keywords or (proof and m == "engine_full"))
    if config.getoption("--shard"):
        k, _, n = config.getoption("--shard").partition("/")
        if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
            raise pytest.UsageError(f"--shard {config.getoption('--shard')}: expected K/N with 1 <= K <= N")
        mine = {item.nodeid for item in shard(items, int(k), int(n))}
        _deselect(config, items, lambda item: item.nodeid in mine)
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


#: nodeid -> {"seconds": setup + call + teardown, "outcome": of the call (or of the setup that stopped it)}
TIMES: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    out = os.environ.get("SPECCOMPAT_TEST_TIMES_OUT")
    if not out:
        return
    t = TIMES.setdefault(report.nodeid, {"seconds": 0.0, "outcome": None})
    t["seconds"] = round(t["seconds"] + report.duration, 3)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        t["outcome"] = report.outcome
    if report.when == "teardown":  # after every test: a run stopped at its time limit keeps what ran
        tmp = Path(f"{out}.partial")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(TIMES, indent=1) + "\n")
        tmp.replace(out)


@pytest.fixture(autouse=True)
def _start_method_kept():
    """A test that runs ``speccompat extract`` in this process sets multiprocessing's start method to
    spawn (:func:`speccompat.dataset.extract.use_spawn`); put back what was there, so that a process
    pool of a later test starts its children the way it would alone."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    yield
    if multiprocessing.get_start_method(allow_none=True) != before:
        multiprocessing.set_start_method(before, force=True)


@pytest.fixture
def world(tmp_path):
    """(root, a fake model, its prepared data, the data's samples): 10 random records and 12 with
    hostile ids (tests/support/dataset_runs.HOSTILE)."""
    from support.dataset_fakes import jsonl, model_dir, random_records
    from support.dataset_runs import HOSTILE, scan

    model = model_dir(tmp_path)
    records = random_records(10) + [{"id": i, "input_ids": [5, 6, 7, k + 4]} for k, i in enumerate(HOSTILE[:12])]
    data = jsonl(tmp_path / "data.jsonl", records)
    return tmp_path, model, data, scan(data)
