"""speculators >= 0.5's own training data loader (``ArrowDataset``), from the released wheels.

The wheels are taken from ``.envs/trainer-wheels/`` (``scripts/mkenv.py`` downloads them there when it
builds an environment); when absent, ``pip download --no-deps`` fetches them into that folder, and the
test is skipped, saying why, when that fails (no network). Each is unpacked once beside its wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".envs" / "trainer-wheels"
#: speculators version -> the wheels its training data loader needs
TRAINERS = {"0.6.0": ["speculators==0.6.0"], "0.9.0": ["speculators==0.9.0", "hs-connectors==0.9.0"]}

#: Imports ``speculators.train.data`` without running the packages' ``__init__`` modules when the
#: real import fails: they import the model zoo (transformers model classes), which the data loader
#: does not use and which need not import on this environment's transformers.
IMPORT_LOADER = '''
import importlib, sys, types
def import_loader(root):
    try:
        return importlib.import_module("speculators.train.data")
    except Exception as exc:
        print(f"speculators' package import failed ({type(exc).__name__}: {exc}); importing the loader alone",
              file=sys.stderr)
    for name in [m for m in sys.modules if m == "speculators" or m.startswith("speculators.")]:
        del sys.modules[name]
    for pkg in ("speculators", "speculators.train", "speculators.data_generation"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = mod
    return importlib.import_module("speculators.train.data")
'''


def _wheel_dir(req: str) -> Path:
    name, version = req.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    target = CACHE / f"{name}-{version}"
    if (target / ".unpacked").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"{stem}*.whl"))
    if not wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(CACHE), req],
                              capture_output=True, text=True, timeout=300)
        wheels = sorted(CACHE.glob(f"{stem}*.whl"))
        if not wheels:
            pytest.skip(f"the {req} wheel is not in {CACHE} and `pip download` failed: "
                        f"{(proc.stderr or proc.stdout).strip()[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(target)
    (target / ".unpacked").write_text(wheels[-1].name)
    return target


def trainer_path(version: str) -> list[str]:
    """sys.path entries holding speculators ``version``'s wheel (and what its loader needs)."""
    pytest.importorskip("datasets", reason="speculators' ArrowDataset needs `datasets` (speccompat[arrow])")
    return [str(_wheel_dir(req)) for req in TRAINERS[version]]


def run_trainer_child(code: str, version: str, args: list[str], extra_path: list[str] = ()) -> Any:
    """Run ``code`` in a fresh interpreter with speculators ``version`` importable (``import_loader``
    defined, argv: the speculators root, then ``args``; ``extra_path`` also on its path); it must
    print JSON on its last line."""
    paths = trainer_path(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO), str(REPO / "tests"), *extra_path])}
    proc = subprocess.run([sys.executable, "-c", IMPORT_LOADER + code, paths[0], *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
