"""The generator's engine loop (``generator.run_steps``) on a fake scheduler and executor (no vLLM).

The fakes keep the rules of vLLM's own ``Scheduler`` that the loop relies on: ``schedule()``
advances ``num_computed_tokens`` when it schedules (chunked prefill under a token budget, a cap on
running requests, KV room for a few requests), ``update_from_output`` finishes a request when its
step sampled a token (``max_tokens=1``), and the ids of finished requests reach the workers with the
next scheduled step. The executor answers in submission order, like ``MultiprocExecutor``'s futures,
and checks what a worker would: every prompt token once, chunks in order, one step at a time.
"""

from __future__ import annotations

import types

import pytest

from speccompat import generator
from speccompat.errors import HiddenStatesError


class Req:
    def __init__(self, rid: str, n: int) -> None:
        self.rid, self.num_prompt_tokens, self.num_computed_tokens, self.done = rid, n, 0, False

    def is_finished(self) -> bool:
        return self.done


class Scheduler:
    def __init__(self, lengths: list[int], budget: int, max_running: int, kv_room: int, events: list) -> None:
        self.requests = {f"r{i}": Req(f"r{i}", n) for i, n in enumerate(lengths)}
        self.waiting = list(self.requests)
        self.running: list[str] = []
        self.budget, self.max_running, self.kv_room = budget, max_running, kv_room
        self.finished_ids: set[str] = set()
        self.events, self.step, self.updated = events, 0, []

    def schedule(self) -> types.SimpleNamespace:
        left, scheduled, chunk_end = self.budget, {}, {}
        for rid in self.running:  # running first, like vLLM
            q = self.requests[rid]
            n = min(q.num_prompt_tokens - q.num_computed_tokens, left)
            if n > 0:
                scheduled[rid], left = n, left - n
        while self.waiting and left > 0 and len(self.running) < min(self.max_running, self.kv_room):
            rid = self.waiting.pop(0)
            self.running.append(rid)
            n = min(self.requests[rid].num_prompt_tokens, left)
            scheduled[rid], left = n, left - n
        for rid, n in scheduled.items():
            q = self.requests[rid]
            chunk_end[rid] = (q.num_computed_tokens, q.num_computed_tokens + n)
            q.num_computed_tokens += n
        so = types.SimpleNamespace(id=self.step, total_num_scheduled_tokens=sum(scheduled.values()),
                                   chunks=chunk_end, finished_req_ids=set(self.finished_ids))
        self.finished_ids.clear()
        self.step += 1
        self.events.append(("schedule", so.id, so.total_num_scheduled_tokens))
        return so

    def update_from_output(self, so: types.SimpleNamespace, output: dict) -> None:
        assert output["step"] == so.id, "an output given to another step"
        self.updated.append(so.id)
        self.events.append(("update", so.id))
        for rid in output["sampled"]:
            q = self.requests[rid]
            q.done = True
            self.running.remove(rid)
            self.finished_ids.add(rid)


class Future:
    def __init__(self, executor: Executor, so: types.SimpleNamespace) -> None:
        self.executor, self.so, self.value = executor, so, None

    def result(self) -> dict:
        while self.value is None:  # answers come in order: run everything submitted before
            self.executor.run(self.executor.pending.pop(0))
        return self.value


class Executor:
    """One worker: runs steps one at a time, in the order they were sent."""

    def __init__(self, lengths: list[int], events: list) -> None:
        self.lengths = {f"r{i}": n for i, n in enumerate(lengths)}
        self.seen = {rid: 0 for rid in self.lengths}  # prompt tokens computed per request
        self.told_finished: set[str] = set()
        self.pending: list[Future] = []
        self.events, self.empty_steps = events, 0

    def submit(self, so: types.SimpleNamespace) -> Future:
        fut = Future(self, so)
        self.pending.append(fut)
        self.events.append(("submit", so.id))
        return fut

    def run(self, fut: Future) -> None:
        so = fut.so
        self.told_finished |= so.finished_req_ids
        self.empty_steps += not so.total_num_scheduled_tokens
        sampled = []
        for rid, (start, end) in so.chunks.items():
            assert start == self.seen[rid], f"{rid}: chunk {start}-{end} after {self.seen[rid]} tokens"
            self.seen[rid] = end
            if end == self.lengths[rid]:
                sampled.append(rid)
        fut.value = {"step": so.id, "sampled": sampled}


class Adapter:
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def in_flight(self, executor: Executor) -> int:
        return self.depth

    def submit(self, executor: Executor, so: types.SimpleNamespace) -> Future:
        return executor.submit(so)


def run(lengths: list[int], depth: int, budget: int = 100, max_running: int = 8, kv_room: int = 8):
    events: list = []
    sched = Scheduler(lengths, budget, max_running, kv_room, events)
    ex = Executor(lengths, events)
    steps, used = generator.run_steps(Adapter(depth), ex, sched, list(sched.requests))
    return steps, used, sched, ex, events


LENGTHS = [30, 250, 70, 5, 120, 64, 99, 1, 180, 40]


@pytest.mark.parametrize("depth", [1, 2])
def test_every_prompt_token_runs_once_in_order_and_every_request_finishes(depth):
    steps, used, sched, ex, _ = run(LENGTHS, depth)
    assert used == depth
    assert ex.seen == dict(zip(sched.requests, LENGTHS, strict=True))
    assert all(q.done for q in sched.requests.values())
    assert sched.updated == list(range(sched.step))  # each step's output given once, in order
    assert steps == sched.step - ex.empty_steps == -(-sum(LENGTHS) // 100)  # full budget every step
    # Finished ids reach the workers with a later step; only the last step's are still held.
    assert ex.told_finished | sched.finished_ids == set(sched.requests)
    assert ex.told_finished.isdisjoint(sched.finished_ids)


def test_one_in_flight_collects_each_step_before_scheduling_the_next():
    *_, events = run(LENGTHS, 1)
    kinds = [e[0] for e in events]
    assert kinds == ["schedule", "submit", "update"] * (len(kinds) // 3)


def test_two_in_flight_schedule_and_send_the_next_step_while_one_runs():
    *_, sched, ex, events = run(LENGTHS, 2)
    order = {e[:2]: i for i, e in enumerate(events)}
    overlapped = [k for k in range(sched.step - 1) if order[("submit", k + 1)] < order[("update", k)]]
    assert len(overlapped) >= sched.step - 2  # every step but the last ones is sent ahead
    pending = 0
    for kind, *_ in events:  # never more than two steps submitted and not collected
        pending += {"submit": 1, "update": -1}.get(kind, 0)
        assert 0 <= pending <= 2


def test_a_full_kv_cache_sends_an_empty_step_that_carries_the_finished_ids():
    # Room for two requests at a time: the step after both are scheduled has nothing to run until
    # one finishes, but it still runs (it tells the workers which requests finished).
    steps, _, sched, ex, events = run([50, 50, 50, 50, 50], 2, budget=100, kv_room=2)
    assert all(q.done for q in sched.requests.values())
    assert ex.seen == {f"r{i}": 50 for i in range(5)}
    assert ex.empty_steps >= 1 and steps == sched.step - ex.empty_steps
    assert ex.told_finished | sched.finished_ids == set(sched.requests)


def test_sequences_that_never_fit_are_an_error_not_a_hang():
    with pytest.raises(HiddenStatesError, match="could not schedule 3 remaining"):
        run([10, 10, 10], 2, kv_room=0)


def test_the_depth_can_be_set_in_the_environment(monkeypatch):
    monkeypatch.setenv("SPECCOMPAT_IN_FLIGHT", "1")
    *_, events = run(LENGTHS, 2)
    assert [e[0] for e in events][:6] == ["schedule", "submit", "update"] * 2
    monkeypatch.setenv("SPECCOMPAT_IN_FLIGHT", "0")
    with pytest.raises(ValueError, match="SPECCOMPAT_IN_FLIGHT='0'"):
        run(LENGTHS, 2)
