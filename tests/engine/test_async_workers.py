"""The capture with vLLM's asynchronous scheduling on in the workers (the capture path on CUDA from
vLLM 0.33.0, adapter ``vllm_0_33_0``) gives the states of the synchronous workers (GPU only: vLLM
turns asynchronous scheduling off on a CPU, and speccompat keeps it off there).

With it on, each worker hands a step's output copy to vLLM's output thread and takes the next step
at once (docs/benchmarks.md, the row "views with the workers' asynchronous scheduling"). The synchronous run gives
the scheduler config speculators' generator builds ``async_scheduling=False`` after the adapter
built it (nothing in vLLM or speccompat is changed), so one test shows, on the same checkpoint and
inputs: the same states both ways (the parity suite compares the capture path with transformers),
every step verified by the capture's own checks, the workers' config saying which way they ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import ENGINE_ENV, LAYER_IDS, mixed_sequences, skip_unless_model_runs

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import speccompat
    speccompat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator
    import speculators.data_generation.vllm_hidden_states_generator as gen_module

    ckpt, layer_ids, seqs, mode, out_path = json.loads(sys.argv[1])
    if mode == "sync":
        build = gen_module.SchedulerConfig  # speccompat's shim around vLLM's SchedulerConfig

        def scheduler_config(**kw):
            config = build(**kw)
            config.async_scheduling = False
            return config

        gen_module.SchedulerConfig = scheduler_config
    gen = VllmHiddenStatesGenerator(ckpt, layer_ids=layer_ids, max_model_len=1024, gpu_memory_utilization=0.1)
    res = gen.generate(seqs)
    stats = dict(gen._speccompat_stats)
    torch.save([[t.clone() for t in r["hidden_states"]] for r in res], out_path)
    print("RESULT " + json.dumps({
        "async_scheduling": bool(gen.executor.vllm_config.scheduler_config.async_scheduling),
        "ids": [r["input_ids"].tolist() for r in res], "stats": stats}))
''')


def run(kind: str, ckpt, seqs, mode: str, tmp_path) -> tuple[dict, list]:
    import torch

    path = os.pathsep.join(p for p in (ENGINE_ENV["speculators"]["0.4.0.1"], os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **ENGINE_ENV.get("engine_env", {}), "PYTHONPATH": path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    out_path = tmp_path / f"{kind}-{mode}.pt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([str(ckpt), LAYER_IDS, seqs, mode, str(out_path)])],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    return json.loads(line[7:]), torch.load(out_path)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_asynchronous_workers_give_the_synchronous_workers_states(engines, tmp_path, kind):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vLLM turns asynchronous scheduling off on a CPU (vllm/platforms/cpu.py): GPU only")
    from packaging.version import Version

    if Version(ENGINE_ENV["vllm"]).release < (0, 33):
        pytest.skip(f"vLLM {ENGINE_ENV['vllm']}: its adapter keeps the workers synchronous (asynchronous from 0.33.0)")
    skip_unless_model_runs(kind)
    ckpt = engines.checkpoint(kind)
    seqs = mixed_sequences(40, seed=31, lo=200, hi=600)  # several steps, some sequences in chunks
    sync, sync_states = run(kind, ckpt, seqs, "sync", tmp_path)
    asyn, async_states = run(kind, ckpt, seqs, "default", tmp_path)  # the capture path: asynchronous
    assert sync["async_scheduling"] is False and asyn["async_scheduling"] is True, (sync, asyn)
    assert asyn["ids"] == sync["ids"] == seqs
    for out in (sync, asyn):
        assert out["stats"]["unverified_steps"] == 0 and out["stats"]["driver_steps"] > 1, out["stats"]
    assert len(async_states) == len(sync_states) == len(seqs)
    worst, differing = 0.0, 0
    for a, s, seq in zip(async_states, sync_states, seqs, strict=True):
        assert len(a) == len(s) == len(LAYER_IDS)
        for x, y in zip(a, s, strict=True):
            assert x.shape == y.shape == (len(seq), x.shape[-1]) and x.dtype == y.dtype
            assert torch.isfinite(x.float()).all()
            differing += not torch.equal(x, y)
            worst = max(worst, float((x.float() - y.float()).norm() / y.float().norm()))
    # Not a cell of the matrix (the parity suite's are): the figures go to the test's output.
    print("async workers: " + json.dumps({
        "model": kind, "sequences": len(seqs), "tokens": sum(map(len, seqs)), "worst_rel": worst,
        "tensors": len(seqs) * len(LAYER_IDS), "tensors_differing": differing,
        "steps": [sync["stats"]["driver_steps"], asyn["stats"]["driver_steps"]]}))
    # The same scheduler builds the same steps from the same inputs: the same prefill either way.
    assert worst <= 1e-3, (worst, differing)
