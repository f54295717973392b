"""A release's GPU proof split into shards (speccompat.testing.proof): the split and the merge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from speccompat.testing.proof import merge, partition

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_partition_balances_engine_starts_and_keeps_groups_whole():
    groups = [("llama", 3.0), ("dsv3", 3.0), ("kimi", 3.2), ("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.1)]
    where = partition(groups, 4)
    assert set(where) == {k for k, _ in groups}  # every group in exactly one shard
    load = [sum(c for k, c in groups if where[k] == s) for s in range(4)]
    assert max(load) == 3.2 and min(load) >= 3.0  # the three big groups alone, the small ones together
    assert partition(list(reversed(groups)), 4) == where  # the same split whatever the order given


def test_partition_refuses_nonsense():
    with pytest.raises(ValueError, match="at least 1"):
        partition([("a", 1.0)], 0)
    with pytest.raises(ValueError, match="given twice"):
        partition([("a", 1.0), ("a", 2.0)], 2)


def _shard(tmp_path, k, cells, *, code="abc", vllm="0.34.0"):
    base = {"kind": "gpu-e2e", "vllm": vllm, "vllm_dist": "vllm", "torch": "2.14.0", "device": "NVIDIA H100",
            "tp": 1, "runner": "v2", "date": "2026-12-07", "applied": True, "code": {"hot_path_sha256": code}}
    (tmp_path / f"evidence-{k}.json").write_text(json.dumps({**base, "cells": cells}))
    (tmp_path / f"times-{k}.json").write_text(json.dumps({f"t{k}": {"seconds": 1.5 * k, "outcome": "passed"}}))
    (tmp_path / f"starts-{k}.json").write_text(json.dumps([{"kind": "llama", "start_s": 90.0 + k, "tests": [f"t{k}"]}]))


def test_merge_joins_the_shards_with_the_proofs_wall_time(tmp_path):
    shards = tmp_path / "s"
    shards.mkdir()
    _shard(shards, 1, [{"speculators": "0.3.0", "model": "llama", "outcome": "passed"}])
    _shard(shards, 2, [{"speculators": "0.4.0.1", "model": "qwen3", "outcome": "passed"}])
    (written,) = merge(shards, tmp_path / "out", 412.34)
    assert written.name == "vllm-0.34.0-tp1-v2-proof.json"
    doc = json.loads(written.read_text())
    assert doc["proof_wall_s"] == 412.3 and doc["shards"] == 2
    assert [(c["speculators"], c["model"]) for c in doc["cells"]] == [("0.3.0", "llama"), ("0.4.0.1", "qwen3")]
    assert doc["tests"] == {"t1": {"seconds": 1.5, "outcome": "passed"}, "t2": {"seconds": 3.0, "outcome": "passed"}}
    assert [s["start_s"] for s in doc["engine_starts"]] == [91.0, 92.0]
    assert doc["code"] == {"hot_path_sha256": "abc"}


def test_merge_refuses_shards_of_other_code_and_writes_nothing(tmp_path):
    shards = tmp_path / "s"
    shards.mkdir()
    _shard(shards, 1, [{"speculators": "0.3.0", "model": "llama", "outcome": "passed"}])
    _shard(shards, 2, [{"speculators": "0.3.0", "model": "qwen3", "outcome": "passed"}], code="def")
    with pytest.raises(ValueError, match="disagree on code"):
        merge(shards, tmp_path / "out", 100.0)
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "speccompat.testing.proof", "merge", str(empty), "--out",
                           str(tmp_path / "o2"), "--wall", "1"], capture_output=True, text=True)
    assert proc.returncode != 0 and "no shard wrote evidence" in proc.stderr


@pytest.mark.parametrize("entry", ["run", "run_native"])
def test_the_proofs_oracle_engines_get_a_fixed_kv_cache_and_others_vllms_default(monkeypatch, tmp_path, entry):
    """Side by side on one GPU, vLLM's memory profiling fails when another shard's engine frees memory: the
    proof gives vLLM's own engines (the oracles) a fixed KV cache; without the setting, vLLM sizes it."""
    import importlib.util
    import types

    from speccompat.testing import serving

    seen = []

    class Stop(Exception):
        pass

    def llm(**kw):
        seen.append(kw)
        raise Stop

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = llm, object
    ehs = types.ModuleType("ehs")
    for name, mod in {"vllm": vllm, "vllm.distributed": ehs, "vllm.distributed.kv_transfer": ehs,
                      "vllm.distributed.kv_transfer.kv_connector": ehs,
                      "vllm.distributed.kv_transfer.kv_connector.v1": ehs}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    ehs.example_hidden_states_connector = ehs
    if importlib.util.find_spec("torch") is None:  # run_native imports it before the engine (the torch-free run)
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(serving, "cpu_mla_rotary_fix", lambda model: {})  # reads vLLM's platform
    for value, want in (("", None), (str(2 << 30), 2 << 30)):
        monkeypatch.setenv(serving.ORACLE_KV_CACHE_ENV, value)
        with pytest.raises(Stop):
            getattr(serving, entry)(str(tmp_path), [1, 3], [[5, 6, 7]])
        assert seen[-1].get("kv_cache_memory_bytes") == want
        assert seen[-1]["gpu_memory_utilization"] == 0.1  # the rest as before
    script = (REPO_ROOT / "scripts" / "gpu" / "device_run.sh").read_text()
    proof = script.split("\n  proof)", 1)[1].split("\n    ;;", 1)[0]
    assert f"{serving.ORACLE_KV_CACHE_ENV}=$((2 << 30))" in proof
