"""``speccompat doctor`` tells the truth with and without vLLM installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ENGINE_ENV
from fakes import write_fake_speculators


def test_doctor_without_vllm_says_so_and_fails(tmp_path, py):
    write_fake_speculators(tmp_path, "0.4.0.1")
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor']))", path=[tmp_path], check=False)
    assert proc.returncode == 1
    assert "vLLM        not installed" in proc.stdout
    assert "vLLM is not installed" in proc.stdout
    assert "worker plugin (vllm.general_plugins): registered -> speccompat.plugin:register" in proc.stdout
    assert "verdict: NOT supported" in proc.stdout


def test_doctor_json_without_anything(tmp_path, py):
    proc = py("import sys; from speccompat.cli import main; sys.exit(main(['doctor', '--json']))", path=[tmp_path],
              check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["supported"] is False
    assert report["packages"]["vllm"] is None and report["status"]["state"] == "unsupported"
    assert report["status"]["warnings"] == ["speculators is not installed; speccompat applied nothing"]


@pytest.mark.engine
def test_doctor_on_a_real_vllm_is_supported_and_lists_patches():
    env = {**os.environ, "PYTHONPATH": ENGINE_ENV["speculators"]["0.4.0.1"]}
    proc = subprocess.run([sys.executable, "-m", "speccompat", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report["status"]
    assert st["state"] == "active" and st["probe"] == "matched"
    assert st["vllm"]["raw"] == ENGINE_ENV["vllm"] and st["speculators"]["raw"] == "0.4.0.1"
    assert st["matrix_row"]["vllm"] == ENGINE_ENV["vllm"]
    states = {p["id"]: p["state"] for p in st["patches"]}
    assert states["generator.generate"] == "applied" and states["worker._speccompat_info"] == "applied"
    assert report["fingerprints"][st["adapter"]] == []
    assert sum(1 for mm in report["fingerprints"].values() if not mm) == 1, "fingerprint not unique"
    assert report["plugin"]["registered"] is True
