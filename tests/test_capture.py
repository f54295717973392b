"""Worker-side capture logic against a fake runner and model (torch and vLLM importable, no engine).

Covers what an engine run cannot provoke on demand: chunks of one request over several steps,
batch orders that differ from the scheduler's, a preempted request recomputed from position 0,
a misattributed chunk, sequence-parallel token shards, dummy/warm-up steps and non-zero TP ranks.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="capture hooks torch modules")
pytest.importorskip("vllm", reason="capture imports vllm.distributed (engine environments have it)")

from speccompat.capture import WorkerCapture  # noqa: E402
from speccompat.errors import HiddenStatesError  # noqa: E402

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


class Base(torch.nn.Module):
    def __init__(self, n_layers: int, shard_from: int | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            Layer(k, shard=shard_from is not None and k >= shard_from) for k in range(n_layers))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden, residual = input_ids[:, None].float().repeat(1, HIDDEN), None
        for layer in self.layers:
            if residual is not None and hidden.shape[0] < positions.shape[0]:  # all-gather back
                hidden = torch.cat([hidden, hidden])[: positions.shape[0]]
                residual = torch.cat([residual, residual])[: positions.shape[0]]
            hidden, residual = layer(positions, hidden, residual)
        return hidden


class Runner:
    """The parts of vLLM's V1 model runner capture relies on."""

    def __init__(self, base: Base) -> None:
        self.model = types.SimpleNamespace(model=base)
        self.input_batch = types.SimpleNamespace(req_ids=[])
        self.prompts: dict[str, list[int]] = {}

    def execute_model(self, so, intermediate_tensors=None, dummy_run=False):
        order = so.order
        self.input_batch.req_ids = list(order)
        ids, pos = [], []
        for rid in order:
            start, n = so.starts[rid], so.num_scheduled_tokens[rid]
            ids += self.prompts[rid][start : start + n]
            pos += list(range(start, start + n))
        self.model.model.forward(torch.tensor(ids), torch.tensor(pos))


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


def make(layer_ids, n_layers=4, shard_from=None):
    runner = Runner(Base(n_layers, shard_from))
    worker = types.SimpleNamespace(model_runner=runner)
    cap = WorkerCapture(worker, layer_ids)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 3.0])
def test_all_finite_matches_isfinite(dtype, value):
    from speccompat.capture import all_finite

    t = torch.randn(64, 32).to(dtype)
    t[17, 5] = value
    assert all_finite(t) == bool(torch.isfinite(t).all())
