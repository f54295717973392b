"""vLLM 0.12.0 - 0.16.x: kv_cache_specs dropped, SchedulerConfig InitVars required.

Also recorded here, because they fall in this range and need no version-gated code under
speccompat: DeepseekV2's llama_4_scaling (0.12.0) and the Kimi-K2.5 wrapper's
``get_language_model()`` shapes (0.15.0 / 0.16.0). Both broke speculators' replacement forward;
speccompat keeps vLLM's own forward and captures with hooks on the decoder layers
(:mod:`speccompat.capture`), which sees every argument vLLM passes and finds the layers under
any wrapper.
"""

from __future__ import annotations

from typing import Any

from speccompat.adapter import Change
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_11_1 as prev
from .vllm_0_11_0 import KV


class Adapter(prev.Adapter):
    since = "0.12.0"
    changes = (
        Change(
            vllm="0.12.0",
            what="get_kv_cache_config_from_groups drops kv_cache_specs "
            "(vllm/v1/core/kv_cache_utils.py:1050)",
            breaks="speculators 0.3.0 passes kv_cache_specs=: TypeError",
            how="kv_cache_config_from_groups() drops the argument",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.12.0",
            what="SchedulerConfig InitVars max_model_len and is_encoder_decoder become required "
            "(vllm/config/scheduler.py:31,37)",
            breaks="speculators 0.3.0 does not pass is_encoder_decoder: TypeError",
            how="scheduler_config() passes is_encoder_decoder=False (inherited from 0.11.1)",
            remove_when="never for speculators 0.3.0",
        ),
        Change(
            vllm="0.12.0",
            what="DeepseekV2DecoderLayer.forward(..., llama_4_scaling=None); DeepseekV2Model.forward "
            "computes it from config.llama_4_scaling (vllm/model_executor/models/deepseek_v2.py:1188,1324)",
            breaks="speculators' replacement forward calls layer(hidden_states=, positions=, residual=) "
            "and drops it: numerically wrong hidden states for checkpoints that set llama_4_scaling",
            how="vLLM's own forward runs; capture uses forward hooks on the decoder layers",
            remove_when="never for speculators 0.3/0.4",
        ),
        Change(
            vllm="0.15.0",
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
        ],
    )

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        kw.pop("kv_cache_specs", None)
        return fn(**kw)
