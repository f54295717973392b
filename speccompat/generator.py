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
from typing import Any

from . import transport
from .errors import HiddenStatesError, KVCacheTooSmall

__all__ = ["compat_del", "compat_generate", "normalize_token_ids", "run_steps", "validate_results", "wrap_init"]

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
        if hasattr(seq, "tolist") and not isinstance(seq, (list, tuple)):
            seq = seq.tolist()
        if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)):
            raise TypeError(f"sequence {i}: expected a list of token ids, got {type(seq).__name__}")
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        out = _checked_ids(i, seq, vocab_size)
        if len(out) > max_len:
            truncated.append(i)
            out = out[:max_len]
        seqs.append(out)
    return seqs, truncated


def validate_results(
    results: list[dict[str, Any]], seqs: list[list[int]], layer_ids: list[int], hidden: int, check_finite: bool = True
) -> None:
    """Raise :class:`HiddenStatesError` unless every result matches its input exactly."""
    import torch

    num_layers = len(layer_ids)
    if len(results) != len(seqs):
        raise HiddenStatesError(f"{len(results)} results for {len(seqs)} sequences")
    for i, (res, seq) in enumerate(zip(results, seqs, strict=True)):
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


def in_flight_override() -> int | None:
    """``SPECCOMPAT_IN_FLIGHT``: how many steps the engine loop keeps submitted (1: synchronous)."""
    raw = os.environ.get("SPECCOMPAT_IN_FLIGHT", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"SPECCOMPAT_IN_FLIGHT={raw!r}: expected a whole number >= 1")
    return int(raw)


def run_steps(adapter: Any, executor: Any, scheduler: Any, req_ids: list[str]) -> tuple[int, int]:
    """Run engine steps until every request in ``req_ids`` finished; return ``(steps, depth)``.

    EngineCore's batch-queue loop: up to ``adapter.in_flight(executor)`` steps are submitted and
    not yet collected, so the next step is scheduled and sent while one runs on the device. Each
    step's output reaches ``update_from_output`` exactly once, in order. A new step is scheduled
    only while some request still has prompt tokens to schedule; a step with no tokens (the KV
    cache is full until a running request finishes) still runs, since it carries the ids of the
    requests that finished to the workers.
    """
    depth = in_flight_override() or adapter.in_flight(executor)
    requests = scheduler.requests
    live = set(req_ids)
    queue: collections.deque = collections.deque()
    steps = 0

    def unscheduled() -> bool:
        return any((q := requests.get(r)) is not None and q.num_computed_tokens < q.num_prompt_tokens for r in live)

    while live:
        if len(queue) < depth and unscheduled():
            so = scheduler.schedule()
            if not so.total_num_scheduled_tokens and not queue:
                longest = max((q.num_prompt_tokens for r in live if (q := requests.get(r)) is not None), default=0)
                raise KVCacheTooSmall(
                    f"the scheduler could not schedule {len(live)} remaining sequence(s) of up to {longest} "
                    "tokens: the KV cache is too small for them; raise gpu_memory_utilization (or give "
                    "the engine more memory), or shorten the sequences (max_model_len) or the batch",
                    longest=longest,
                )
            queue.append((so, adapter.submit(executor, so)))
            if so.total_num_scheduled_tokens and len(queue) < depth:
                continue
        if not queue:
            raise HiddenStatesError(f"{len(live)} sequence(s) neither finished nor left to schedule")
        so, future = queue.popleft()
        scheduler.update_from_output(so, future.result())
        steps += bool(so.total_num_scheduled_tokens)
        live = {r for r in live if (q := requests.get(r)) is not None and not q.is_finished()}
    # Nothing is left in the queue: a step without tokens is only sent while a request is still
    # unscheduled, and the step that schedules it comes after it.
    return steps, depth


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
