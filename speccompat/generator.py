"""Driver-side replacements for ``VllmHiddenStatesGenerator`` methods.

``generate`` is rewritten because speculators 0.3/0.4's loop produces wrong data without raising:

- it never tells the scheduler that a request finished, so only the first ``MAX_NUM_SEQS`` (32)
  requests are ever admitted; the rest never run;
- it returns results in ``sorted()`` request-id order (``req_0_10`` before ``req_0_2``);
- its token bookkeeping relies on the V1 runner's ``input_batch`` and on speculators' own forward.

The loop here is the engine's own (schedule, execute, ``update_from_output``; with EngineCore's
batch queue, the next step is scheduled and sent while one runs), so each request finishes right
after its prefill, frees its KV blocks and lets the next one in; chunked prefill and preemption are
whatever vLLM's scheduler does. Results come back in input order and are validated
(count, order, shape, finiteness) before they are returned.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import operator
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from . import transport
from .adapter import Done
from .errors import HiddenStatesError, KVCacheTooSmall

__all__ = [
    "StepLoop", "compat_del", "compat_generate", "generate_mode", "normalize_sequence", "normalize_token_ids",
    "run_steps", "stream", "validate_results", "wrap_init",
]

logger = logging.getLogger("speccompat.generator")


def _checked_ids(i: int, seq: list | tuple, vocab_size: int) -> list[int]:
    """``seq`` as a list of ints in ``[0, vocab_size)``, or an error naming sequence and position."""
    if set(map(type, seq)) == {int} and min(seq) >= 0 and max(seq) < vocab_size:
        return list(seq)  # the common case, at C speed
    out = []
    for j, tok in enumerate(seq):  # otherwise find the first offending token (or accept int-likes)
        if isinstance(tok, (bool, float)):
            raise TypeError(f"sequence {i}, position {j}: token id {tok!r} is not an integer")
        try:
            t = operator.index(tok)
        except TypeError:
            raise TypeError(f"sequence {i}, position {j}: token id {tok!r} is not an integer") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"sequence {i}, position {j}: token id {t} outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def normalize_token_ids(token_ids: Any, *, vocab_size: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """Check and copy the caller's input. Returns (sequences, indices of truncated sequences).

    Accepts a list of sequences (lists/tuples/1-D tensors/arrays of ints) or a 2-D integer tensor.
    Raises ``ValueError``/``TypeError`` naming the first bad sequence; nothing is scheduled then.
    Sequences longer than ``max_len`` are truncated to it, as speculators documents.
    """
    if hasattr(token_ids, "tolist") and hasattr(token_ids, "dim"):
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids tensor must be 2-D [batch, seq], got shape {tuple(token_ids.shape)}")
        if token_ids.is_floating_point() or token_ids.is_complex():
            raise TypeError(f"token_ids tensor must hold integers, got dtype {token_ids.dtype}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"token_ids must be a list of token id sequences, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty: give at least one sequence of token ids")
    seqs: list[list[int]] = []
    truncated: list[int] = []
    for i, seq in enumerate(token_ids):
        out, cut = normalize_sequence(i, seq, vocab_size=vocab_size, max_len=max_len)
        if cut:
            truncated.append(i)
        seqs.append(out)
    return seqs, truncated


def normalize_sequence(i: int, seq: Any, *, vocab_size: int, max_len: int) -> tuple[list[int], bool]:
    """Sequence ``i`` of the input as a list of ints, truncated to ``max_len``; and whether it was cut."""
    if hasattr(seq, "tolist") and not isinstance(seq, (list, tuple)):
        seq = seq.tolist()
    if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)):
        raise TypeError(f"sequence {i}: expected a list of token ids, got {type(seq).__name__}")
    if len(seq) == 0:
        raise ValueError(f"sequence {i} is empty")
    out = _checked_ids(i, seq, vocab_size)
    return (out[:max_len], True) if len(out) > max_len else (out, False)


def validate_results(
    results: list[dict[str, Any]], seqs: list[list[int]], layer_ids: list[int], hidden: int, check_finite: bool = True,
    indices: list[int] | None = None,
) -> None:
    """Raise :class:`HiddenStatesError` unless every result matches its input exactly (``indices``:
    the input positions the sequences are named by in errors, default 0, 1, ...)."""
    import torch

    num_layers = len(layer_ids)
    if len(results) != len(seqs):
        raise HiddenStatesError(f"{len(results)} results for {len(seqs)} sequences")
    for i, res, seq in zip(indices or range(len(seqs)), results, seqs, strict=True):
        ids = res["input_ids"]
        if ids.tolist() != seq:
            raise HiddenStatesError(f"sequence {i}: input_ids differ from the input (order mix-up)")
        states = res["hidden_states"]
        if len(states) != num_layers:
            raise HiddenStatesError(f"sequence {i}: {len(states)} layers, expected {num_layers}")
        for layer, h in zip(layer_ids, states, strict=True):
            if tuple(h.shape) != (len(seq), hidden):
                raise HiddenStatesError(
                    f"sequence {i}, layer {layer}: shape {tuple(h.shape)}, expected ({len(seq)}, {hidden})"
                )
            if check_finite and not bool(torch.isfinite(h).all()):
                bad = int((~torch.isfinite(h)).any(dim=-1).sum())
                raise HiddenStatesError(f"sequence {i}, layer {layer}: non-finite values in {bad} of {len(seq)} tokens")


def compat_generate(self: Any, token_ids: Any, *, copy: bool = True) -> list[dict[str, Any]]:
    """Extract hidden states of the prefill of each sequence (speculators' contract, fixed).

    Returns, in input order, one dict per sequence: ``input_ids`` (LongTensor [n]),
    ``hidden_states`` (one tensor [n, hidden_size] per layer id, the residual stream after that
    decoder layer, before the final norm) and ``loss_mask`` (``None``).

    ``copy=False`` (speccompat's own keyword; speculators' signature is ``generate(token_ids)``)
    skips the copy-out: each tensor is then a view of the shared-memory file the worker filled,
    which is kept from reuse for as long as any view of it lives. Views share one storage:
    ``torch.save`` of one of them writes the whole batch, so write views as raw data (safetensors,
    ``speccompat.dataset``) or ``clone()`` what you keep.
    """
    import torch

    from ._state import STATE

    adapter = STATE.require_adapter()
    mod = sys.modules[type(self).__module__]
    vllm_config = self.vllm_config
    model_config = vllm_config.model_config
    max_len = model_config.max_model_len - 1  # max_tokens=1 must still fit
    seqs, truncated = normalize_token_ids(token_ids, vocab_size=model_config.get_vocab_size(), max_len=max_len)
    if truncated:
        logger.warning(
            "speccompat: %d sequence(s) longer than max_model_len - 1 = %d truncated (indices %s)",
            len(truncated), max_len, truncated[:10],
        )

    if copy and generate_mode(_device_type(vllm_config)) == "stream":
        return _generate_streamed(self, seqs)
    call = getattr(self, "_request_counter", 0)
    self._request_counter = call + 1
    req_ids = [f"req_{call}_{i}" for i in range(len(seqs))]
    executor, scheduler = self.executor, self.scheduler

    t_start = time.perf_counter()
    # The call's layout goes to the workers first: on a GPU each step's states are then copied to
    # their place in the reply while the next steps run (speccompat.capture.WorkerCapture._place).
    executor.collective_rpc("_reset_capture", args=(req_ids, [len(s) for s in seqs], transport.busy()))
    sampling = mod.SamplingParams(max_tokens=1, temperature=0.0)
    for rid, seq in zip(req_ids, seqs, strict=True):
        scheduler.add_request(
            mod.Request(
                request_id=rid,
                prompt_token_ids=seq,
                sampling_params=sampling,
                pooling_params=None,
                eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
                arrival_time=0.0,
                block_hasher=None,
            )
        )
    try:
        steps, depth = run_steps(adapter, executor, scheduler, req_ids)
    except BaseException:
        _abort(mod, scheduler, req_ids)
        try:  # drop what the workers captured so far (device memory) before re-raising
            executor.collective_rpc("_reset_capture")
        except Exception:  # noqa: BLE001, S110 - the original error is the one to report
            pass
        raise
    _abort(mod, scheduler, req_ids)  # no-op for finished requests; frees anything left
    t_loop = time.perf_counter()
    logger.debug("speccompat: %d sequences in %d steps", len(seqs), steps)

    reply = adapter.unique_reply(
        executor.collective_rpc("_get_captured_states", args=(req_ids, transport.busy()), unique_reply_rank=0)
    )
    if not reply:
        raise HiddenStatesError("the workers returned no captured states")
    if reply["req_ids"] != req_ids:
        raise HiddenStatesError("the workers returned states for other requests than scheduled")
    lengths = [len(s) for s in seqs]
    if reply["lengths"] != lengths:
        raise HiddenStatesError(f"token counts {reply['lengths'][:8]}... differ from the inputs {lengths[:8]}...")
    states = transport.unpack(reply["states"])  # [layers, tokens, hidden]
    t_collect = time.perf_counter()
    #: How the last call went: steps, sequences prefilled in several chunks, restarts, seconds.
    self._speccompat_stats = dict(reply.get("stats", {}), driver_steps=steps, in_flight=depth,
                                  loop_s=round(t_loop - t_start, 4),
                                  collect_s=round(t_collect - t_loop, 4))
    if reply.get("nonfinite"):
        layer, (row, count) = next(iter(reply["nonfinite"].items()))
        seq = bisect.bisect_right(list(itertools.accumulate(lengths)), row)
        raise HiddenStatesError(
            f"sequence {seq}, layer {layer}: non-finite values in {count} token(s) of the batch, "
            f"first at token {row - sum(lengths[:seq])} of that sequence"
        )
    if tuple(states.shape) != (len(self.layer_ids), sum(lengths), model_config.get_hidden_size()):
        raise HiddenStatesError(f"packed states have shape {tuple(states.shape)}, expected "
                                f"({len(self.layer_ids)}, {sum(lengths)}, {model_config.get_hidden_size()})")
    # Copies: each sequence and layer owns its memory (saving one does not save the whole batch). Views
    # (copy=False) keep the worker's staging file from reuse while they live (transport.busy).
    parts = torch.split(states, lengths, dim=1)
    hidden = copy_out(parts) if copy else [list(p.unbind(0)) for p in parts]
    del parts, states
    # Order, counts and shapes were checked above against the workers' reply (req_ids, lengths, the
    # packed shape) and finiteness on the device (nonfinite); the results are built from them.
    results = [
        {"input_ids": torch.tensor(seq, dtype=torch.long), "hidden_states": hidden[i], "loss_mask": None}
        for i, seq in enumerate(seqs)
    ]
    self._speccompat_stats["unpack_s"] = round(time.perf_counter() - t_collect, 4)
    return results


def generate_mode(device_type: str | None = None) -> str:
    """How ``generate()`` with copies runs on an engine of ``device_type``: ``stream`` on a GPU (on
    top of :func:`stream`: each sequence copied out as soon as its last step ran, while the next
    steps run; 0.88 of plain prefill against 0.77-0.82 for the one-call path on an H200,
    benchmarks/NOTES.md), ``call`` elsewhere (one reply for the whole call, copied out after the
    engine loop: on CPUs the copy-out competes with the engine for the same cores). The environment
    variable ``SPECCOMPAT_GENERATE`` (``call`` or ``stream``) overrides it."""
    mode = os.environ.get("SPECCOMPAT_GENERATE", "").strip()
    if not mode:
        return "stream" if device_type == "cuda" else "call"
    if mode not in ("stream", "call"):
        raise ValueError(f"SPECCOMPAT_GENERATE={mode!r}: expected 'stream' or 'call'")
    return mode


def _device_type(vllm_config: Any) -> str | None:
    """The engine's device type (``cuda``, ``cpu``...), from its configuration."""
    device = getattr(vllm_config, "device_config", None)
    kind = getattr(device, "device_type", None)
    return kind if isinstance(kind, str) else None


def _generate_streamed(self: Any, seqs: list[list[int]]) -> list[dict[str, Any]]:
    """``generate()``'s contract on top of :func:`stream` (every sequence admitted at once)."""
    import torch

    t0 = time.perf_counter()
    results: list[dict[str, Any] | None] = [None] * len(seqs)
    stats: dict[str, Any] = {}
    for i, states, last in _stream(self, seqs, None, None, True, checked=True):
        stats = last
        if results[i] is not None:
            raise HiddenStatesError(f"sequence {i} handed out twice")
        results[i] = {"input_ids": torch.tensor(seqs[i], dtype=torch.long), "hidden_states": states,
                      "loss_mask": None}
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise HiddenStatesError(f"no states for sequence(s) {missing[:10]}")
    validate_results(results, seqs, list(self.layer_ids), self.vllm_config.model_config.get_hidden_size(),
                     check_finite=False)
    self._speccompat_stats = dict(stats, mode="stream", loop_s=round(time.perf_counter() - t0, 4))
    return results  # type: ignore[return-value]


def stream(
    gen: Any,
    token_ids: Iterable[Any],
    *,
    max_in_flight_sequences: int | None = 64,
    max_in_flight_tokens: int | None = None,
    copy: bool = True,
) -> Iterator[tuple[int, list[Any], dict[str, Any]]]:
    """Extract hidden states while feeding the engine continuously.

    ``token_ids``: any iterable of token id sequences (read lazily, one at a time). A sequence is
    admitted to the engine whenever fewer than ``max_in_flight_sequences`` sequences and
    ``max_in_flight_tokens`` prompt tokens are in flight (admitted and not yet handed out; at least
    one always is; ``None``: no bound), so vLLM's scheduler batches new requests with running ones.
    Yields ``(index, hidden_states, stats)`` as soon as the step that completed a sequence's prefill
    ran: ``index`` is the sequence's position in ``token_ids`` (delivery is in completion order),
    ``hidden_states`` one tensor [n, hidden_size] per layer id, exactly what :func:`compat_generate`
    returns for it (``copy=False``: views, see there). Memory is bounded by the in-flight budget,
    whatever the number of inputs.

    Each sequence's states are verified on the worker (positions, token ids, finiteness) and checked
    here (count and shape) before they are yielded. A bad input raises when it is reached, naming its
    index; sequences yielded before it stay valid. An error, ``close()`` or ``KeyboardInterrupt`` aborts
    the requests in flight and leaves the generator usable.
    """
    for name, bound in (("max_in_flight_sequences", max_in_flight_sequences),
                        ("max_in_flight_tokens", max_in_flight_tokens)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise ValueError(f"{name} must be a whole number >= 1 or None, got {bound!r}")
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(f"token_ids must be an iterable of token id sequences, got {type(token_ids).__name__}")
    return _stream(gen, token_ids, max_in_flight_sequences, max_in_flight_tokens, copy, checked=False)


def _stream(gen: Any, token_ids: Iterable[Any], max_seqs: int | None, max_tokens: int | None, copy: bool,
            checked: bool) -> Iterator[tuple[int, list[Any], dict[str, Any]]]:
    import torch

    from . import streaming
    from ._state import STATE

    adapter = STATE.require_adapter()
    mod = sys.modules[type(gen).__module__]
    model_config = gen.vllm_config.model_config
    vocab, max_len = model_config.get_vocab_size(), model_config.max_model_len - 1
    hidden, layer_ids = model_config.get_hidden_size(), list(gen.layer_ids)
    call = getattr(gen, "_request_counter", 0)
    gen._request_counter = call + 1
    executor, scheduler = gen.executor, gen.scheduler
    loop = StepLoop(adapter, executor, scheduler)
    sampling = mod.SamplingParams(max_tokens=1, temperature=0.0)
    eos = getattr(gen.tokenizer, "eos_token_id", None)

    inputs = enumerate(token_ids)
    upcoming: tuple[int, list[int]] | None = None  # read, not yet admitted
    exhausted = False
    in_flight: dict[str, tuple[int, list[int]]] = {}  # admitted, not yet handed out
    tokens = admitted = delivered = 0
    finished: list[str] = []  # finished on the engine, not yet asked for
    taking = False  # a take is queued

    def next_input() -> tuple[int, list[int]] | None:
        try:
            i, seq = next(inputs)
        except StopIteration:
            return None
        if checked:
            return i, seq
        out, cut = normalize_sequence(i, seq, vocab_size=vocab, max_len=max_len)
        if cut:
            logger.warning("speccompat: sequence %d longer than max_model_len - 1 = %d truncated", i, max_len)
        return i, out

    def fits(n: int) -> bool:
        if not in_flight:
            return True
        return (max_seqs is None or len(in_flight) < max_seqs) and (max_tokens is None or tokens + n <= max_tokens)

    def send_take() -> None:
        nonlocal finished, taking
        args = (finished, transport.busy())
        if loop.depth > 1:  # steps are futures on this vLLM; the take queues behind them
            fut = executor.collective_rpc(streaming.take, args=args, unique_reply_rank=0, non_block=True)
        else:
            fut = Done(executor.collective_rpc(streaming.take, args=args, unique_reply_rank=0))
        loop.queue_rpc(finished, fut)
        finished, taking = [], True

    def unpack_take(req_ids: list[str], value: Any) -> list[tuple[int, list[Any], dict[str, Any]]]:
        t0 = time.perf_counter()
        reply = adapter.unique_reply(value)
        if not reply or reply.get("req_ids") != req_ids:
            raise HiddenStatesError("the workers returned states for other requests than asked for")
        lengths = [len(in_flight[r][1]) for r in req_ids]
        if reply["lengths"] != lengths:
            raise HiddenStatesError(f"token counts {reply['lengths'][:8]} differ from the inputs {lengths[:8]}")
        if reply.get("nonfinite"):
            layer, (row, count) = next(iter(reply["nonfinite"].items()))
            k = bisect.bisect_right(list(itertools.accumulate(lengths)), row)
            raise HiddenStatesError(
                f"sequence {in_flight[req_ids[k]][0]}, layer {layer}: non-finite values in {count} token(s), "
                f"first at token {row - sum(lengths[:k])} of that sequence")
        states = transport.unpack(reply["states"])
        if tuple(states.shape) != (len(layer_ids), sum(lengths), hidden):
            raise HiddenStatesError(f"packed states have shape {tuple(states.shape)}, expected "
                                    f"({len(layer_ids)}, {sum(lengths)}, {hidden})")
        parts = torch.split(states, lengths, dim=1)
        out = copy_out(parts) if copy else [list(p.unbind(0)) for p in parts]
        del parts, states
        seqs = [in_flight[r][1] for r in req_ids]
        indices = [in_flight[r][0] for r in req_ids]
        validate_results([{"input_ids": torch.tensor(seq, dtype=torch.long), "hidden_states": h}
                          for seq, h in zip(seqs, out, strict=True)], seqs, layer_ids, hidden,
                         check_finite=False, indices=indices)
        stats = dict(reply.get("stats", {}), driver_steps=loop.steps, in_flight=loop.depth,
                     sequences_in_flight=len(in_flight), take_sequences=len(req_ids),
                     unpack_s=round(time.perf_counter() - t0, 4))
        return [(i, h, stats) for i, h in zip(indices, out, strict=True)]

    executor.collective_rpc(streaming.begin)
    try:
        while True:
            while not exhausted:
                if upcoming is None and (upcoming := next_input()) is None:
                    exhausted = True
                elif fits(len(upcoming[1])):
                    index, seq = upcoming
                    rid = f"req_{call}_{index}"
                    scheduler.add_request(mod.Request(request_id=rid, prompt_token_ids=seq, sampling_params=sampling,
                                                      pooling_params=None, eos_token_id=eos, arrival_time=0.0,
                                                      block_hasher=None))
                    in_flight[rid], upcoming = (index, seq), None
                    loop.live.add(rid)
                    tokens += len(seq)
                    admitted += 1
                else:
                    break
            if not in_flight:
                break
            kind, what, value = loop.advance()
            if kind == "step":
                finished.extend(sorted(what, key=lambda r: in_flight[r][0]))
            else:
                taking = False
                ready = unpack_take(what, value)
                for rid in what:
                    tokens -= len(in_flight.pop(rid)[1])
            if finished and not taking:
                send_take()  # before handing anything out: the workers keep running meanwhile
            if kind == "rpc":
                for item in ready:
                    delivered += 1
                    yield item
        if delivered != admitted:
            raise HiddenStatesError(f"{delivered} sequences handed out for {admitted} admitted")
    except BaseException:
        _abort(mod, scheduler, list(in_flight))
        loop.drain()
        raise
    finally:
        try:  # drop what the workers still hold (device memory)
            executor.collective_rpc(streaming.end)
        except Exception:  # noqa: BLE001, S110 - the original error (if any) is the one to report
            pass


def in_flight_override() -> int | None:
    """``SPECCOMPAT_IN_FLIGHT``: how many steps the engine loop keeps submitted (1: synchronous)."""
    raw = os.environ.get("SPECCOMPAT_IN_FLIGHT", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"SPECCOMPAT_IN_FLIGHT={raw!r}: expected a whole number >= 1")
    return int(raw)


def run_steps(adapter: Any, executor: Any, scheduler: Any, req_ids: list[str]) -> tuple[int, int]:
    """Run engine steps until every request in ``req_ids`` finished; return ``(steps, depth)``
    (see :class:`StepLoop`)."""
    loop = StepLoop(adapter, executor, scheduler)
    loop.live.update(req_ids)
    while loop.live:
        loop.advance()
    # Nothing is left in the queue: a step without tokens is only sent while a request is still
    # unscheduled, and the step that schedules it comes after it.
    return loop.steps, loop.depth


class StepLoop:
    """EngineCore's batch-queue loop over the requests in :attr:`live`.

    Up to ``adapter.in_flight(executor)`` steps are submitted and not yet collected, so the next step
    is scheduled and sent while one runs on the device. Each step's output reaches
    ``update_from_output`` exactly once, in order. A new step is scheduled only while some request
    still has prompt tokens to schedule; a step with no tokens (the KV cache is full until a running
    request finishes) still runs, since it carries the ids of the requests that finished to the
    workers. Other work for the workers (a stream's ``take``) can be queued between steps with
    :meth:`queue_rpc`; it is collected in order with them. Requests may be added to the scheduler
    (and to :attr:`live`) between calls of :meth:`advance`: the next step admits them.
    """

    def __init__(self, adapter: Any, executor: Any, scheduler: Any) -> None:
        self.adapter, self.executor, self.scheduler = adapter, executor, scheduler
        self.depth = in_flight_override() or adapter.in_flight(executor)
        self.live: set[str] = set()
        #: (kind, what, future) in submission order; kind "step" (what: the scheduler output) or "rpc".
        self.queue: collections.deque = collections.deque()
        self.steps = 0

    def _unscheduled(self) -> bool:
        requests = self.scheduler.requests
        return any((q := requests.get(r)) is not None and q.num_computed_tokens < q.num_prompt_tokens
                   for r in self.live)

    def _pending_steps(self) -> int:
        return sum(kind == "step" for kind, *_ in self.queue)

    def queue_rpc(self, what: Any, future: Any) -> None:
        self.queue.append(("rpc", what, future))

    def advance(self) -> tuple[str, Any, Any]:
        """Schedule and submit steps as the depth allows, then collect the oldest queued item:
        ``("step", finished request ids, None)`` or ``("rpc", what, its reply)``."""
        while True:
            if self._pending_steps() < self.depth and self._unscheduled():
                so = self.scheduler.schedule()
                if not so.total_num_scheduled_tokens and not self.queue:
                    requests = self.scheduler.requests
                    longest = max((q.num_prompt_tokens for r in self.live if (q := requests.get(r)) is not None),
                                  default=0)
                    raise KVCacheTooSmall(
                        f"the scheduler could not schedule {len(self.live)} remaining sequence(s) of up to "
                        f"{longest} tokens: the KV cache is too small for them; raise gpu_memory_utilization (or "
                        "give the engine more memory), or shorten the sequences (max_model_len) or the batch",
                        longest=longest,
                    )
                self.queue.append(("step", so, self.adapter.submit(self.executor, so)))
                if so.total_num_scheduled_tokens and self._pending_steps() < self.depth:
                    continue
            if not self.queue:
                raise HiddenStatesError(f"{len(self.live)} sequence(s) neither finished nor left to schedule")
            kind, what, future = self.queue[0]
            value = future.result()
            self.queue.popleft()
            if kind == "rpc":
                return kind, what, value
            self.scheduler.update_from_output(what, value)
            self.steps += bool(what.total_num_scheduled_tokens)
            requests = self.scheduler.requests
            finished = {r for r in self.live if (q := requests.get(r)) is None or q.is_finished()}
            self.live -= finished
            return kind, finished, None

    def drain(self) -> None:
        """Collect whatever is still queued, ignoring errors (after an abort)."""
        while self.queue:
            kind, what, future = self.queue.popleft()
            try:
                value = future.result()
                if kind == "step":
                    self.scheduler.update_from_output(what, value)
            except Exception:  # noqa: BLE001, S110 - the error that stopped the loop is the one to report
                pass


def copy_out(parts: Any) -> list[list[Any]]:
    """One owned tensor per sequence and layer, from per-sequence views [layers, n, hidden].

    Where torch has several intra-op threads it spreads each large copy over them, and one Python
    thread is best (a pool on top made the copy-out 4x slower on 2 cores). On GPU hosts vLLM's
    multiprocessing executor sets the driver's torch to one thread (``set_multiprocessing_worker_envs``)
    and the copy-out then ran at 4.4 GB/s on an H200 host; there the sequences are split over a few
    Python threads (``clone`` releases the GIL). ``benchmarks/device_copy.py``: driver_copy_out*."""
    parts = list(parts)
    threads = copy_threads(parts)
    if threads <= 1:
        return _clone_all(parts)
    from concurrent.futures import ThreadPoolExecutor

    size = -(-len(parts) // threads)
    chunks = [parts[i : i + size] for i in range(0, len(parts), size)]
    with ThreadPoolExecutor(len(chunks), thread_name_prefix="speccompat-copy") as pool:
        return [item for chunk in pool.map(_clone_all, chunks) for item in chunk]


#: Below this many bytes a thread pool costs more than it saves.
_THREADED_COPY_BYTES = 64 << 20


def copy_threads(parts: list[Any]) -> int:
    """Python threads for :func:`copy_out`: 1 unless torch runs single-threaded on a host with cores to spare."""
    import torch

    if torch.get_num_threads() > 1 or len(parts) < 2:
        return 1
    nbytes = sum(t.numel() * t.element_size() for t in parts)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nbytes < _THREADED_COPY_BYTES or cores < 4:
        return 1
    return min(8, cores, len(parts))


def _clone_all(parts: list[Any]) -> list[list[Any]]:
    return [[layer.clone() for layer in part] for part in parts]


def _abort(mod: Any, scheduler: Any, req_ids: list[str]) -> None:
    left = [r for r in req_ids if (q := scheduler.requests.get(r)) is not None and not q.is_finished()]
    if left:
        scheduler.finish_requests(left, mod.RequestStatus.FINISHED_ABORTED)


def wrap_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """wrapt wrapper of ``__init__``: reject bad layer ids (explicit or speculators' default for this
    model) before any engine starts (``speccompat.layers``)."""
    from .layers import check_generator_layer_ids

    bound = dict(zip(("model_path", "layer_ids"), args, strict=False))
    bound.update(kwargs)
    check_generator_layer_ids(bound.get("model_path"), bound.get("layer_ids"))
    return wrapped(*args, **kwargs)


def compat_del(self: Any) -> None:
    """``__del__`` that shuts the executor down quietly, also at interpreter exit."""
    executor = self.__dict__.get("executor")
    if executor is None:
        return
    self.__dict__["executor"] = None
    try:
        executor.shutdown()
    except Exception:  # noqa: BLE001, S110 - logging may already be torn down at exit
        pass
