"""Worker-side capture logic against a fake runner and model (torch and vLLM importable, no engine).

Covers what an engine run cannot provoke on demand: chunks of one request over several steps,
batch orders that differ from the scheduler's, a preempted request recomputed from position 0,
a misattributed chunk, sequence-parallel token shards, dummy/warm-up steps, non-zero TP ranks, a
multimodal model called with ``inputs_embeds`` (token ids read from the runner's buffer) and the
V2 runner's per-step batch. The release-specific reading is the real adapters' (``vllm_0_29_0``).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="capture hooks torch modules")
pytest.importorskip("vllm", reason="capture imports vllm.distributed (engine environments have it)")

from speccompat.capture import WorkerCapture  # noqa: E402
from speccompat.errors import DriftError, HiddenStatesError, UnsupportedError  # noqa: E402
from speccompat.registry import by_name  # noqa: E402

HIDDEN = 8


class Layer(torch.nn.Module):
    def __init__(self, k: int, shard: bool = False) -> None:
        super().__init__()
        self.k, self.shard = k, shard

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else residual
        out = (hidden * 0 + self.k, residual + positions[: hidden.shape[0], None].float())
        if self.shard:  # sequence parallel: this rank keeps the first half of the tokens
            n = (out[0].shape[0] + 1) // 2
            return out[0][:n], out[1][:n]
        return out


def declaring(adapter_name: str, **conventions: str):
    """The adapter ``adapter_name`` with the output conventions of this module's layer classes
    declared (class name -> convention), as an adapter module declares vLLM's."""
    real = by_name(adapter_name)
    extra = {f"{__name__}:{name}": conv for name, conv in conventions.items()}
    return type(real.__name__, (real,), {"__module__": real.__module__,
                                         "layer_outputs": {**real.layer_outputs, **extra}})()


ADAPTER = declaring("vllm_0_29_0", Layer="hidden+residual")


class Base(torch.nn.Module):
    def __init__(self, n_layers: int, shard_from: int | None = None, layer=None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            (layer or Layer)(k, shard=shard_from is not None and k >= shard_from) for k in range(n_layers))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if input_ids is None:  # multimodal: the runner embedded the tokens itself
            hidden, residual = inputs_embeds, None
        else:
            hidden, residual = input_ids[:, None].float().repeat(1, HIDDEN), None
        for layer in self.layers:
            if residual is not None and hidden.shape[0] < positions.shape[0]:  # all-gather back
                hidden = torch.cat([hidden, hidden])[: positions.shape[0]]
                residual = torch.cat([residual, residual])[: positions.shape[0]]
            out = layer(positions, hidden, residual)
            hidden, residual = (out[0], out[-1]) if isinstance(out, tuple) else (out, None)
        return hidden


class Runner:
    """The parts of vLLM's V1 model runner capture relies on. ``embeds``: call the model as vLLM
    calls multimodal ones, with ``inputs_embeds`` and ``input_ids=None``; the step's token ids
    then sit in the runner's ``input_ids`` buffer (``.gpu``), unless ``buffer`` is False."""

    def __init__(self, base: Base, embeds: bool = False, buffer: bool = True, device: str = "cpu") -> None:
        self.device = device
        self.model = types.SimpleNamespace(model=base)
        self.input_batch = types.SimpleNamespace(req_ids=[])
        self.prompts: dict[str, list[int]] = {}
        self.embeds = embeds
        if buffer:
            self.input_ids = types.SimpleNamespace(gpu=torch.zeros(64, dtype=torch.int32))

    def execute_model(self, so, intermediate_tensors=None, dummy_run=False):
        order = so.order
        self.input_batch.req_ids = list(order)
        ids, pos = [], []
        for rid in order:
            start, n = so.starts[rid], so.num_scheduled_tokens[rid]
            ids += self.prompts[rid][start : start + n]
            pos += list(range(start, start + n))
        ids_t = torch.tensor(ids, device=self.device)
        if not self.embeds:
            self.model.model.forward(ids_t, torch.tensor(pos, device=self.device))
            return
        if hasattr(self, "input_ids"):
            self.input_ids.gpu[: len(ids)] = ids_t
        embeds = ids_t[:, None].float().repeat(1, HIDDEN)
        self.model.model.forward(None, torch.tensor(pos), inputs_embeds=embeds)


def step(runner, order, chunks, new=()):
    """One scheduler step: ``chunks`` rid -> (start, n); ``new`` rids appear for the first time."""
    so = types.SimpleNamespace(
        order=order,
        starts={r: s for r, (s, _) in chunks.items()},
        num_scheduled_tokens={r: n for r, (_, n) in chunks.items()},
        total_num_scheduled_tokens=sum(n for _, n in chunks.values()),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, prompt_token_ids=runner.prompts[r]) for r in new],
    )
    runner.execute_model(so)


@pytest.fixture
def tp(monkeypatch):
    import vllm.distributed as dist

    group = types.SimpleNamespace(rank_in_group=0, world_size=1)
    monkeypatch.setattr(dist, "get_tp_group", lambda: group)
    monkeypatch.setattr(dist, "tensor_model_parallel_all_gather", lambda t, dim=0: torch.cat([t, t], dim))
    return group


def make(layer_ids, n_layers=4, shard_from=None, strict=False, **runner_kw):
    runner = Runner(Base(n_layers, shard_from), **runner_kw)
    worker = types.SimpleNamespace(model_runner=runner)
    cap = WorkerCapture(worker, layer_ids, adapter=ADAPTER, strict=strict)
    return runner, cap


def expected(prompt, layer):
    """What Base computes for one sequence, layer output hidden + residual."""
    ids = torch.tensor(prompt, dtype=torch.float32)
    pos = torch.arange(len(prompt), dtype=torch.float32)
    residual = ids[:, None].repeat(1, HIDDEN)
    for _k in range(layer + 1):
        residual = residual + pos[:, None]
    return residual + layer


def test_chunks_over_steps_in_runner_order_are_reassembled_per_request(tp):
    runner, cap = make([0, 3])
    runner.prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14]}
    cap.reset()
    step(runner, ["b", "a"], {"b": (0, 3), "a": (0, 2)}, new=["a", "b"])  # a is chunked
    step(runner, ["c", "a"], {"c": (0, 2), "a": (2, 3)}, new=["c"])  # runner order != request order
    out = cap.collect(["a", "b", "c"])
    assert out["lengths"] == [5, 3, 2] and out["stats"]["chunked"] == 1 and out["stats"]["steps"] == 2
    from speccompat.transport import unpack

    states = unpack(out["states"])
    for j, layer in enumerate([0, 3]):
        got = torch.split(states[j], out["lengths"])
        for rid, g in zip("abc", got, strict=True):
            assert torch.equal(g, expected(runner.prompts[rid], layer)), (rid, layer)


def _states_per_request(out):
    from speccompat.transport import unpack

    states = unpack(out["states"])
    return [torch.split(states[j], out["lengths"]) for j in range(states.shape[0])]


def test_states_placed_as_steps_end_equal_the_gathered_ones(tp):
    """With the call's layout (what speccompat's driver gives ``_reset_capture``), each step's rows
    are copied into the reply as the step ends; the reply equals the one gathered at the end."""
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14], "d": [15, 16, 17, 18]}
    outs = {}
    for placed in (False, True):
        runner, cap = make([0, 3])
        runner.prompts = prompts
        cap.reset(req_ids=list("abcd"), lengths=[5, 3, 2, 4]) if placed else cap.reset()
        step(runner, ["b", "a"], {"b": (0, 3), "a": (0, 2)}, new=["a", "b"])  # two runs: b, then a's head
        step(runner, ["a", "c", "d"], {"a": (2, 3), "c": (0, 2), "d": (0, 1)}, new=["c", "d"])  # one run
        step(runner, ["d"], {"d": (1, 3)})
        outs[placed] = cap.collect(list("abcd"))
        assert outs[placed]["stats"]["placed_steps"] == (3 if placed else 0)
    for j, layer in enumerate([0, 3]):
        for rid, g, h in zip("abcd", _states_per_request(outs[True])[j], _states_per_request(outs[False])[j],
                             strict=True):
            assert torch.equal(g, expected(prompts[rid], layer)) and torch.equal(g, h), (rid, layer)


class _GatedBuffer:
    """A staging file whose making waits for ``gate`` (a file that takes a while to make and pin)."""

    gate = None
    made = 0

    def __new__(cls, capacity):
        import speccompat.transport as transport

        assert cls.gate.wait(30), "the test never opened the gate"
        cls.made += 1
        return transport._Buffer.__wrapped__(capacity)


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning on the build thread needs a GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize("ready_after", [1, 3])
def test_a_staging_file_made_during_the_call_takes_the_steps_placed_so_far(tp, monkeypatch, ready_after, device):
    """A call that outgrows every staging file: the file is made on a thread while the steps run;
    steps that end before it is there wait on the device and are placed once it is (``ready_after``
    1: after the first step; 3: only at the end of the call, which then waits for it). The reply
    equals the gathered one, every step counts as placed, and the call waited for the file only where
    the steps did not cover it."""
    import threading

    import speccompat.transport as transport

    monkeypatch.setattr(transport, "INLINE_LIMIT", 0)
    monkeypatch.setattr(_GatedBuffer, "gate", threading.Event())
    monkeypatch.setattr(_GatedBuffer, "made", 0)
    _GatedBuffer.__wrapped__ = transport._Buffer
    monkeypatch.setattr(transport, "_Buffer", _GatedBuffer)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14], "d": [15, 16, 17, 18]}
    runner, cap = make([0, 3], device=device)
    runner.prompts = prompts
    cap.reset(req_ids=list("abcd"), lengths=[5, 3, 2, 4])
    steps = [(["b", "a"], {"b": (0, 3), "a": (0, 2)}, ["a", "b"]),
             (["a", "c", "d"], {"a": (2, 3), "c": (0, 2), "d": (0, 1)}, ["c", "d"]),
             (["d"], {"d": (1, 3)}, [])]
    for k, (order, chunks, new) in enumerate(steps, 1):
        step(runner, order, chunks, new=new)
        assert len(cap.plan.pending) == (k if k <= ready_after else 0)
        if k == ready_after and k < len(steps):
            _GatedBuffer.gate.set()
            cap.staging.build.join()
    if not _GatedBuffer.gate.is_set():
        threading.Timer(0.3, _GatedBuffer.gate.set).start()  # the call's end waits for the file
    out = cap.collect(list("abcd"))
    assert out["stats"]["placed_steps"] == 3 and "staging" in out["states"]
    assert out["stats"]["staging_made"] == 1 == _GatedBuffer.made
    assert cap.staging.pinned is (True if device == "cuda" else None)  # pinned on the build thread
    if ready_after == 3:  # it waited at the end for the file, which took the gate's 0.3 s on its thread
        assert out["stats"]["staging_made_s"] >= 0.2 and out["stats"]["staging_built_s"] >= 0.2
    else:  # made beside the steps: the call did not wait for it
        assert out["stats"]["staging_made_s"] < 0.1
    for j, layer in enumerate([0, 3]):
        for rid, g in zip("abcd", _states_per_request(out)[j], strict=True):
            assert torch.equal(g, expected(prompts[rid], layer)), (rid, layer)
    # the next call of the same size reuses the file: nothing made, nothing waited for
    cap.reset(req_ids=list("abcd"), lengths=[5, 3, 2, 4])
    for order, chunks, new in steps:
        step(runner, order, chunks, new=new)
        assert cap.plan.pending == []
    again = cap.collect(list("abcd"))
    assert again["stats"]["staging_made"] == 0 and again["states"]["staging"] == out["states"]["staging"]
    cap.detach()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies on a CUDA side stream need a GPU")
def test_placement_on_a_gpu_copies_into_the_pinned_staging_file_on_a_side_stream(tp, monkeypatch):
    import speccompat.transport as transport

    monkeypatch.setattr(transport, "INLINE_LIMIT", 0)  # tiny states, but through the staging file
    prompts = {f"r{i}": list(range(i, i + 50 + i)) for i in range(6)}
    rids, lengths = list(prompts), [len(p) for p in prompts.values()]
    runner, cap = make([0, 2], device="cuda")
    runner.prompts = prompts
    cap.reset(req_ids=rids, lengths=lengths)
    step(runner, rids[:4], {r: (0, len(prompts[r])) for r in rids[:4]}, new=rids[:4])
    step(runner, rids[4:], {"r4": (0, 20), "r5": (0, len(prompts["r5"]))}, new=rids[4:])
    step(runner, ["r4"], {"r4": (20, len(prompts["r4"]) - 20)})
    out = cap.collect(rids)
    assert out["stats"]["placed_steps"] == 3 and "staging" in out["states"] and cap.staging.pinned
    assert cap.plan is None  # collected: nothing of the call is left to wait for
    for j, layer in enumerate([0, 2]):
        for rid, g in zip(rids, _states_per_request(out)[j], strict=True):
            assert torch.equal(g, expected(prompts[rid], layer)), (rid, layer)
    cap.detach()


def test_placement_falls_back_to_the_gather_when_a_request_is_recomputed(tp):
    runner, cap = make([1, 2])
    runner.prompts = {"a": [5, 6, 7, 8], "b": [9, 10]}
    cap.reset(req_ids=["a", "b"], lengths=[4, 2])
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    step(runner, ["a", "b"], {"a": (0, 4), "b": (0, 2)}, new=["b"])  # a preempted, recomputed from 0
    out = cap.collect(["a", "b"])
    assert out["stats"]["restarted"] == 1 and out["stats"]["placed_steps"] == 0
    for j, layer in enumerate([1, 2]):
        for rid, g in zip("ab", _states_per_request(out)[j], strict=True):
            assert torch.equal(g, expected(runner.prompts[rid], layer)), (rid, layer)


def test_placed_states_with_non_finite_values_are_reported_as_gathered_ones(tp):
    outs = []
    for plan in ({}, {"req_ids": ["a", "b"], "lengths": [3, 3]}):
        runner, cap = make([1])
        runner.prompts = {"a": [5, 6, 7], "b": [8, 9, 10]}
        cap.reset(**plan)

        def poison(module, inputs, output):  # the layer itself yields inf at token 1 of b
            output[1][4, 2] = float("inf")

        runner.model.model.layers[1].register_forward_hook(poison, prepend=True)  # before the capture's
        step(runner, ["a", "b"], {"a": (0, 3), "b": (0, 3)}, new=["a", "b"])
        outs.append(cap.collect(["a", "b"]))
    assert outs[0]["nonfinite"] == outs[1]["nonfinite"] == {1: (4, 1)}


def test_a_screen_that_overflows_on_finite_states_is_cleared_by_the_exact_check(tp):
    """The per-step screen sums the states: finite values whose sum overflows flag the step, and the
    exact check then finds nothing, so the placed reply goes out with no non-finite report."""
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6, 7], "b": [8, 9, 10]}
    cap.reset(req_ids=["a", "b"], lengths=[3, 3])

    def huge(module, inputs, output):
        output[1][:, :] = 3e38  # finite in float32; eight of them in a row sum to inf

    runner.model.model.layers[1].register_forward_hook(huge, prepend=True)
    step(runner, ["a", "b"], {"a": (0, 3), "b": (0, 3)}, new=["a", "b"])
    assert cap.steps[0].inputs()[2]  # flagged by the screen
    out = cap.collect(["a", "b"])
    assert out["nonfinite"] == {} and out["stats"]["placed_steps"] == 1


def test_a_preempted_request_counts_only_its_recomputation(tp):
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6, 7, 8]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    step(runner, ["a"], {"a": (0, 4)})  # preempted, recomputed from the start
    out = cap.collect(["a"])
    assert out["stats"]["restarted"] == 1 and out["lengths"] == [4]


def test_a_chunk_at_the_wrong_position_raises_naming_the_request(tp):
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6, 7, 8]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    step(runner, ["a"], {"a": (3, 1)})  # skips position 2
    with pytest.raises(HiddenStatesError, match=r"request a, step 1: positions \[3\]... do not continue at 2"):
        cap.collect(["a"])


def test_tokens_of_another_sequence_are_detected(tp):
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6, 7], "b": [8, 9, 10]}
    cap.reset()
    step(runner, ["a", "b"], {"a": (0, 3), "b": (0, 3)}, new=["a", "b"])
    runner.input_batch.req_ids = ["b", "a"]  # what a wrong batch order would look like
    cap.steps[0].order = ["b", "a"]
    with pytest.raises(HiddenStatesError, match="token ids at positions 0..2 differ from its prompt"):
        cap.collect(["a", "b"])


def test_incomplete_requests_raise(tp):
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6, 7, 8]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    with pytest.raises(HiddenStatesError, match="request a: captured 2 of 4 prompt tokens"):
        cap.collect(["a"])


def test_steps_outside_a_call_are_ignored(tp):
    runner, cap = make([1])
    runner.prompts = {"w": [1, 2], "a": [5, 6]}
    step(runner, ["w"], {"w": (0, 2)}, new=["w"])  # warm-up: before _reset_capture
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    assert cap.collect(["a"])["lengths"] == [2]
    assert not cap.collecting and cap.steps == []


def test_sequence_parallel_shards_are_gathered(tp):
    tp.world_size = 2
    runner, cap = make([0, 2, 3], shard_from=2)
    runner.prompts = {"a": [5, 6, 7, 8, 9, 10]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 6)}, new=["a"])
    out = cap.collect(["a"])
    from speccompat.transport import unpack

    states = unpack(out["states"])
    assert states.shape == (3, 6, HIDDEN)  # every token, full width, despite the shards


def test_non_zero_tp_ranks_keep_nothing_and_reply_none(tp):
    tp.rank_in_group, tp.world_size = 1, 2
    runner, cap = make([1])
    runner.prompts = {"a": [5, 6]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    assert cap.steps[0].layers == {}
    assert cap.collect(["a"]) is None


def test_layer_ids_are_checked_and_attachments_come_off(tp):
    with pytest.raises(HiddenStatesError, match=r"layer ids \[4\] out of range: the model has 4 decoder layers"):
        make([1, 4])
    with pytest.raises(HiddenStatesError, match="duplicate layer ids"):
        make([1, 1])
    runner, cap = make([1])
    base = runner.model.model
    assert "forward" in vars(base) and "execute_model" in vars(runner)
    cap.detach()
    assert "forward" not in vars(base) and "execute_model" not in vars(runner)
    assert not base.layers[1]._forward_hooks


def test_inputs_embeds_steps_are_verified_from_the_runner_buffer(tp):
    runner, cap = make([0, 3], embeds=True)
    runner.prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}
    cap.reset()
    step(runner, ["b", "a"], {"b": (0, 3), "a": (0, 2)}, new=["a", "b"])
    step(runner, ["a"], {"a": (2, 3)})
    assert all(s.input_ids is not None for s in cap.steps)
    out = cap.collect(["a", "b"])
    assert out["lengths"] == [5, 3] and out["stats"]["unverified_steps"] == 0
    from speccompat.transport import unpack

    states = unpack(out["states"])
    for j, layer in enumerate([0, 3]):
        for rid, g in zip("ab", torch.split(states[j], out["lengths"]), strict=True):
            assert torch.equal(g, expected(runner.prompts[rid], layer)), (rid, layer)


def test_inputs_embeds_steps_with_a_wrong_batch_order_are_detected(tp):
    runner, cap = make([1], embeds=True)
    runner.prompts = {"a": [5, 6, 7], "b": [8, 9, 10]}
    cap.reset()
    step(runner, ["a", "b"], {"a": (0, 3), "b": (0, 3)}, new=["a", "b"])
    cap.steps[0].order = ["b", "a"]
    with pytest.raises(HiddenStatesError, match="token ids at positions 0..2 differ from its prompt"):
        cap.collect(["a", "b"])


def test_steps_whose_token_ids_cannot_be_read_are_counted_or_fail_when_strict(tp):
    runner, cap = make([1], embeds=True, buffer=False)
    runner.prompts = {"a": [5, 6, 7]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 2)}, new=["a"])
    step(runner, ["a"], {"a": (2, 1)})
    assert cap.collect(["a"])["stats"]["unverified_steps"] == 2
    runner, cap = make([1], embeds=True, buffer=False, strict=True)
    runner.prompts = {"a": [5, 6, 7]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 3)}, new=["a"])
    with pytest.raises(HiddenStatesError, match=r"step 0: its token ids could not be read .*\(strict mode\)"):
        cap.collect(["a"])


class RunnerV2(Runner):
    """vLLM's model runner V2: no input_batch; prepare_inputs() returns a fresh batch per step."""

    def __init__(self, base: Base) -> None:
        super().__init__(base, embeds=True, buffer=False)
        del self.input_batch

    def prepare_inputs(self, so, *args):
        ids = [t for rid in so.order for t in
               self.prompts[rid][so.starts[rid] : so.starts[rid] + so.num_scheduled_tokens[rid]]]
        return types.SimpleNamespace(req_ids=list(so.order), input_ids=torch.tensor(ids))

    def execute_model(self, so, intermediate_tensors=None, dummy_run=False):
        batch = self.prepare_inputs(so)
        pos = [p for rid in so.order for p in range(so.starts[rid], so.starts[rid] + so.num_scheduled_tokens[rid])]
        embeds = batch.input_ids[:, None].float().repeat(1, HIDDEN)
        self.model.model.forward(None, torch.tensor(pos), inputs_embeds=embeds)


def test_v2_runner_order_and_token_ids_come_from_its_per_step_batch(tp):
    runner = RunnerV2(Base(4))
    cap = WorkerCapture(types.SimpleNamespace(model_runner=runner), [2], adapter=ADAPTER)
    assert "prepare_inputs" in vars(runner)
    runner.prompts = {"a": [5, 6, 7, 8], "b": [9, 10]}
    cap.reset()
    step(runner, ["b", "a"], {"b": (0, 2), "a": (0, 4)}, new=["a", "b"])
    runner.execute_model(types.SimpleNamespace(order=["a"], starts={"a": 0}, num_scheduled_tokens={"a": 4}),
                         dummy_run=True)  # warm-up: not a step
    assert [s.order for s in cap.steps] == [["b", "a"]]
    out = cap.collect(["a", "b"])
    assert out["lengths"] == [4, 2] and out["stats"]["unverified_steps"] == 0
    cap.detach()
    assert "prepare_inputs" not in vars(runner)


def test_the_0_11_adapter_refuses_a_runner_without_input_batch_naming_the_symbol(tp):
    runner = RunnerV2(Base(4))
    with pytest.raises(DriftError) as e:
        WorkerCapture(types.SimpleNamespace(model_runner=runner), [2],
                      adapter=declaring("vllm_0_11_0", Layer="hidden+residual"))
    assert e.value.symbol == "vllm.v1.worker.gpu_input_batch:InputBatch.req_ids"


def test_the_0_34_adapter_captures_from_the_v2_runner_as_before(tp):
    runner = RunnerV2(Base(4))
    cap = WorkerCapture(types.SimpleNamespace(model_runner=runner), [1, 3],
                        adapter=declaring("vllm_0_34_0", Layer="hidden+residual"))
    runner.prompts = {"a": [5, 6, 7, 8], "b": [9, 10]}
    cap.reset()
    step(runner, ["b", "a"], {"b": (0, 2), "a": (0, 4)}, new=["a", "b"])
    out = cap.collect(["a", "b"])
    assert out["lengths"] == [4, 2] and out["stats"]["unverified_steps"] == 0
    from speccompat.transport import unpack

    states = unpack(out["states"])
    for j, layer in enumerate([1, 3]):
        for rid, g in zip("ab", torch.split(states[j], out["lengths"]), strict=True):
            assert torch.equal(g, expected(runner.prompts[rid], layer)), (rid, layer)


def test_the_0_34_adapter_refuses_a_v1_runner_naming_the_v2_runner(tp):
    runner = Runner(Base(4))  # has input_batch: the runner vLLM 0.34 no longer has
    with pytest.raises(DriftError) as e:
        WorkerCapture(types.SimpleNamespace(model_runner=runner), [2],
                      adapter=declaring("vllm_0_34_0", Layer="hidden+residual"))
    assert e.value.symbol == "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs"
    assert "not the V2 model runner" in str(e.value)


def test_a_step_over_an_extensible_kv_cache_fails_before_any_state_is_kept(tp):
    """vLLM 0.34 commits an extensible KV cache's blocks only from EngineCore, which speculators'
    engine does not run: a runner holding one must fail on its first step, with nothing collected."""
    runner = RunnerV2(Base(4))
    cap = WorkerCapture(types.SimpleNamespace(model_runner=runner), [2],
                        adapter=declaring("vllm_0_34_0", Layer="hidden+residual"))
    runner.prompts = {"a": [5, 6, 7]}
    runner.extensible_kv_cache = object()
    cap.reset()
    with pytest.raises(DriftError, match="extensible KV cache") as e:
        step(runner, ["a"], {"a": (0, 3)}, new=["a"])
    assert e.value.symbol == "vllm.config:CacheConfig.enable_extensible_kv_cache"
    assert cap.steps == []
    # the same runner without it captures
    del runner.extensible_kv_cache
    cap.reset()
    step(runner, ["a"], {"a": (0, 3)}, new=["a"])
    assert cap.collect(["a"])["lengths"] == [3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 3.0])
def test_all_finite_matches_isfinite(dtype, value):
    from speccompat.capture import all_finite

    t = torch.randn(64, 32).to(dtype)
    t[17, 5] = value
    assert all_finite(t) == bool(torch.isfinite(t).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 3.0, 6e4])
def test_the_screen_never_misses_a_non_finite_value(dtype, value):
    """maybe_nonfinite: False only when every value is finite; a flag on finite values only where
    the sum overflows (float16 is screened exactly)."""
    from speccompat.capture import maybe_nonfinite

    t = torch.ones(64, 32, dtype=dtype)
    t[17, 5] = value
    finite = bool(torch.isfinite(t).all())
    flag = bool(maybe_nonfinite(t))
    assert flag or finite
    if dtype == torch.float16 or not finite:
        assert flag == (not finite)



# --------------------------------------------------------------------------- output conventions


class PrefixSumLayer(Layer):
    """A layer of another output convention, as vLLM 0.33.0's Kimi-K3 decoder layers:
    ``(hidden_states, prefix_sum, residual)``. Summing its first two elements gives wrong states."""

    def forward(self, positions, hidden, residual):
        hidden, residual = super().forward(positions, hidden, residual)
        prefix_sum = residual * 0 + 100.0
        return hidden, prefix_sum, residual


def test_a_layer_of_an_undeclared_output_convention_is_refused_at_setup_naming_it(tp):
    runner = Runner(Base(4, layer=PrefixSumLayer))
    with pytest.raises(UnsupportedError) as e:
        WorkerCapture(types.SimpleNamespace(model_runner=runner), [1, 3], adapter=ADAPTER)
    msg = str(e.value)
    assert "model types.SimpleNamespace is refused" in msg
    assert f"{__name__}:PrefixSumLayer (layers [1, 3]) returns (hidden, prefix_sum, residual)" in msg
    assert "vllm_0_29_0" in msg
    assert not any(layer._forward_hooks for layer in runner.model.model.layers)  # nothing attached


def test_the_same_layer_is_captured_once_an_adapter_declares_its_convention(tp, monkeypatch):
    import speccompat.capture as capture

    # (hidden, prefix_sum, residual) -> hidden + residual: what the Kimi-K3 layers' stream is.
    conv = capture.Convention("hidden+prefix_sum+residual", 3, (), lambda out: out[0] + out[2], "test")
    monkeypatch.setitem(capture.CONVENTIONS, conv.name, conv)
    adapter = declaring("vllm_0_29_0", PrefixSumLayer=conv.name)
    runner = Runner(Base(4, layer=PrefixSumLayer))
    cap = WorkerCapture(types.SimpleNamespace(model_runner=runner), [1, 3], adapter=adapter)
    runner.prompts = {"a": [3, 4, 5]}
    cap.reset()
    step(runner, ["a"], {"a": (0, 3)}, new=["a"])
    from speccompat.transport import unpack

    states = unpack(cap.collect(["a"])["states"])
    assert states.shape == (2, 3, HIDDEN)
    for i, layer in enumerate([1, 3]):
        torch.testing.assert_close(states[i], expected([3, 4, 5], layer), rtol=0, atol=0)


def test_a_subclass_inherits_a_convention_only_with_its_forward(tp):
    class Same(Layer):
        pass

    assert ADAPTER.layer_convention(Same) == "hidden+residual"
    assert ADAPTER.layer_convention(PrefixSumLayer) is None  # overrides forward: must be declared


@pytest.mark.parametrize(("bad", "problem"), [
    (lambda h, r: (h, r, r), "expected a 2-tuple, got tuple(Tensor[3, 8], Tensor[3, 8], Tensor[3, 8])"),
    (lambda h, r: h, "expected a 2-tuple, got Tensor[3, 8]"),
    (lambda h, r: (h, r[:, :4]), "element 1 is not [3, 8]: tuple(Tensor[3, 8], Tensor[3, 4])"),
    (lambda h, r: (h[None], r), "element 0 is not a [tokens, hidden] tensor: tuple(Tensor[1, 3, 8], Tensor[3, 8])"),
])
def test_a_declared_layer_whose_output_changes_structure_fails_loudly(tp, bad, problem):
    class Drifted(Layer):
        def forward(self, positions, hidden, residual):
            out = super().forward(positions, hidden, residual)
            return bad(*out) if self.k == 2 else out  # the hooked layer

    adapter = declaring("vllm_0_29_0", **{"test_a_declared_layer_whose_output_changes_structure_fails_loudly"
                                          ".<locals>.Drifted": "hidden+residual"})
    runner = Runner(Base(4, layer=Drifted))
    runner.model.model.config = types.SimpleNamespace(hidden_size=HIDDEN)
    cap = WorkerCapture(types.SimpleNamespace(model_runner=runner), [2], adapter=adapter)
    assert cap.hidden_size == HIDDEN
    runner.prompts = {"a": [3, 4, 5]}
    cap.reset()
    with pytest.raises(HiddenStatesError) as e:
        step(runner, ["a"], {"a": (0, 3)}, new=["a"])
    assert f"decoder layer 2 ({__name__}:test_a_declared" in str(e.value)
    assert "'hidden+residual'" in str(e.value) and problem in str(e.value)


def test_every_declared_convention_exists():
    from speccompat.capture import CONVENTIONS
    from speccompat.registry import all_adapters

    for adapter in all_adapters():
        assert adapter.layer_outputs, adapter.name()
        unknown = {p: c for p, c in adapter.layer_outputs.items() if c is not None and c not in CONVENTIONS}
        assert unknown == {}, adapter.name()
