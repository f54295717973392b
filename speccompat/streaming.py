"""Worker side of streaming extraction (``speccompat.generator.stream``).

In a ``generate()`` call the worker keeps every step's states until the call ends, then verifies
and packs them all (``speccompat.capture.WorkerCapture.collect``). A stream has no end: requests
join while others run, so the driver asks, after the step in which some requests finished, for
those requests alone (:func:`take`). Each step is verified once, when it is first seen (positions
continue where the request's last chunk ended, a restart from position 0 voids the earlier chunks,
token ids equal the prompt), and each request keeps views of its chunks' rows; a step's tensors are
freed once every request in it was taken. Memory on the worker is therefore bounded by the requests
in flight, not by the number of inputs.

The functions run in the worker process: the driver sends them with ``collective_rpc`` (a callable
is pickled by reference), so the worker extension needs no new method.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from .errors import HiddenStatesError

__all__ = ["begin", "end", "take"]


class _Stream:
    """Per-request chunks of the steps seen so far: rid -> [(step, first row in the step, rows)]."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[Any, int, int]]] = {}
        self.done: dict[str, int] = {}  # prompt tokens seen per request
        self.steps = self.restarts = self.unverified = self.chunked = 0


def _capture(worker: Any) -> Any:
    cap = getattr(worker, "_speccompat_capture", None)
    if cap is None:
        raise RuntimeError("Must call _setup_hidden_states_capture before capturing states")
    return cap


def begin(worker: Any) -> None:
    """Start capturing for a stream (every step is kept until its requests are taken)."""
    cap = _capture(worker)
    cap.reset(collecting=True)
    cap.stream = _Stream()


def end(worker: Any) -> None:
    """Stop capturing and drop whatever was not taken (an aborted stream)."""
    cap = _capture(worker)
    cap.reset(collecting=False)
    cap.stream = None


def _ingest(cap: Any, st: _Stream, req_ids: list[str]) -> None:
    """Verify the steps that ran since the last call, up to the last one that scheduled any of
    ``req_ids``, and record each request's chunks. The steps after it stay for the next take: on a
    GPU they may still be running, and verifying one means waiting for it."""
    import numpy as np

    wanted = set(req_ids)
    last = max((j for j, step in enumerate(cap.steps) if wanted.intersection(step.scheduled)), default=-1)
    ready, cap.steps = cap.steps[: last + 1], cap.steps[last + 1 :]
    for step in ready:
        k = step.number = st.steps
        st.steps += 1
        if len(step.layers) != len(cap.layer_ids):
            missing = sorted(set(cap.layer_ids) - set(step.layers))
            raise HiddenStatesError(f"step {k}: layers {missing} produced no output")
        if sorted(step.order) != sorted(step.scheduled):
            raise HiddenStatesError(f"step {k}: batch order {step.order} does not cover the scheduled "
                                    f"requests {sorted(step.scheduled)}")
        sizes = np.array([step.scheduled[rid] for rid in step.order], dtype=np.int64)
        if int(sizes.sum()) != step.num_tokens:
            raise HiddenStatesError(f"step {k}: {int(sizes.sum())} tokens attributed, {step.num_tokens} scheduled")
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        pos, ids, step.flagged = step.inputs()
        starts = pos[offsets].tolist() if len(pos) else []
        for rid, start in zip(step.order, starts, strict=True):
            if start == 0 and st.done.get(rid):  # preempted and recomputed: earlier chunks are void
                st.chunks[rid], st.done[rid] = [], 0
                st.restarts += 1
            if start != st.done.get(rid, 0):
                raise cap._misplaced(k, rid, pos, step, st.done.get(rid, 0))
        expected = np.repeat(np.array(starts) - offsets, sizes) + np.arange(step.num_tokens)
        if not np.array_equal(pos, expected):
            bad = int(np.flatnonzero(pos != expected)[0])
            rid = step.order[int(np.searchsorted(offsets, bad, side="right")) - 1]
            raise cap._misplaced(k, rid, pos, step, st.done.get(rid, 0))
        if ids is None or not all(rid in cap.prompts for rid in step.order):
            if cap.strict:
                raise HiddenStatesError(f"step {k}: its token ids could not be read, so the tokens of "
                                        f"{step.order} cannot be verified against their prompts (strict mode)")
            st.unverified += 1
        else:
            want = np.asarray([t for rid, s0, n in zip(step.order, starts, sizes.tolist(), strict=True)
                               for t in cap.prompts[rid][s0 : s0 + n]], dtype=ids.dtype)
            if not np.array_equal(ids, want):
                i = int(np.searchsorted(offsets, int(np.flatnonzero(ids != want)[0]), side="right")) - 1
                rid, s0, n = step.order[i], starts[i], int(sizes[i])
                raise HiddenStatesError(f"request {rid}, step {k}: token ids at positions {s0}..{s0 + n - 1} "
                                        "differ from its prompt; tokens would be attributed to the wrong sequence")
        for rid, s0, off, n in zip(step.order, starts, offsets.tolist(), sizes.tolist(), strict=True):
            st.chunks.setdefault(rid, []).append((step, off, n))
            st.done[rid] = s0 + n


def take(worker: Any, req_ids: list[str], busy: list[str]) -> dict[str, Any] | None:
    """Verified states of the finished requests ``req_ids``, packed like ``_get_captured_states``'
    reply (``[layers, sum of lengths, hidden]``, requests in that order); they are then forgotten.

    On a GPU the take runs while the next step computes (the driver queues it behind that step): it
    waits for nothing that step does. The host copies of the earlier steps' positions, token ids
    and finiteness screens were made as each step ended (``WorkerCapture._screen``), and the rows
    are copied into the staging file on a stream of their own that waits for the end of the last
    step holding them; the take then waits for those copies alone before it replies."""
    from .capture import any_nonfinite

    cap = _capture(worker)
    st = getattr(cap, "stream", None)
    if st is None:
        raise HiddenStatesError("no stream is open on this worker")
    if not cap.keep:  # only rank 0 keeps states; the others forget the requests' prompts
        cap.steps = []
        for rid in req_ids:
            cap.prompts.pop(rid, None)
        return None
    t0 = time.perf_counter()
    _ingest(cap, st, req_ids)
    lengths = []
    for rid in req_ids:
        want = len(cap.prompts.get(rid, ()))
        if want == 0 or st.done.get(rid) != want:
            raise HiddenStatesError(f"request {rid}: captured {st.done.get(rid, 0)} of {want} prompt tokens")
        lengths.append(want)
    first_step, *_ = st.chunks[req_ids[0]][0]
    first = first_step.layers[cap.layer_ids[0]]
    desc, buf = cap.staging.allocate((len(cap.layer_ids), sum(lengths), first.shape[-1]), first.dtype,
                                     first.device, busy=busy)
    import torch

    parts = [(rid, st.chunks.pop(rid)) for rid in req_ids]
    st.chunked += sum(len(chunks) > 1 for _, chunks in parts)
    copier = _copy_stream(cap, first.device, [step for _, chunks in parts for step, _, _ in chunks])
    nonfinite: dict[int, tuple[int, int]] = {}
    row = 0
    with torch.cuda.stream(copier) if copier is not None else contextlib.nullcontext():
        for rid, chunks in parts:
            for step, off, n in chunks:
                for i, layer_id in enumerate(cap.layer_ids):
                    part = step.layers[layer_id][off : off + n]
                    if step.flagged and layer_id not in nonfinite and bool(any_nonfinite(part)):
                        bad = ~torch.isfinite(part).all(dim=-1)
                        nonfinite[layer_id] = (row + int(bad.nonzero()[0, 0]), int(bad.sum()))
                    buf[i, row : row + n].copy_(part, non_blocking=True)
                row += n
            del st.done[rid], cap.prompts[rid]
    if copier is not None:
        copier.synchronize()  # the rows are in the staging file; the step running now goes on
    else:
        cap.staging.ready()
    built_s = cap.staging.take_built()
    made, made_s = cap.staging.take_made()
    stats = {"steps": st.steps, "chunked": st.chunked, "restarted": st.restarts, "unverified_steps": st.unverified,
             "worker_take_s": round(time.perf_counter() - t0, 4), "staging_made": made,
             "staging_made_s": round(made_s, 4), "staging_built_s": round(built_s, 4)}
    return {"req_ids": list(req_ids), "lengths": lengths, "layer_ids": list(cap.layer_ids), "states": desc,
            "nonfinite": nonfinite, "stats": stats}


def _copy_stream(cap: Any, device: Any, steps: list[Any]) -> Any:
    """On a GPU, the stream of a take's copies, made to wait for the end of the last of ``steps``
    on the compute stream (and for nothing after it); ``None`` on a CPU (the copies are made at once)."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    copier = getattr(cap, "_take_stream", None)
    if copier is None:
        copier = cap._take_stream = torch.cuda.Stream(device)
    last = max(steps, key=lambda step: step.number)
    if all(step.ended is not None for step in steps):
        copier.wait_event(last.ended)
    else:  # a step that was not screened: wait for everything submitted so far
        copier.wait_stream(torch.cuda.current_stream(device))
    return copier
