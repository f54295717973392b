"""``generate(token_ids, copy=False)`` on the real engine: views of the worker's shared-memory file,
equal to the copies, never overwritten while they live, and the file reused once they are gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import ENGINE_ENV, LAYER_IDS, mixed_sequences

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import speccompat
    speccompat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator
    from speccompat import transport

    ckpt, layer_ids, a, b = json.loads(sys.argv[1])
    gen = VllmHiddenStatesGenerator(ckpt, layer_ids=layer_ids, max_model_len=1024, gpu_memory_utilization=0.1)
    copies = gen.generate(a)
    views = gen.generate(a, copy=False)
    storages = {t.untyped_storage().data_ptr() for r in views for t in r["hidden_states"]}
    out = {
        "same_values": all(torch.equal(x, y) for r, s in zip(copies, views) for x, y in zip(r["hidden_states"], s["hidden_states"])),
        "view_storages": len(storages),
        "copy_storages": len({t.untyped_storage().data_ptr() for r in copies for t in r["hidden_states"]}),
        "busy_while_held": len(transport.busy()),
        "staged": sum(len(m) for m in transport._MAPPED.values()),
    }
    held = [t.clone() for r in views for t in r["hidden_states"]]
    other = gen.generate(b, copy=False)  # while `views` live: must land in another file
    out["intact_after_next_call"] = all(torch.equal(t, c) for t, c in zip((t for r in views for t in r["hidden_states"]), held))
    out["other_storage_differs"] = other[0]["hidden_states"][0].untyped_storage().data_ptr() not in storages
    out["busy_both"] = len(transport.busy())
    del views, other
    out["busy_after_drop"] = len(transport.busy())
    again = gen.generate(b, copy=False)
    out["files_after_reuse"] = sum(len(m) for m in transport._MAPPED.values())
    out["no_new_file"] = len(again[0]["hidden_states"]) == len(layer_ids)
    # The engine loop with one step in flight and with two, on a call that takes several steps.
    import os
    many = json.loads(sys.argv[2])
    runs = {}
    for depth in ("1", "2"):
        os.environ["SPECCOMPAT_IN_FLIGHT"] = depth
        res = gen.generate(many)
        runs[depth] = (res, dict(gen._speccompat_stats))
    (one, s1), (two, s2) = runs["1"], runs["2"]
    out["in_flight"] = [s1["in_flight"], s2["in_flight"]]
    out["steps"] = [s1["driver_steps"], s2["driver_steps"]]
    out["same_ids"] = all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(one, two)) and len(one) == len(two) == len(many)
    out["worst_rel"] = max(float((x.float() - y.float()).norm() / y.float().norm())
                           for r, q in zip(two, one) for x, y in zip(r["hidden_states"], q["hidden_states"]))
    print("RESULT " + json.dumps(out))
''')


def test_views_equal_the_copies_and_are_never_overwritten(engines, tmp_path):
    """... and the engine loop gives the same states with one step in flight as with two."""
    ckpt = engines.checkpoint("llama")
    # > transport.INLINE_LIMIT (4 MiB) per call, so that the states travel through shared memory
    a, b = mixed_sequences(12, seed=21, lo=200, hi=600), mixed_sequences(10, seed=22, lo=200, hi=600)
    path = os.pathsep.join(p for p in (ENGINE_ENV["speculators"]["0.4.0.1"], os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **ENGINE_ENV.get("engine_env", {}), "PYTHONPATH": path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    many = mixed_sequences(40, seed=23, lo=200, hi=600)  # more tokens than one step takes
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([str(ckpt), LAYER_IDS, a, b]), json.dumps(many)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    out = json.loads(line[7:])
    assert out["staged"] == 1 and out["same_values"], out
    assert out["view_storages"] == 1 and out["copy_storages"] == len(a) * len(LAYER_IDS), out
    assert out["busy_while_held"] == 1 and out["busy_both"] == 2 and out["busy_after_drop"] == 0, out
    assert out["intact_after_next_call"] and out["other_storage_differs"], out
    assert out["files_after_reuse"] == 2 and out["no_new_file"], out  # a free file was reused, none added
    assert out["in_flight"] == [1, 2] and min(out["steps"]) > 1 and out["same_ids"], out
    assert out["worst_rel"] <= 0.01, out  # the same prefill; only the steps' composition may differ
