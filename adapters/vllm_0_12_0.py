"""vLLM 0.12.0 - 0.16.x: kv_cache_specs dropped, SchedulerConfig InitVars required.

Also recorded here, because they fall in this range and need no version-gated code under
speccompat: DeepseekV2's llama_4_scaling (0.12.0) and the Kimi-K2.5 wrapper's
``get_language_model()`` shapes (0.15.0 / 0.16.0). Both broke speculators' replacement forward;
speccompat keeps vLLM's own forward and captures with hooks on the decoder layers
(:mod:`speccompat.capture`), which sees every argument vLLM passes and finds the layers under
any wrapper.
"""

from __future__ import annotations

import types
from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, UPSTREAM_SP225, Change
from speccompat.errors import HiddenStatesError
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_11_1 as prev
from .vllm_0_11_0 import KV

RUNNER_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"


class Adapter(prev.Adapter):
    since = "0.12.0"
    changes = (
        Change(
            vllm="0.12.0",
            upstream=UPSTREAM_SP225,
            what="get_kv_cache_config_from_groups drops kv_cache_specs "
            "(vllm/v1/core/kv_cache_utils.py:1050)",
            breaks="speculators 0.3.0 passes kv_cache_specs=: TypeError",
            how="kv_cache_config_from_groups() drops the argument",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.12.0",
            upstream=UPSTREAM_SP225,
            what="SchedulerConfig InitVars max_model_len and is_encoder_decoder become required "
            "(vllm/config/scheduler.py:31,37)",
            breaks="speculators 0.3.0 does not pass is_encoder_decoder: TypeError",
            how="scheduler_config() passes is_encoder_decoder=False (inherited from 0.11.1)",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.12.0",
            upstream="none: no upstream report found; speculators' copied forward drops it silently",
            what="DeepseekV2DecoderLayer.forward(..., llama_4_scaling=None); DeepseekV2Model.forward "
            "computes it from config.llama_4_scaling (vllm/model_executor/models/deepseek_v2.py:1188,1324)",
            breaks="speculators' replacement forward calls layer(hidden_states=, positions=, residual=) "
            "and drops it: numerically wrong hidden states for checkpoints that set llama_4_scaling",
            how="vLLM's own forward runs; capture uses forward hooks on the decoder layers",
            remove_when="never for speculators 0.3/0.4",
        ),
        Change(
            vllm="0.12.0",
            upstream=UPSTREAM_REPLACED,
            what="model runner V2 appears (vllm/v1/worker/gpu/model_runner.py, opt-in): no persistent "
            "input_batch; prepare_inputs() builds an InputBatch per step (req_ids, input_ids) and "
            "warm-up runs execute_model(..., dummy_run=True)",
            breaks="speculators 0.4's capture reads model_runner.input_batch: AttributeError on V2",
            how="worker side: watch_batch() records each step's InputBatch, batch_order() and "
            "step_token_ids() read it, is_warm_up() skips dummy runs (V1 runners keep the 0.11 path)",
            remove_when="n/a",
        ),
        Change(
            vllm="0.15.0",
            upstream="none: no upstream report found",
            what="kimi_k25.py appears; in 0.15.x KimiK25ForConditionalGeneration.get_language_model() "
            "returns a bare DeepseekV2Model, from 0.16.0 a DeepseekV2ForCausalLM",
            breaks="speculators 0.4 takes get_language_model().model: AttributeError on 0.15.x",
            how="capture looks for the decoder layers under either shape",
            remove_when="when 0.15.x leaves the support range",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol(f"{KV}:get_kv_cache_config_from_groups",
                   accepts=("vllm_config", "kv_cache_groups", "available_memory"),
                   rejects=("kv_cache_specs",), why="kv_cache_config_from_groups"),
            Symbol(f"{RUNNER_V2}.prepare_inputs", accepts=("scheduler_output",), called=False,
                   why="worker: watch_batch (V2)"),
            Symbol(f"{RUNNER_V2}.execute_model", accepts=("scheduler_output",), called=False,
                   why="worker: capture wraps it"),
            Symbol("vllm.v1.worker.gpu.input_batch:InputBatch", accepts=("req_ids", "input_ids"), called=False,
                   why="worker: batch_order, step_token_ids (V2)"),
        ],
    )

    # ------------------------------------------------------------------------------ worker side
    # Model runner V2 (vllm/v1/worker/gpu/, opt-in from 0.12.0, the GPU default from 0.22-0.29) has
    # no persistent input_batch: prepare_inputs() returns a fresh InputBatch per step, which holds
    # the batch order (req_ids) and the step's token ids (input_ids, also with inputs_embeds).
    @staticmethod
    def _is_v2(runner: Any) -> bool:
        return not hasattr(runner, "input_batch") and hasattr(runner, "prepare_inputs")

    def is_warm_up(self, scheduler_output: Any, kwargs: dict[str, Any]) -> bool:
        # The V2 runner profiles and warms up through execute_model(..., dummy_run=True) and with
        # real steps of fake requests (outside a generate() call, so never collected).
        return super().is_warm_up(scheduler_output, kwargs) or bool(kwargs.get("dummy_run"))

    def watch_batch(self, runner: Any, on_batch: Any) -> list[tuple[Any, str, Any]]:
        if not self._is_v2(runner):
            return super().watch_batch(runner, on_batch)
        prepare = runner.prepare_inputs

        def prepare_inputs(_self: Any, *args: Any, **kwargs: Any) -> Any:
            batch = prepare(*args, **kwargs)
            on_batch(batch)
            return batch

        return [(runner, "prepare_inputs", types.MethodType(prepare_inputs, runner))]

    def batch_order(self, runner: Any, batch: Any) -> list[str | None]:
        if not self._is_v2(runner):
            return super().batch_order(runner, batch)
        if batch is None:
            raise HiddenStatesError(f"{type(runner).__name__}: the step ran without prepare_inputs()")
        return list(batch.req_ids)

    def step_token_ids(self, runner: Any, batch: Any, num_tokens: int) -> Any:
        if not self._is_v2(runner):
            return super().step_token_ids(runner, batch, num_tokens)
        ids = getattr(batch, "input_ids", None)
        return ids[:num_tokens] if ids is not None else None

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        kw.pop("kv_cache_specs", None)
        return fn(**kw)
