"""Worker-side hidden-state capture that replaces speculators' ``_patched_forward``.

speculators 0.3/0.4 replace the base model's ``forward`` with their own loop over the decoder
layers. That copy drifts from vLLM's: it drops ``llama_4_scaling`` (DeepseekV2, 0.12+), the
sequence-parallel all-gather (DeepseekV2, 0.25+), ``**extra_layer_kwargs`` (Llama, 0.15+) and
calls ``get_input_embeddings`` (renamed in 0.11.1). It orders tokens through
``model_runner.input_batch``, which the V2 model runner does not have.

Here vLLM's own forward always runs. Capture is three small, removable attachments:

- a forward hook on each requested decoder layer: the layer's output mapped to the residual stream
  after that layer, before any final norm (the last layer included), by the layer's *output
  convention* (:data:`CONVENTIONS`; ``(hidden_states, residual)`` -> their sum for most models);
- a wrapper around the base model's ``forward`` (an instance attribute, like speculators' own patch)
  that records the step's ``positions``/``input_ids``;
- a wrapper around the model runner's ``execute_model`` (and, on the V2 runner, ``prepare_inputs``)
  that records the scheduler output and the batch order of the step.

Every token is then attributed by the runner's own batch order and *verified*: the positions of
each request's slice must continue where its previous slice ended, and its token ids must equal its
prompt. Misattribution, a missing chunk or a duplicated chunk raises :class:`HiddenStatesError`
naming the request, instead of producing plausible but wrong training data. Multimodal models
(Kimi-K2.5) are called with ``inputs_embeds`` and ``input_ids=None``: their token ids are read from
the runner's own buffers instead; a step whose ids cannot be read at all is counted
(``unverified_steps`` in the call's stats) and is an error in strict mode.

Where the driver gives the call's request ids and prompt lengths (speccompat's ``generate`` does,
through ``_reset_capture``), each step's states are copied to their place in the reply as the step
ends (on a GPU on a side stream into the pinned staging file, overlapping the next steps' forward);
what the verification cannot confirm (a restarted request, a step outside the plan, non-finite
values) is gathered again from the device.

What differs between vLLM releases (the runner's batch order, warm-up calls, M-RoPE positions,
sequence-parallel shards, the multimodal wrapper, the scheduler output's fields, each decoder-layer
class's output convention) is asked of the adapter (:class:`speccompat.adapter.Adapter`, "worker
side"), whose fingerprint holds the vLLM symbols those operations read. A layer class no adapter
declares (vLLM 0.33.0's Kimi-K3 layers return ``(hidden_states, prefix_sum, residual)``) is refused at
set-up, naming the model, the class and what its ``forward`` returns; every call of a hooked layer is
checked against its convention (tuple arity, each element ``[tokens, hidden]``), so a convention that
changes in a later release fails loudly instead of yielding plausible but wrong states.
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .errors import HiddenStatesError, UnsupportedError

__all__ = ["CONVENTIONS", "Convention", "WorkerCapture", "describe_output", "find_decoder_layers",
           "layer_path", "returns_of"]

logger = logging.getLogger("speccompat.capture")


def find_decoder_layers(model: Any, adapter: Any = None) -> tuple[Any, Any]:
    """``(base_model, layers)`` of a vLLM model, as the adapter finds them (see ``decoder_layers``)."""
    return (adapter or _adapter()).decoder_layers(model)


def _adapter() -> Any:
    from ._state import STATE

    return STATE.require_adapter()



def _sum_pair(output: Any) -> Any:
    hidden, residual = output
    return hidden + residual if residual is not None else hidden.clone()


def _itself(output: Any) -> Any:
    return output.clone()


class Convention(NamedTuple):
    """How a decoder layer's output maps to the residual stream after the layer.

    ``arity``: elements of the tuple the layer returns (0: a bare tensor). ``optional``: indexes of
    elements that may be ``None``. ``stream``: the residual stream from the output."""

    name: str
    arity: int
    optional: tuple[int, ...]
    stream: Any
    doc: str

    def check(self, output: Any, hidden_size: int | None) -> str | None:
        """What is wrong with ``output`` for this convention (``None``: it conforms): tuple arity,
        each tensor ``[tokens, hidden]`` with one token count."""
        import torch

        if self.arity == 0:
            items = [output]
            if not isinstance(output, torch.Tensor):
                return f"expected a tensor, got {describe_output(output)}"
        else:
            if not isinstance(output, tuple) or len(output) != self.arity:
                return f"expected a {self.arity}-tuple, got {describe_output(output)}"
            items = list(output)
        rows = None
        for i, item in enumerate(items):
            if item is None and i in self.optional:
                continue
            if not isinstance(item, torch.Tensor) or item.dim() != 2:
                return f"element {i} is not a [tokens, hidden] tensor: {describe_output(output)}"
            if rows is None:
                rows = item.shape[0]
            if item.shape[0] != rows or (hidden_size is not None and item.shape[1] != hidden_size):
                return (f"element {i} is not [{rows}, {hidden_size or 'hidden'}]: {describe_output(output)}")
        return None


#: Every output convention an adapter may declare for a decoder-layer class.
CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("hidden+residual", 2, (1,), _sum_pair,
                   "(hidden_states, residual): the stream is their sum (residual None: hidden_states)"),
        Convention("tensor", 0, (), _itself, "a bare tensor: the stream itself"),
    )
}


def describe_output(output: Any) -> str:
    """The structure of a layer's output: ``tuple(Tensor[7, 64], None)``, ``Tensor[7, 64]``..."""
    if isinstance(output, (tuple, list)):
        inner = ", ".join(describe_output(o) for o in output)
        return f"{type(output).__name__}({inner})"
    shape = getattr(output, "shape", None)
    if shape is not None:
        return f"Tensor[{', '.join(str(int(d)) for d in shape)}]"
    return "None" if output is None else type(output).__name__


def returns_of(cls: type) -> str:
    """What ``cls.forward`` returns, read from its source (``return`` statements, else its return
    annotation): ``(hidden_states, prefix_sum, residual)``. Names the output structure of a layer
    class before it has run."""
    import ast
    import inspect
    import textwrap

    forward = getattr(cls, "forward", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    if tree is not None:
        fn = tree.body[0]
        found = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is not None:
                text = ast.unparse(node.value)
                text = f"({text})" if isinstance(node.value, ast.Tuple) and not text.startswith("(") else text
                if text not in found:
                    found.append(text)
        if found:
            return " or ".join(found)
    try:
        ann = inspect.signature(forward).return_annotation
    except (TypeError, ValueError):
        ann = inspect.Signature.empty
    return f"-> {ann}" if ann is not inspect.Signature.empty else "(its forward's source is unavailable)"


def layer_path(cls: type) -> str:
    """``module:Class`` of a class, as adapters name decoder-layer classes."""
    return f"{cls.__module__}:{cls.__qualname__}"


#: Exponent bits of 16-bit floats: all ones means inf or nan.
_EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00}


def any_nonfinite(t: Any) -> Any:
    """``(~torch.isfinite(t)).any()`` as a tensor on ``t``'s device (no synchronisation), 3x faster
    for 16-bit floats (exponent bits, no float math)."""
    import torch

    mask = _EXPONENT.get(str(t.dtype).removeprefix("torch."))
    if mask is None:
        return (~torch.isfinite(t)).any()
    return ((t.view(torch.int16) & mask) == mask).any()


def all_finite(t: Any) -> bool:
    """``torch.isfinite(t).all()``, 3x faster for 16-bit floats (see :func:`any_nonfinite`)."""
    return not bool(any_nonfinite(t))


def maybe_nonfinite(t: Any) -> Any:
    """A screen for inf and nan, as a tensor on ``t``'s device (no synchronisation): ``False`` means
    every value is finite; ``True`` means some value may not be, to be confirmed with
    :func:`any_nonfinite`. For bfloat16 and float32 it is whether the sum of all values is finite:
    a nan or an inf anywhere makes the sum non-finite, and a finite sum can only turn infinite by
    overflow (above 3.4e38), which the confirmation then clears. One read of the data: 13x faster
    than :func:`any_nonfinite` on CPU for bfloat16. float16 (a sum overflows at 65,504) and other
    dtypes are screened exactly."""
    import torch

    if t.dtype in (torch.bfloat16, torch.float32):
        return ~torch.isfinite(t.sum())
    return any_nonfinite(t)


@dataclass
class _Step:
    scheduled: dict[str, int]
    batch: Any = None  # what the adapter's watch_batch recorded for this step (V2 runner)
    order: list[str] | None = None
    num_tokens: int = 0
    positions: Any = None
    input_ids: Any = None
    padded_tokens: int = 0
    layers: dict[int, Any] = field(default_factory=dict)
    #: Set when the step ended (:meth:`WorkerCapture._screen`): on a GPU an event on the compute
    #: stream after the step (``ended``) and one on the side stream after the host copies of its
    #: positions, token ids and finiteness screen (``screened``); ``host``: those copies.
    ended: Any = None
    screened: Any = None
    host: Any = None
    number: int = -1  # the step's number in a stream (speccompat.streaming), once verified
    flagged: bool = False  # the screen found states that may not be finite (a stream's step, verified)

    def inputs(self) -> tuple[Any, Any, bool]:
        """``(positions, token ids or None, flagged)`` on the host, as numpy arrays; ``flagged``: the
        screen found that some state of the step may not be finite (:func:`maybe_nonfinite`). Waits
        for this step's host copies only, not for the steps after it."""
        if self.host is None:  # not screened (a test's step): read from the device
            ids = self.input_ids.cpu().numpy() if self.input_ids is not None else None
            flags = [bool(maybe_nonfinite(t)) for t in self.layers.values()]
            return self.positions.cpu().numpy(), ids, any(flags)
        if self.screened is not None:
            self.screened.synchronize()
        pos, ids, flagged = self.host
        return pos.numpy(), (ids.numpy() if ids is not None else None), bool(flagged.any())


#: :meth:`_Plan.buffer`: the reply's staging file is being made; its rows are placed once it is there.
PENDING = object()


class _Plan:
    """Where the rows of each request of a call go in its reply: ``[layer, offset + position]``,
    requests in the call's order (as :meth:`WorkerCapture._collect` lays them out)."""

    def __init__(self, req_ids: list[str], lengths: list[int], busy: Any = ()) -> None:
        import itertools

        if len(req_ids) != len(lengths):
            raise HiddenStatesError(f"{len(req_ids)} request ids for {len(lengths)} lengths")
        self.req_ids, self.lengths = req_ids, [int(n) for n in lengths]
        self.length = dict(zip(req_ids, self.lengths, strict=True))
        self.offset = dict(zip(req_ids, itertools.accumulate([0, *self.lengths[:-1]]), strict=True))
        self.total = sum(self.lengths)
        self.busy = list(busy)
        self.done: dict[str, int] = {}  # rows of each request placed so far
        self.off: str | None = None  # why placement is off for this call
        self.desc: dict[str, Any] | None = None
        self.buf: Any = None
        self.stream: Any = None  # the side stream the copies run on
        #: Steps whose rows wait for the reply's staging file, which is being made (``(step, runs)``).
        self.pending: list[tuple[Any, list[list[int]]]] = []

    def buffer(self, staging: Any, shape: tuple[int, ...], dtype: Any, device: Any, wait: bool = False) -> Any:
        """The reply's pinned staging view (allocated on the first step), ``None`` where the reply
        would travel inline or unpinned (then a copy would block the step), or ``PENDING`` while its
        file is being made (``wait``: wait for it instead)."""
        if self.desc is None:
            got = (staging.allocate(shape, dtype, device, busy=self.busy) if wait
                   else staging.try_allocate(shape, dtype, device, busy=self.busy))
            if got is None:
                return PENDING
            self.desc, self.buf = got
            if getattr(device, "type", device) == "cuda" and ("staging" not in self.desc or not staging.last.pinned):
                self.buf = None  # a copy into pageable memory would block the step
        if self.buf is not None and (tuple(self.buf.shape) != tuple(shape) or self.buf.dtype != dtype):
            return None
        return self.buf

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class WorkerCapture:
    """Capture state of one worker. Created by ``_setup_hidden_states_capture``."""

    def __init__(self, worker: Any, layer_ids: list[int], adapter: Any = None, strict: bool | None = None) -> None:
        from vllm.distributed import get_tp_group

        from ._state import STATE

        self.adapter = adapter or STATE.require_adapter()
        #: Strict mode: a step whose token ids cannot be verified is an error, not a counted step.
        self.strict = STATE.strict if strict is None else strict
        self.worker = worker
        self.runner = worker.model_runner
        self.base_model, self.layers = self.adapter.decoder_layers(self.runner.model)
        n = len(self.layers)
        bad = [i for i in layer_ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n]
        if bad:
            raise HiddenStatesError(f"layer ids {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
        if len(set(layer_ids)) != len(layer_ids):
            raise HiddenStatesError(f"duplicate layer ids in {layer_ids}")
        start = getattr(self.base_model, "start_layer", 0)
        end = getattr(self.base_model, "end_layer", n)
        remote = [i for i in layer_ids if not start <= i < end]
        if remote:
            raise HiddenStatesError(
                f"layer ids {remote} live on another pipeline stage (this one has {start}..{end - 1}); "
                "pipeline parallelism is not supported by speculators' generator"
            )
        self.layer_ids = list(layer_ids)
        self.conventions = self._conventions()
        hidden = getattr(getattr(self.base_model, "config", None), "hidden_size", None)
        self.hidden_size = hidden if isinstance(hidden, int) else None
        self.keep = get_tp_group().rank_in_group == 0
        self.tp_size = get_tp_group().world_size
        self.steps: list[_Step] = []
        self.collecting = False  # between _reset_capture and _get_captured_states
        self.active: _Step | None = None
        self.prompts: dict[str, list[int]] = {}
        self._handles: list[Any] = []
        self._attached: list[tuple[Any, str]] = []
        from .transport import Staging

        self.staging = Staging()  # reused for every reply of this worker (pinned when on a GPU)
        self.plan: _Plan | None = None  # where each request's rows go in the reply (see _place)
        self._side: Any = None  # the CUDA side stream of the per-step copies, made on first use
        self._attach()

    def _conventions(self) -> dict[int, Convention]:
        """The output convention of each requested layer, as the adapter declares it for its class;
        a layer class it does not declare is refused here, before anything is attached."""
        out, unknown = {}, {}
        for i in self.layer_ids:
            cls = type(self.layers[i])
            name = self.adapter.layer_convention(cls)
            if name is None:
                unknown.setdefault(cls, []).append(i)
                continue
            if name not in CONVENTIONS:
                raise HiddenStatesError(f"adapter {self.adapter.name()} declares {layer_path(cls)} with output "
                                        f"convention {name!r}; known conventions: {sorted(CONVENTIONS)}")
            out[i] = CONVENTIONS[name]
        if unknown:
            model = type(self.runner.model)
            layers = "; ".join(f"{layer_path(cls)} (layers {ids}) returns {returns_of(cls)}"
                               for cls, ids in unknown.items())
            raise UnsupportedError(
                f"model {model.__module__}.{model.__qualname__} is refused: no output convention is declared "
                f"for its decoder layer class in adapter {self.adapter.name()}: {layers}. speccompat reads "
                "the residual stream after a layer only from outputs whose convention an adapter declares "
                f"(layer_convention; known conventions: {', '.join(sorted(CONVENTIONS))}), so that a layer "
                "returning something else is not captured as plausible but wrong states"
            )
        return out

    def _attach(self) -> None:
        for i in self.layer_ids:
            self._handles.append(self.layers[i].register_forward_hook(self._layer_hook(i, self.conventions[i])))

        base_forward = self.base_model.forward

        def forward(_self: Any, *args: Any, **kwargs: Any) -> Any:
            step = self.active
            if step is not None:
                self._record_inputs(step, args, kwargs)
            return base_forward(*args, **kwargs)

        self._set_instance_attr(self.base_model, "forward", types.MethodType(forward, self.base_model))

        runner_execute = self.runner.execute_model

        def execute_model(_self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.collecting or self.adapter.is_warm_up(scheduler_output, kwargs):
                # Profiling, warm-up (outside a generate() call, also real steps of fake requests).
                return runner_execute(scheduler_output, *args, **kwargs)
            self.active = self._open_step(scheduler_output)
            try:
                return runner_execute(scheduler_output, *args, **kwargs)
            finally:
                step, self.active = self.active, None
                if step is not None and step.order is not None:
                    self.steps.append(step)
                    if self.keep and step.positions is not None:
                        if self.plan is not None:
                            self._place(step)
                        self._screen(step)

        self._set_instance_attr(self.runner, "execute_model", types.MethodType(execute_model, self.runner))

        def on_batch(batch: Any) -> None:
            if self.active is not None:
                self.active.batch = batch

        for obj, name, value in self.adapter.watch_batch(self.runner, on_batch):
            self._set_instance_attr(obj, name, value)

    def _set_instance_attr(self, obj: Any, name: str, value: Any) -> None:
        self._attached.append((obj, name))
        setattr(obj, name, value)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, name in reversed(self._attached):
            if name in vars(obj):
                delattr(obj, name)
        self._attached.clear()
        if self.plan is not None:
            self.plan.wait()
        self.staging.release()

    def _open_step(self, so: Any) -> _Step:
        scheduled, total, prompts = self.adapter.step_of(so)
        self.prompts.update(prompts)
        return _Step(scheduled=scheduled, num_tokens=total)

    def _record_inputs(self, step: _Step, args: tuple, kwargs: dict) -> None:
        names = ("input_ids", "positions")
        vals = dict(zip(names, args, strict=False))
        vals.update({k: kwargs[k] for k in names if k in kwargs})
        positions = vals.get("positions")
        if positions is None:
            raise HiddenStatesError("the model was called without positions; cannot attribute tokens")
        positions = self.adapter.step_positions(positions)
        n = step.num_tokens
        step.positions = positions[:n].clone()
        ids = vals.get("input_ids")
        if ids is None:  # inputs_embeds (multimodal): the runner's own buffers hold the token ids
            ids = self.adapter.step_token_ids(self.runner, step.batch, n)
        step.input_ids = ids[:n].clone() if ids is not None else None
        step.padded_tokens = positions.shape[0]
        if step.order is None:
            order = self.adapter.batch_order(self.runner, step.batch)
            step.order = [r for r in order if r is not None and r in step.scheduled]

    def _layer_hook(self, layer_id: int, convention: Convention):
        def hook(module: Any, _inputs: Any, output: Any) -> None:
            # Every call, warm-up included: a layer whose output no longer has the declared
            # structure must fail loudly, not be summed into plausible states.
            problem = convention.check(output, self.hidden_size)
            if problem is not None:
                raise HiddenStatesError(
                    f"decoder layer {layer_id} ({layer_path(type(module))}) does not follow the output "
                    f"convention {convention.name!r} that adapter {self.adapter.name()} declares for it "
                    f"({convention.doc}): {problem}"
                )
            step = self.active
            if step is None or step.positions is None:
                return
            stream = convention.stream(output)
            stream = self.adapter.gather_layer_output(stream, step.padded_tokens, self.tp_size)
            if self.keep:
                step.layers[layer_id] = stream[: step.num_tokens]

        return hook

    def reset(self, collecting: bool = True, req_ids: Any = None, lengths: Any = None, busy: Any = ()) -> None:
        """Start (or end) a call. With the call's ``req_ids`` and prompt ``lengths`` (the driver
        knows them before the first step), states captured on a GPU are copied to their place in the
        reply as each step ends (:meth:`_place`), overlapping the next steps' forward."""
        if self.plan is not None:
            self.plan.wait()  # no copy of the last call may still write into a staging file
        self.steps = []
        self.active = None
        self.prompts = {}
        self.collecting = collecting
        self.plan = _Plan(list(req_ids), list(lengths), busy) if collecting and req_ids is not None else None

    def _side_stream(self, device: Any) -> Any:
        import torch

        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _place(self, step: _Step) -> None:
        """Copy the step's rows of every layer to their place in the reply, on a side stream. Every
        step of the call is placed for as long as ``plan.off`` is unset.

        The place of a request's chunk is its offset in the call plus the tokens of it placed so far:
        what the verification in :meth:`_collect` later checks against the positions the model ran.
        On CPU the copy is made at once (one copy instead of the gather's two). Any step that cannot
        be placed (a request outside the plan, a reply that would travel in unpinned memory from a
        GPU) turns placement off for the call: :meth:`_collect` then gathers
        every row from the device as before. A step's tokens of consecutive requests are one run."""
        plan = self.plan
        if plan is None or plan.off:
            return
        first = step.layers.get(self.layer_ids[0])
        if len(step.layers) != len(self.layer_ids) or first is None:
            plan.off = "a step without the states of every layer"
            return
        if first.device.type not in ("cuda", "cpu"):
            plan.off = f"states on a {first.device.type} device"
            return
        runs: list[list[int]] = []  # [source row, destination row, rows]
        src = 0
        for rid in step.order:
            n = step.scheduled[rid]
            start, offset, length = plan.done.get(rid, 0), plan.offset.get(rid), plan.length.get(rid, 0)
            if offset is None or start + n > length:
                plan.off = f"request {rid} outside the call's plan"
                return
            dst = offset + start
            if runs and runs[-1][1] + runs[-1][2] == dst:
                runs[-1][2] += n
            else:
                runs.append([src, dst, n])
            plan.done[rid] = start + n
            src += n
        plan.pending.append((step, runs))
        self._place_pending(first)

    def _place_pending(self, first: Any, wait: bool = False) -> None:
        """Copy the rows of the steps waiting for the reply's staging file, once it is there (or
        ``wait`` for it: the end of the call). A file that must be made is made on a thread while
        the next steps compute (:meth:`~speccompat.transport.Staging.try_allocate`); their rows stay
        on the device until then, as every step's do until the call is collected."""
        plan = self.plan
        try:
            buf = plan.buffer(self.staging, (len(self.layer_ids), plan.total, first.shape[-1]), first.dtype,
                              first.device, wait=wait)
        except Exception as exc:  # noqa: BLE001 - placement is an optimisation: gather at the end instead
            plan.off = f"no staging file: {exc}"
            return
        if buf is PENDING:
            return
        if buf is None:
            plan.off = "the reply travels inline or in unpinned memory"
            return
        steps, plan.pending = plan.pending, []
        if first.device.type == "cpu":  # one copy now instead of two (cat, index_select) at the end
            for step, runs in steps:
                for i, layer_id in enumerate(self.layer_ids):
                    t = step.layers[layer_id]
                    for s0, d0, n in runs:
                        buf[i, d0 : d0 + n].copy_(t[s0 : s0 + n])
            return
        import torch

        side = plan.stream = self._side_stream(first.device)
        side.wait_stream(torch.cuda.current_stream(first.device))
        with torch.cuda.stream(side):
            for step, runs in steps:
                for i, layer_id in enumerate(self.layer_ids):
                    t = step.layers[layer_id]
                    t.record_stream(side)  # the caching allocator must not reuse it before the copy ran
                    for s0, d0, n in runs:
                        buf[i, d0 : d0 + n].copy_(t[s0 : s0 + n], non_blocking=True)

    def _screen(self, step: _Step) -> None:
        """Bring the step's positions, token ids and finiteness screen (one flag per layer) to the
        host as the step ends. On a GPU on the side stream, after the step's work, while the next
        step runs: what verifies the step later (:meth:`_Step.inputs`) then waits for this step's
        copies alone, never for the steps submitted after it; ``step.ended`` marks the step's end on
        the compute stream, for the copies of a stream's take (``speccompat.streaming.take``)."""
        import torch

        layers = [step.layers[i] for i in self.layer_ids if i in step.layers]
        device = step.positions.device
        if device.type != "cuda":
            flags = torch.stack([maybe_nonfinite(t) for t in layers]) if layers else torch.zeros(1, dtype=torch.bool)
            step.host = (step.positions.cpu(), step.input_ids.cpu() if step.input_ids is not None else None, flags)
            return
        step.ended = torch.cuda.Event()
        step.ended.record(torch.cuda.current_stream(device))
        side = self._side_stream(device)
        side.wait_event(step.ended)
        with torch.cuda.stream(side):
            for t in (*layers, step.positions, step.input_ids):
                if t is not None:
                    t.record_stream(side)  # the caching allocator must not reuse it before the screen ran
            flags = torch.stack([maybe_nonfinite(t) for t in layers]) if layers else torch.zeros(1, dtype=torch.bool,
                                                                                                device=device)
            step.host = tuple(t.to("cpu", non_blocking=True) if t is not None else None  # pinned, asynchronous
                              for t in (step.positions, step.input_ids, flags))
            step.screened = torch.cuda.Event()
            step.screened.record(side)

    def collect(self, req_ids: list[str], busy: Any = ()) -> dict[str, Any] | None:
        """Verify and pack the states of ``req_ids`` (in that order). Only TP rank 0 answers."""
        try:
            return self._collect(req_ids, busy) if self.keep else None
        finally:
            self.reset(collecting=False)

    def _collect(self, req_ids: list[str], busy: Any = ()) -> dict[str, Any]:
        import time

        import numpy as np
        import torch

        t0 = time.perf_counter()
        chunks: dict[str, list[tuple[int, int]]] = {}  # rid -> [(row in all steps' tokens, n)]
        done: dict[str, int] = {}
        restarts = base = unverified = 0
        flagged = False  # the screen of some step found values that may not be finite
        for k, step in enumerate(self.steps):
            if len(step.layers) != len(self.layer_ids):
                missing = sorted(set(self.layer_ids) - set(step.layers))
                raise HiddenStatesError(f"step {k}: layers {missing} produced no output")
            if sorted(step.order) != sorted(step.scheduled):
                raise HiddenStatesError(
                    f"step {k}: batch order {step.order} does not cover the scheduled requests "
                    f"{sorted(step.scheduled)}"
                )
            sizes = np.array([step.scheduled[rid] for rid in step.order], dtype=np.int64)
            offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            if int(sizes.sum()) != step.num_tokens:
                raise HiddenStatesError(f"step {k}: {int(sizes.sum())} tokens attributed, {step.num_tokens} scheduled")
            pos, ids, step_flagged = step.inputs()
            flagged = flagged or step_flagged
            starts = pos[offsets].tolist() if len(pos) else []
            for rid, start in zip(step.order, starts, strict=True):
                if start == 0 and done.get(rid):
                    # Preempted and recomputed from the start: the earlier chunks are void.
                    chunks[rid], done[rid] = [], 0
                    restarts += 1
                if start != done.get(rid, 0):
                    raise self._misplaced(k, rid, pos, step, done.get(rid, 0))
            # One comparison per step: every chunk's positions run start, start+1, ...
            expected = np.repeat(np.array(starts) - offsets, sizes) + np.arange(step.num_tokens)
            if not np.array_equal(pos, expected):
                bad = int(np.flatnonzero(pos != expected)[0])
                rid = step.order[int(np.searchsorted(offsets, bad, side="right")) - 1]
                raise self._misplaced(k, rid, pos, step, done.get(rid, 0))
            if ids is None or not all(rid in self.prompts for rid in step.order):
                if self.strict:
                    raise HiddenStatesError(
                        f"step {k}: its token ids could not be read (the model was called without "
                        "input_ids and the runner's buffers hold none), so the tokens of "
                        f"{step.order} cannot be verified against their prompts (strict mode)"
                    )
                unverified += 1
            else:
                want = [t for rid, s0, n in zip(step.order, starts, sizes.tolist(), strict=True)
                        for t in self.prompts[rid][s0 : s0 + n]]
                if not np.array_equal(ids, np.asarray(want, dtype=ids.dtype)):
                    bad = int(np.flatnonzero(ids != np.asarray(want, dtype=ids.dtype))[0])
                    i = int(np.searchsorted(offsets, bad, side="right")) - 1
                    rid, s0, n = step.order[i], starts[i], int(sizes[i])
                    raise HiddenStatesError(
                        f"request {rid}, step {k}: token ids at positions {s0}..{s0 + n - 1} "
                        "differ from its prompt; tokens would be attributed to the wrong sequence"
                    )
            for rid, s0, off, n in zip(step.order, starts, offsets.tolist(), sizes.tolist(), strict=True):
                chunks.setdefault(rid, []).append((base + off, n))
                done[rid] = s0 + n
            base += step.num_tokens
        lengths = []
        for rid in req_ids:
            want_len = len(self.prompts.get(rid, ()))
            if rid not in done or done[rid] != want_len or want_len == 0:
                raise HiddenStatesError(f"request {rid}: captured {done.get(rid, 0)} of {want_len} prompt tokens")
            lengths.append(want_len)
        t_verified = time.perf_counter()
        plan = self.plan
        if plan is not None:
            if plan.pending and plan.off is None:  # the staging file was still being made
                self._place_pending(plan.pending[0][0].layers[self.layer_ids[0]], wait=True)
            plan.wait()  # the last steps' copies
            if (plan.off is None and plan.buf is not None and restarts == 0 and plan.req_ids == list(req_ids)
                    and plan.lengths == lengths and not (flagged and self._any_nonfinite())):
                stats = self._stats(req_ids, chunks, restarts, unverified, t0, t_verified, len(self.steps))
                return {"req_ids": list(req_ids), "lengths": lengths, "layer_ids": list(self.layer_ids),
                        "states": plan.desc, "nonfinite": {}, "stats": stats}
            # otherwise gathered below (and non-finite values located there for the report)
            if plan.off:
                logger.debug("states gathered at the end of the call: %s", plan.off)
        # Rows of all steps' tokens, in the order of req_ids and their chunks: one gather per layer,
        # straight into the buffer that travels to the driver (on CPU; from the device: one copy).
        index = torch.from_numpy(
            np.concatenate([np.arange(row, row + n) for rid in req_ids for row, n in chunks[rid]]))
        first = self.steps[0].layers[self.layer_ids[0]]
        states, buf = self.staging.allocate((len(self.layer_ids), len(index), first.shape[-1]), first.dtype,
                                            first.device, busy=busy)
        nonfinite = {}
        for i, layer_id in enumerate(self.layer_ids):
            every = torch.cat([s.layers[layer_id] for s in self.steps], dim=0)
            if every.device.type == "cpu":
                packed = torch.index_select(every, 0, index, out=buf[i])
            else:
                packed = every.index_select(0, index.to(every.device))
            if not all_finite(packed):  # on the device, before any copy
                bad = ~torch.isfinite(packed).all(dim=-1)
                nonfinite[layer_id] = (int(bad.nonzero()[0, 0]), int(bad.sum()))
            if packed.data_ptr() != buf[i].data_ptr():
                buf[i].copy_(packed, non_blocking=True)
        self.staging.ready()  # the staging file is reused: nothing to discard if this fails
        stats = self._stats(req_ids, chunks, restarts, unverified, t0, t_verified, 0)
        return {
            "req_ids": list(req_ids),
            "lengths": lengths,
            "layer_ids": list(self.layer_ids),
            "states": states,
            "nonfinite": nonfinite,  # layer id -> (first bad token row, rows with non-finite values)
            "stats": stats,
        }

    def _stats(self, req_ids: list[str], chunks: dict, restarts: int, unverified: int, t0: float,
               t_verified: float, placed: int) -> dict[str, Any]:
        import time

        built_s = self.staging.take_built()
        made, made_s = self.staging.take_made()
        return {
            "steps": len(self.steps),
            "chunked": sum(1 for rid in req_ids if len(chunks[rid]) > 1),
            "restarted": restarts,
            "unverified_steps": unverified,  # steps whose token ids could not be checked
            "placed_steps": placed,  # steps copied into the reply as they ended (0: gathered at the end)
            "worker_verify_s": round(t_verified - t0, 4),
            "worker_gather_s": round(time.perf_counter() - t_verified, 4),
            "staging_made": made,  # staging files this call had to make (a larger batch, or all in use)
            "staging_made_s": round(made_s, 4),  # seconds the call waited for them to be made and pinned
            "staging_built_s": round(built_s, 4),  # seconds they took on the build thread, beside the steps
        }

    def _any_nonfinite(self) -> bool:
        """Whether any captured row holds inf or nan (exactly: the confirmation of a screen that
        flagged some step): one flag per step and layer, on the device, and one synchronisation."""
        import torch

        flags = [any_nonfinite(t) for step in self.steps for t in step.layers.values()]
        return bool(torch.stack(flags).any()) if flags else False

    @staticmethod
    def _misplaced(k: int, rid: str, pos: Any, step: _Step, expect: int) -> HiddenStatesError:
        i = step.order.index(rid)
        off = sum(step.scheduled[r] for r in step.order[:i])
        got = pos[off : off + step.scheduled[rid]]
        return HiddenStatesError(
            f"request {rid}, step {k}: positions {got[:4].tolist()}... do not continue at {expect}; "
            "tokens would be attributed to the wrong sequence"
        )



def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
    """Replacement for ``HiddenStatesWorkerExtension._setup_hidden_states_capture``."""
    old = getattr(self, "_speccompat_capture", None)
    if old is not None:
        old.detach()
    self._speccompat_capture = WorkerCapture(self, list(layer_ids))
    logger.info("capturing layers %s (hooks on decoder layers)", list(layer_ids))


def reset_capture(self: Any, req_ids: list[str] | None = None, lengths: list[int] | None = None,
                  busy: list[str] | None = None) -> None:
    """Replacement for ``HiddenStatesWorkerExtension._reset_capture``. speccompat's driver also
    gives the call's request ids, prompt lengths and busy staging files (see ``WorkerCapture.reset``)."""
    cap = getattr(self, "_speccompat_capture", None)
    if cap is None:
        raise RuntimeError("Must call _setup_hidden_states_capture before capturing states")
    cap.reset(req_ids=req_ids, lengths=lengths, busy=busy or ())


def get_captured_states(self: Any, req_ids: list[str] | None = None, busy: list[str] | None = None
                        ) -> dict[str, Any] | None:
    """Replacement for ``HiddenStatesWorkerExtension._get_captured_states``. ``busy``: staging files
    the driver still holds views of (speccompat.transport.busy), which this reply must not overwrite."""
    cap = getattr(self, "_speccompat_capture", None)
    if cap is None:
        raise RuntimeError("Must call _setup_hidden_states_capture before capturing states")
    if req_ids is None:
        req_ids = list(dict.fromkeys(r for s in cap.steps for r in s.order or ()))
    return cap.collect(list(req_ids), busy or ())


def worker_info(self: Any) -> dict[str, Any]:
    """Added to the worker extension: lets the driver check that its workers are patched alike."""
    import multiprocessing

    from ._state import STATE
    from ._version import __version__

    runner = getattr(self, "model_runner", None)
    return {
        "speccompat": __version__,
        "adapter": STATE.adapter_name,
        "pid": os.getpid(),
        "runner": f"{type(runner).__module__}.{type(runner).__name__}" if runner is not None else None,
        # "spawn" in a spawned process (multiprocessing sets it there); a forked one inherits the parent's.
        "start_method": multiprocessing.get_start_method(allow_none=True),
    }
