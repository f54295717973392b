"""vLLM's worker processes run speccompat (re-applied by the vllm.general_plugins entry point), and
the driver says so. vLLM's CPU platform always starts workers with spawn (vllm/platforms/cpu.py
sets VLLM_WORKER_MULTIPROC_METHOD=spawn), the harder case: nothing of the driver's patching is
inherited. fork is covered with real processes in tests/test_plugin.py. On the CPU platform the
shared default engine is that case already (it serves the other tests of its engine too); on CUDA
the test asks for spawn."""

from __future__ import annotations

import pytest

from speccompat.testing.parity import measure, violations

from .conftest import LAYER_IDS, mixed_sequences

pytestmark = pytest.mark.engine


@pytest.mark.pool
def test_spawned_workers_are_patched(engines, references):
    import torch

    spawn = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if torch.cuda.is_available() else None
    host = engines.get("0.4.0.1", "llama", env=spawn)
    seqs = mixed_sequences(4, seed=21, lo=20, hi=120)
    results = host.generate(seqs)["results"]
    ref32, ref16 = references("llama")
    assert not violations(measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                                  [ref16.hidden_states(s, LAYER_IDS) for s in seqs]))
    status = host.status()
    worker = {p["id"]: p for p in status["patches"] if p["id"].startswith("worker.")}
    assert worker and all(p["state"] == "applied" for p in worker.values())
    assert "in the worker processes" in worker["worker._setup_hidden_states_capture"]["reason"]
    (info,) = status["workers"]
    assert info["adapter"] == status["adapter"]
    assert info["start_method"] == "spawn", info
    assert "workers patched: pid" in host.log()
