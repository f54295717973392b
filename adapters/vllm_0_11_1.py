"""vLLM 0.11.1 - 0.11.2: block_size in Scheduler, two-phase execution, bare collective_rpc replies."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_SP225, Change
from speccompat.errors import DriftError, HiddenStatesError
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_11_0 as prev
from .vllm_0_11_0 import EXEC, SCHED


class Adapter(prev.Adapter):
    since = "0.11.1"
    changes = (
        Change(
            vllm="0.11.1",
            upstream=UPSTREAM_SP225,
            what="Scheduler.__init__ gains a required block_size (vllm/v1/core/sched/scheduler.py:53)",
            breaks="speculators 0.3.0: TypeError",
            how="Scheduler is given the block size vLLM resolved (never speculators' constant)",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.11.1",
            upstream="https://github.com/vllm-project/vllm/pull/26866",
            what="two-phase execution: execute_model() returns None and sample_tokens() must follow "
            "(vllm/v1/executor/multiproc_executor.py:265; gpu_model_runner.py:2631 raises "
            "'State error: sample_tokens() must be called after execute_model() returns None')",
            breaks="speculators 0.3.0 never calls sample_tokens: the second step raises",
            how="submit() sends sample_tokens(None) after execute_model, as EngineCore's batch queue; "
            "an output execute_model returned itself takes precedence",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.11.1",
            upstream=UPSTREAM_SP225,
            what="collective_rpc(unique_reply_rank=r) returns the bare reply, not a one-element list "
            "(multiproc_executor.py:346 'return responses[0] if output_rank is not None')",
            breaks="speculators 0.3.0 takes [0] of the bare reply: the first layer's tensor is then "
            "sliced as if it were the list of layers, silently dropping the others",
            how="the fixed generate() reads replies through unique_reply(), which checks the shape",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.11.1",
            upstream=UPSTREAM_SP225,
            what="base models rename get_input_embeddings to embed_input_ids "
            "(e.g. vllm/model_executor/models/llama.py)",
            breaks="speculators 0.3.0's replacement forward calls get_input_embeddings: AttributeError",
            how="capture no longer replaces the model's forward (speccompat.capture hooks the "
            "decoder layers), so the model's own embedding path runs",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.11.1",
            upstream="none: an internal module move; speculators 0.4 imports the new path",
            what="get_hash_fn_by_name moves from vllm.utils to vllm.utils.hashing",
            breaks="speculators 0.4.x imports vllm.utils.hashing: ImportError on 0.11.0",
            how="the 0.11.0 adapter serves the name from vllm.utils (moved_names)",
            remove_when="when 0.11.0 leaves the support range",
        ),
        Change(
            vllm="0.11.1",
            upstream=UPSTREAM_SP225,
            what="SchedulerConfig gains InitVars max_model_len and is_encoder_decoder "
            "(vllm/config/scheduler.py:85,91)",
            breaks="nothing yet (defaults exist until 0.12.0)",
            how="scheduler_config() passes is_encoder_decoder=False when the caller did not",
            remove_when="never for speculators 0.3.0",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol("vllm.config:SchedulerConfig", accepts=("max_num_seqs", "max_num_batched_tokens",
                                                           "max_model_len", "is_encoder_decoder",
                                                           "async_scheduling"), why="scheduler_config"),
            Symbol(SCHED, accepts=("vllm_config", "kv_cache_config", "structured_output_manager",
                                   "block_size"), why="scheduler"),
            Symbol("vllm.utils.hashing:get_hash_fn_by_name", accepts=("hash_fn_name",)),
            Symbol(f"{EXEC}.collective_rpc", accepts=("method", "args", "unique_reply_rank",
                                                      "kv_output_aggregator"), why="unique_reply: bare"),
            Symbol(f"{EXEC}.execute_model", accepts=("non_block",), positional=("scheduler_output",), why="submit"),
            Symbol(f"{EXEC}.sample_tokens", accepts=("non_block",), positional=("grammar_output",),
                   why="submit: two phases"),
        ],
    )
    # 0.11.0's location of get_hash_fn_by_name is no longer part of the fingerprint.
    requires.pop("vllm.utils:get_hash_fn_by_name", None)

    def moved_names(self) -> dict[tuple[str, str], str]:
        return {}

    def scheduler_config(self, cls: Any, **kw: Any) -> Any:
        kw.setdefault("is_encoder_decoder", False)
        kw["async_scheduling"] = False
        return cls(**kw)

    def scheduler(self, cls: Any, **kw: Any) -> Any:
        kw["block_size"] = self.resolved_block_size(kw["vllm_config"], kw["kv_cache_config"])
        return cls(**kw)

    def submit(self, executor: Any, scheduler_output: Any) -> Any:
        executed = executor.execute_model(scheduler_output, non_block=True)
        if not scheduler_output.total_num_scheduled_tokens:
            return executed  # a step that only carries finished request ids: nothing to sample
        return Sampled(executed, executor.sample_tokens(None, non_block=True))

    def in_flight(self, executor: Any) -> int:
        # The workers run synchronously (scheduler_config turns asynchronous scheduling off); on a
        # GPU the driver still schedules and sends step N+1 while step N runs, as EngineCore's batch
        # queue does under pipeline parallelism with the same Scheduler. On a CPU the driver and the
        # forward share the cores and vLLM turns asynchronous scheduling off: one step, the loop the
        # CPU cells of the matrix were shown with (two measured no gain on 2 cores:
        # benchmarks/results/throughput-cpu-two-in-flight.json).
        from speccompat.platform import device_kind

        return 1 if device_kind() == "cpu" else 2

    def unique_reply(self, reply: Any) -> Any:
        # Our worker methods return dicts; a list here means the reply shape changed again.
        if isinstance(reply, list):
            raise DriftError(
                "collective_rpc(unique_reply_rank=0) returned a list; this adapter expects the "
                "bare reply (vLLM >= 0.11.1)",
                symbol=f"{EXEC}.collective_rpc",
                problem="reply shape",
            )
        return reply


class Sampled:
    """The future of a two-phase step: ``execute_model``'s reply, then ``sample_tokens``'.

    The executor answers in order, so waiting for the sample also collects the execution; an error
    raised by ``execute_model`` in a worker is the one re-raised here.
    """

    def __init__(self, executed: Any, sampled: Any) -> None:
        self.executed, self.sampled = executed, sampled

    def result(self) -> Any:
        try:
            sampled = self.sampled.result()
        finally:
            early = self.executed.result()
        if early is not None:
            return early  # execute_model answered the step itself (no sampling phase ran)
        if sampled is None:
            raise HiddenStatesError("a step returned no model output (execute_model and sample_tokens both None)")
        return sampled
