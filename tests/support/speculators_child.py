"""Running test code against speculators' own code: a fresh interpreter per speculators version
(one speculators per interpreter), taken from the copies of a scripts/mkenv.py environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .engine_env import ENGINE_ENV

REPO = Path(__file__).resolve().parents[2]

needs_speculators = pytest.mark.skipif(ENGINE_ENV is None,
                                       reason="needs the speculators copies of a scripts/mkenv.py environment")


def run_child(code: str, args: list[str], speculators_path: str) -> subprocess.CompletedProcess:
    """``python -c code *args`` with the speculators copy at ``speculators_path`` and this repository
    importable; its output is captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([speculators_path, str(REPO)])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=300)


def run_with_speculators(code: str, tmp_path: Path, version: str) -> Any:
    """Run ``code`` (argv: ``tmp_path``, the tests directory, ``version``) with speculators ``version``
    (the test is skipped when this environment lacks it); it must succeed and print JSON on its last
    line, which is returned."""
    path = ENGINE_ENV["speculators"].get(version)
    if path is None:
        pytest.skip(f"speculators {version} is not in this environment")
    proc = run_child(code, [str(tmp_path), str(REPO / "tests"), version], path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
