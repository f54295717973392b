"""The fixed ``generate`` on a fake engine: what happens when a step fails (torch needed, no vLLM).

A failing step must not leave requests in the scheduler (they would hold KV blocks and be
scheduled again by the next call) nor captured states in the workers; the original error is the
one the caller sees.
"""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("torch", reason="generate builds tensors")

from speccompat import generator  # noqa: E402
from speccompat._state import STATE  # noqa: E402


class Req:
    def __init__(self, request_id, prompt_token_ids, **_):
        self.request_id, self.prompt_token_ids, self.status = request_id, prompt_token_ids, "waiting"
        self.num_prompt_tokens, self.num_computed_tokens = len(prompt_token_ids), 0

    def is_finished(self):
        return self.status != "waiting"


class Scheduler:
    def __init__(self):
        self.requests, self.finished = {}, []

    def add_request(self, req):
        self.requests[req.request_id] = req

    def schedule(self):
        return types.SimpleNamespace(total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in self.requests.values()))

    def update_from_output(self, so, output):
        raise AssertionError("not reached: the step failed")

    def finish_requests(self, ids, status):
        self.finished.append((list(ids), status))
        for i in ids:
            self.requests[i].status = status


class Executor:
    def __init__(self):
        self.rpcs = []

    def collective_rpc(self, method, **kw):
        self.rpcs.append(method)


class StepFailed(RuntimeError):
    pass


class Adapter:
    def name(self):
        return "fake"

    def in_flight(self, executor):
        return 2

    def submit(self, executor, so):
        raise StepFailed("the engine died in the middle of a step")


@pytest.fixture
def engine(monkeypatch):
    mod = types.ModuleType("fake_speculators_generator")
    mod.SamplingParams = lambda **kw: kw
    mod.Request = Req
    mod.RequestStatus = types.SimpleNamespace(FINISHED_ABORTED="aborted")

    class Gen:
        pass

    Gen.__module__ = mod.__name__
    mod.Gen = Gen
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(STATE, "adapter", Adapter())
    gen = Gen()
    model_config = types.SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100, get_hidden_size=lambda: 8)
    gen.vllm_config = types.SimpleNamespace(model_config=model_config)
    gen.tokenizer, gen.layer_ids = None, [1]
    gen.executor, gen.scheduler = Executor(), Scheduler()
    return gen


@pytest.mark.parametrize("mode", ["call", "stream"])
def test_a_failing_step_aborts_every_request_and_drops_the_capture(engine, monkeypatch, mode):
    from speccompat import streaming

    monkeypatch.setenv("SPECCOMPAT_GENERATE", mode)
    with pytest.raises(StepFailed, match="died in the middle"):
        generator.compat_generate(engine, [[1, 2, 3], [4, 5]])
    assert engine.scheduler.finished == [(["req_0_0", "req_0_1"], "aborted")]
    # before the call, and after the failure (dropping what the workers captured)
    assert engine.executor.rpcs == {"call": ["_reset_capture", "_reset_capture"],
                                    "stream": [streaming.begin, streaming.end]}[mode]
    assert all(r.is_finished() for r in engine.scheduler.requests.values())
    # the next call starts afresh with new request ids
    with pytest.raises(StepFailed):
        generator.compat_generate(engine, [[7]])
    assert engine.scheduler.finished[-1] == (["req_1_0"], "aborted")


def test_a_kv_cache_too_small_is_a_setting_not_a_transient_failure(engine):
    """Nothing can be scheduled: the error is its own type (the driver stops and names the setting
    instead of failing every sample and asking to re-run), with the longest sequence."""
    from speccompat.errors import HiddenStatesError, KVCacheTooSmall

    engine.scheduler.schedule = lambda: types.SimpleNamespace(total_num_scheduled_tokens=0)
    with pytest.raises(KVCacheTooSmall, match="2 remaining sequence.s. of up to 3 tokens: the KV cache is too small") as e:
        generator.compat_generate(engine, [[1, 2, 3], [4, 5]])
    assert isinstance(e.value, HiddenStatesError) and e.value.longest == 3
    assert "gpu_memory_utilization" in str(e.value)
    assert engine.scheduler.finished == [(["req_0_0", "req_0_1"], "aborted")]


@pytest.mark.parametrize(("device_type", "env", "mode"), [
    ("cuda", "", "stream"), ("cpu", "", "call"), (None, "", "call"),
    ("cuda", "call", "call"), ("cpu", "stream", "stream"),
])
def test_generate_runs_on_the_stream_by_default_on_gpus_only(engine, monkeypatch, device_type, env, mode):
    """The mode follows the engine's device type (from its configuration) unless SPECCOMPAT_GENERATE
    says otherwise; what the call then does shows it (the workers' first RPC)."""
    from speccompat import streaming

    monkeypatch.setenv("SPECCOMPAT_GENERATE", env)
    engine.vllm_config.device_config = types.SimpleNamespace(device_type=device_type)
    assert generator.generate_mode(generator._device_type(engine.vllm_config)) == mode
    with pytest.raises(StepFailed):
        generator.compat_generate(engine, [[1, 2, 3]])
    assert engine.executor.rpcs[0] == {"call": "_reset_capture", "stream": streaming.begin}[mode]


def test_a_bad_generate_mode_is_named(monkeypatch):
    monkeypatch.setenv("SPECCOMPAT_GENERATE", "fast")
    with pytest.raises(ValueError, match="SPECCOMPAT_GENERATE='fast'"):
        generator.generate_mode("cuda")
