"""``generator.stream`` and ``generate()`` on top of it, on a fake engine (no vLLM).

The fakes keep the rules of vLLM that the stream relies on: the scheduler admits waiting requests
under a token budget and a cap on running ones (chunked prefill), finishes a request when its step
sampled (``max_tokens=1``) and forgets it; the executor answers steps and RPCs in the order they
were sent, and its one worker is speccompat's own capture (``WorkerCapture`` with its real
``reset``/``collect`` and staging files), fed each step's states. A layer's state of a token is a
function of (token id, position, layer), so every delivered row can be checked against its input.
"""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from speccompat import capture, generator, transport  # noqa: E402
from speccompat._state import STATE  # noqa: E402
from speccompat.adapter import Done  # noqa: E402
from speccompat.errors import HiddenStatesError  # noqa: E402

HIDDEN, LAYERS, VOCAB = 8, [1, 3], 1000


def expected(seq: list[int], layer: int) -> torch.Tensor:
    pos = torch.arange(len(seq), dtype=torch.float32)[:, None]
    tok = torch.tensor(seq, dtype=torch.float32)[:, None]
    return tok + pos / 1024 + layer * 100 + torch.arange(HIDDEN, dtype=torch.float32) / 16


class Req:
    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.ids, self.num_prompt_tokens, self.num_computed_tokens = rid, ids, len(ids), 0
        self.done = False

    def is_finished(self) -> bool:
        return self.done


class Scheduler:
    def __init__(self, budget: int, max_running: int, events: list) -> None:
        self.requests: dict[str, Req] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.budget, self.max_running, self.events, self.step = budget, max_running, events, 0
        self.finished_ids: set[str] = set()

    def add_request(self, request: types.SimpleNamespace) -> None:
        self.requests[request.request_id] = Req(request.request_id, list(request.prompt_token_ids))
        self.waiting.append(request.request_id)
        self.events.append(("add", request.request_id))

    def schedule(self) -> types.SimpleNamespace:
        left, scheduled = self.budget, {}
        for rid in self.running:
            q = self.requests[rid]
            if (n := min(q.num_prompt_tokens - q.num_computed_tokens, left)) > 0:
                scheduled[rid], left = n, left - n
        while self.waiting and left > 0 and len(self.running) < self.max_running:
            rid = self.waiting.pop(0)
            self.running.append(rid)
            scheduled[rid] = n = min(self.requests[rid].num_prompt_tokens, left)
            left -= n
        chunks, new = {}, {}
        for rid, n in scheduled.items():
            q = self.requests[rid]
            if q.num_computed_tokens == 0:
                new[rid] = q.ids
            chunks[rid] = (q.num_computed_tokens, q.num_computed_tokens + n, q.ids)
            q.num_computed_tokens += n
            self.events.append(("scheduled", rid))
        so = types.SimpleNamespace(id=self.step, total_num_scheduled_tokens=sum(scheduled.values()),
                                   chunks=chunks, new=new, finished_req_ids=set(self.finished_ids))
        self.finished_ids.clear()
        self.step += 1
        return so

    def update_from_output(self, so: types.SimpleNamespace, output: dict) -> None:
        assert output["step"] == so.id
        for rid in output["sampled"]:
            if rid in self.requests:  # aborted requests are gone already
                self._finish(rid)
                self.events.append(("finished", rid))

    def _finish(self, rid: str) -> None:
        self.requests.pop(rid).done = True
        for queue in (self.running, self.waiting):
            if rid in queue:
                queue.remove(rid)
        self.finished_ids.add(rid)

    def finish_requests(self, rids: list[str], status: object) -> None:
        for rid in rids:
            self._finish(rid)
            self.events.append(("aborted", rid))


class Worker:
    """speccompat's WorkerCapture without a model: each step's layer states are made up."""

    def __init__(self, nan_token: int | None, device: str = "cpu") -> None:
        self.device = device
        cap = object.__new__(capture.WorkerCapture)
        cap.layer_ids, cap.keep, cap.tp_size, cap.strict = list(LAYERS), True, 1, True
        cap.steps, cap.collecting, cap.active, cap.prompts, cap.plan, cap._side = [], False, None, {}, None, None
        cap.staging = transport.Staging()
        self._speccompat_capture, self.nan_token = cap, nan_token

    def run(self, so: types.SimpleNamespace) -> dict:
        cap, sampled = self._speccompat_capture, []
        order = list(so.chunks)
        pos = [p for rid in order for p in range(*so.chunks[rid][:2])]
        ids = [t for rid in order for t in so.chunks[rid][2][slice(*so.chunks[rid][:2])]]
        for rid in order:
            start, end, prompt = so.chunks[rid]
            sampled += [rid] if end == len(prompt) else []
        if cap.collecting and order:
            cap.prompts.update(so.new)
            layers = {}
            for layer in LAYERS:
                rows = [expected(so.chunks[rid][2], layer)[slice(*so.chunks[rid][:2])] for rid in order]
                layers[layer] = torch.cat(rows).to(self.device, torch.bfloat16)
                if self.nan_token in ids:
                    layers[layer][ids.index(self.nan_token)] = float("nan")
            step = capture._Step(scheduled={r: so.chunks[r][1] - so.chunks[r][0] for r in order}, order=order,
                                 num_tokens=len(pos), positions=torch.tensor(pos, device=self.device),
                                 input_ids=torch.tensor(ids, device=self.device),
                                 padded_tokens=len(pos), layers=layers)
            cap.steps.append(step)  # what WorkerCapture's execute_model does as a step ends
            if cap.plan is not None:
                cap._place(step)
            cap._screen(step)
        return {"step": so.id, "sampled": sampled}


class Future:
    def __init__(self, executor: Executor, run) -> None:
        self.executor, self.run, self.value, self.ran = executor, run, None, False

    def result(self):
        while not self.ran:  # answers come in order: run everything sent before
            fut = self.executor.pending.pop(0)
            fut.value, fut.ran = fut.run(), True
        return self.value


class Executor:
    def __init__(self, worker: Worker, events: list) -> None:
        self.worker, self.events, self.pending = worker, events, []

    def _send(self, run) -> Future:
        fut = Future(self, run)
        self.pending.append(fut)
        return fut

    def submit(self, so: types.SimpleNamespace) -> Future:
        return self._send(lambda: self.worker.run(so))

    def collective_rpc(self, method, args=(), unique_reply_rank=None, non_block=False):
        func = method if callable(method) else getattr(capture, method.lstrip("_"))
        self.events.append(("rpc", getattr(func, "__name__", str(func))))
        fut = self._send(lambda: func(self.worker, *args))
        return fut if non_block else fut.result()


class Adapter:
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def in_flight(self, executor: Executor) -> int:
        return self.depth

    def submit(self, executor: Executor, so: types.SimpleNamespace):
        fut = executor.submit(so)
        return fut if self.depth > 1 else Done(fut.result())

    def unique_reply(self, reply):
        return reply


FAKE_MODULE = types.ModuleType("fake_speculators_generator")
FAKE_MODULE.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
FAKE_MODULE.Request = lambda **kw: types.SimpleNamespace(**kw)
FAKE_MODULE.RequestStatus = types.SimpleNamespace(FINISHED_ABORTED="aborted")
sys.modules[FAKE_MODULE.__name__] = FAKE_MODULE


class Generator:
    __module__ = FAKE_MODULE.__name__
    generate = generator.compat_generate

    def __init__(self, budget: int = 64, max_running: int = 4, nan_token: int | None = None) -> None:
        self.events: list = []
        self.layer_ids = list(LAYERS)
        self.tokenizer = types.SimpleNamespace(eos_token_id=None)
        model = types.SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=512, get_hidden_size=lambda: HIDDEN)
        self.vllm_config = types.SimpleNamespace(model_config=model)
        self.scheduler = Scheduler(budget, max_running, self.events)
        self.worker = Worker(nan_token)
        self.executor = Executor(self.worker, self.events)

    def assert_idle(self) -> None:
        """Nothing left behind: no request, no unanswered step, no stream or call open on the worker."""
        assert self.scheduler.requests == {} and self.scheduler.running == [] and self.scheduler.waiting == []
        assert self.executor.pending == []
        cap = self.worker._speccompat_capture
        assert getattr(cap, "stream", None) is None and not cap.collecting and cap.steps == []


@pytest.fixture(params=[1, 2], ids=["depth1", "depth2"])
def gen(request, monkeypatch):
    monkeypatch.setattr(STATE, "adapter", Adapter(request.param))
    return Generator()


def make_inputs(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 150, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


def check(seq: list[int], states: list[torch.Tensor]) -> None:
    assert len(states) == len(LAYERS)
    for layer, h in zip(LAYERS, states, strict=True):
        assert torch.equal(h, expected(seq, layer).to(torch.bfloat16))


def test_every_sequence_is_delivered_once_with_its_own_states(gen):
    seqs = make_inputs(25)
    got = {}
    for index, states, stats in generator.stream(gen, iter(seqs), max_in_flight_sequences=5):
        assert index not in got
        got[index] = states
        assert stats["sequences_in_flight"] <= 5
        # the worker holds the states of requests in flight only (a step's tensors go with its requests)
        held = gen.worker._speccompat_capture.stream.chunks
        assert len(held) <= 5 and not {f"req_0_{i}" for i in got} & set(held)
    assert sorted(got) == list(range(len(seqs)))
    for i, seq in enumerate(seqs):
        check(seq, got[i])
    gen.assert_idle()


def test_stream_equals_generate_in_both_modes(gen, monkeypatch):
    seqs = make_inputs(12, seed=1)
    streamed = {i: s for i, s, _ in generator.stream(gen, seqs, max_in_flight_sequences=3, copy=False)}
    monkeypatch.setenv("SPECCOMPAT_GENERATE", "call")
    called = gen.generate(seqs)
    monkeypatch.setenv("SPECCOMPAT_GENERATE", "stream")
    on_stream = gen.generate(seqs)
    assert gen._speccompat_stats["mode"] == "stream"
    assert gen._speccompat_stats["chunked"] >= 1  # 64-token steps: the longer sequences ran in chunks
    for i, seq in enumerate(seqs):
        for a, b, c in zip(streamed[i], called[i]["hidden_states"], on_stream[i]["hidden_states"], strict=True):
            assert torch.equal(a, b) and torch.equal(b, c)
        assert on_stream[i]["input_ids"].tolist() == seq and on_stream[i]["loss_mask"] is None
    # Copies own their memory (one sequence and layer each), as the call's copy-out made them.
    a, b = on_stream[0]["hidden_states"]
    assert a.untyped_storage().nbytes() == a.numel() * a.element_size()
    gen.assert_idle()


def run_counting(gen, seqs, **bounds) -> list[tuple[int, int]]:
    """Stream ``seqs``; return (sequences, prompt tokens) in flight (admitted, not yet handed out) at
    each admission, the admitted request included."""
    delivered: set[int] = set()
    admitted: list[int] = []
    seen = []
    add = gen.scheduler.add_request

    def counting_add(request):
        admitted.append(int(request.request_id.rsplit("_", 1)[1]))
        live = [i for i in admitted if i not in delivered]
        seen.append((len(live), sum(len(seqs[i]) for i in live)))
        add(request)

    gen.scheduler.add_request = counting_add
    for index, states, _ in generator.stream(gen, seqs, **bounds):
        check(seqs[index], states)
        delivered.add(index)
    assert delivered == set(range(len(seqs))) and sorted(admitted) == list(range(len(seqs)))
    return seen


def test_requests_are_admitted_while_others_run_and_in_flight_stays_bounded(gen):
    seqs = make_inputs(30, seed=2)
    seen = run_counting(gen, seqs, max_in_flight_sequences=6, max_in_flight_tokens=400)
    assert max(n for n, _ in seen) == 6
    assert max(t for n, t in seen if n > 1) <= 400
    # A new request reached the scheduler after an earlier one was scheduled and before it finished.
    events = gen.events
    first_sched = {e[1]: k for k, e in reversed(list(enumerate(events))) if e[0] == "scheduled"}
    finished = {e[1]: k for k, e in enumerate(events) if e[0] == "finished"}
    adds = [k for k, e in enumerate(events) if e[0] == "add"]
    assert any(first_sched[r] < k < finished[r] for r in finished for k in adds), "no request admitted mid-run"
    gen.assert_idle()


def test_the_token_bound_limits_what_is_in_flight(gen):
    seen = run_counting(gen, [[7] * 100] * 8, max_in_flight_sequences=None, max_in_flight_tokens=250)
    assert max(n for n, _ in seen) == 2  # 2 x 100 tokens fit in 250, 3 do not
    # A sequence larger than the bound still runs, alone.
    seen = run_counting(gen, [[5] * 300, [6] * 10], max_in_flight_sequences=None, max_in_flight_tokens=250)
    assert seen == [(1, 300), (1, 10)]
    gen.assert_idle()


def test_a_bad_input_raises_at_its_index_after_the_good_ones_and_the_engine_stays_usable(gen):
    seqs = make_inputs(6, seed=3)
    got = []
    with pytest.raises(ValueError, match="sequence 4, position 1: token id 1000 outside the vocabulary"):
        for index, states, _ in generator.stream(gen, seqs[:4] + [[1, VOCAB]] + seqs[4:], max_in_flight_sequences=2):
            check(seqs[index], states)
            got.append(index)
    assert got and set(got) <= {0, 1, 2, 3}
    gen.assert_idle()
    again = {i: s for i, s, _ in generator.stream(gen, seqs, max_in_flight_sequences=2)}
    assert sorted(again) == list(range(6))
    for i, seq in enumerate(seqs):
        check(seq, again[i])


def test_closing_early_aborts_what_is_in_flight(gen):
    seqs = make_inputs(10, seed=4)
    it = generator.stream(gen, seqs, max_in_flight_sequences=4)
    index, states, _ = next(it)
    check(seqs[index], states)
    it.close()
    assert any(e[0] == "aborted" for e in gen.events)
    gen.assert_idle()
    out = gen.generate(seqs)
    for seq, res in zip(seqs, out, strict=True):
        check(seq, res["hidden_states"])


def test_an_interrupt_in_the_consumer_aborts_cleanly(gen):
    seqs = make_inputs(8, seed=5)
    with pytest.raises(KeyboardInterrupt):
        for _ in generator.stream(gen, seqs, max_in_flight_sequences=3):
            raise KeyboardInterrupt
    gen.assert_idle()
    assert len(gen.generate(seqs)) == 8


def test_non_finite_states_name_the_sequence(monkeypatch):
    monkeypatch.setattr(STATE, "adapter", Adapter(2))
    gen = Generator(nan_token=999)
    seqs = [[1, 2, 3], [4, 5, 6, 7], [8, 999, 9], [10]]
    with pytest.raises(HiddenStatesError, match="sequence 2, layer 1: non-finite values in 1 token.*token 1 of"):
        list(generator.stream(gen, seqs, max_in_flight_sequences=1))
    gen.assert_idle()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bounds_are_checked(gen, bad):
    with pytest.raises(ValueError, match="max_in_flight_sequences must be a whole number"):
        generator.stream(gen, [[1]], max_in_flight_sequences=bad)
    with pytest.raises(TypeError, match="iterable of token id sequences"):
        generator.stream(gen, "abc")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the take's CUDA streams need a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_take_verifies_only_the_steps_that_hold_its_requests(device, monkeypatch):
    """On a GPU verifying a step waits for it: a take after step k+1 was submitted, for requests that
    finished in step k, must not touch step k+1 (it stays for the next take). On a GPU the rows
    travel through the pinned staging file, copied on the take's own stream."""
    from speccompat import streaming

    monkeypatch.setattr(transport, "INLINE_LIMIT", 0)  # tiny states, but through the staging file
    worker = Worker(None, device)
    cap = worker._speccompat_capture
    streaming.begin(worker)
    a, b, c = [5, 6, 7], [8, 9, 10, 11], [12, 13]

    def run(k, chunks, new):
        worker.run(types.SimpleNamespace(id=k, chunks=chunks, new=new))

    run(0, {"a": (0, 3, a), "b": (0, 2, b)}, {"a": a, "b": b})
    run(1, {"b": (2, 4, b), "c": (0, 2, c)}, {"c": c})
    run(2, {}, {})  # a step without tokens: nothing recorded
    out = streaming.take(worker, ["a"], [])
    assert out["req_ids"] == ["a"] and out["stats"]["steps"] == 1 and len(cap.steps) == 1
    assert "staging" in out["states"]
    assert torch.equal(transport.unpack(out["states"])[0], expected(a, LAYERS[0]).to(torch.bfloat16))
    out = streaming.take(worker, ["c", "b"], [])
    assert out["lengths"] == [2, 4] and out["stats"]["steps"] == 2 and out["stats"]["chunked"] == 1
    got = torch.split(transport.unpack(out["states"])[1], out["lengths"])
    for seq, g in zip((c, b), got, strict=True):
        assert torch.equal(g, expected(seq, LAYERS[1]).to(torch.bfloat16))
    assert cap.steps == [] and cap.stream.chunks == {}
    streaming.end(worker)
