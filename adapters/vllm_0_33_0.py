"""vLLM 0.33.0: KV-cache planning moves to its own module; set_kv_cache_layout takes a CP size;
the workers run vLLM's asynchronous scheduling on CUDA."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, Change
from speccompat.platform import device_kind
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_29_0 as prev
from .vllm_0_11_0 import EXEC, KV

PLANNING = "vllm.v1.core.kv_cache_planning"
MOVED = ("get_kv_cache_config_from_groups", "_get_kv_cache_groups_uniform_spec", "unify_hybrid_kv_cache_specs")


class Adapter(prev.Adapter):
    since = "0.33.0"
    changes = (
        Change(
            vllm="0.33.0",
            upstream=UPSTREAM_REPLACED,
            what="get_kv_cache_config_from_groups, _get_kv_cache_groups_uniform_spec, "
            "unify_hybrid_kv_cache_specs move to vllm.v1.core.kv_cache_planning and are not "
            "re-exported by kv_cache_utils (vllm/v1/core/kv_cache_planning.py:642,314,853)",
            breaks="speculators 0.3/0.4 fail at import: ImportError",
            how="speculators' generator module is executed with a scoped __import__ that serves "
            "these three names from kv_cache_planning (moved_names); vLLM's modules are untouched. "
            "apply() must therefore run before speculators.data_generation is imported",
            remove_when="never for speculators 0.3/0.4",
        ),
        Change(
            vllm="0.33.0",
            upstream=UPSTREAM_REPLACED,
            what="Executor.set_kv_cache_layout(layout_name, cp_kv_cache_interleave_size) takes a "
            "required second argument (vllm/v1/executor/abstract.py:183)",
            breaks="the 0.29 layout step would raise TypeError",
            how="publish_layout() passes parallel_config.cp_kv_cache_interleave_size, as EngineCore",
            remove_when="never for speculators 0.3/0.4",
        ),
        Change(
            vllm="0.33.0",
            upstream="none: a new model's own output convention, not a defect",
            what="Kimi-K3 (KimiK3ForConditionalGeneration, vllm/models/kimi_k3/nvidia/model.py:683) brings "
            "a decoder layer, KimiDecoderLayer, whose forward returns (hidden_states, prefix_sum, residual) "
            "(model.py:846-931), with its own aux-stream capture",
            breaks="a capture that sums output[0] + output[1] would store hidden_states + prefix_sum: "
            "plausible but wrong states, with nothing raised",
            how="its output convention is not declared (layer_outputs), so the capture refuses the model "
            "when the generator starts, naming KimiDecoderLayer and what it returns",
            remove_when="when its stream is measured against a reference and its convention declared",
        ),
        Change(
            vllm="0.33.0",
            upstream="none: a setting vLLM offers (SchedulerConfig.async_scheduling), not a defect",
            what="with SchedulerConfig.async_scheduling on, each multiprocess worker hands a step's output "
            "to an output thread and takes the next step at once (MultiprocExecutor worker: "
            "vllm/v1/executor/multiproc_executor.py:791-799, handle_output :1127-1135); off, it waits "
            "for that output's device-to-host copy before the next step",
            breaks="nothing breaks: with the synchronous workers the capture reached 0.959 of plain "
            "prefill (views, H200, 8B shape), 0.995 with them asynchronous (benchmarks/NOTES.md, "
            "'The workers' asynchronous scheduling')",
            how="scheduler_config() passes async_scheduling=True where vLLM runs on CUDA, False elsewhere "
            "(on a CPU vLLM turns it off itself); the driver's loop, the scheduler and the capture's "
            "per-step checks are unchanged; tests/engine/test_async_workers.py compares the two ways' states",
            remove_when="not a workaround: stays while the workers take it",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [Symbol(f"{KV}:{name}", absent=True, why="moved_names") for name in MOVED],
        [
            Symbol(f"{PLANNING}:get_kv_cache_config_from_groups",
                   accepts=("vllm_config", "kv_cache_groups", "available_memory"),
                   rejects=("kv_cache_specs",), why="kv_cache_config_from_groups"),
            Symbol(f"{PLANNING}:_get_kv_cache_groups_uniform_spec", positional=("kv_cache_specs",)),
            Symbol(f"{PLANNING}:unify_hybrid_kv_cache_specs", positional=("kv_cache_spec",)),
            Symbol(f"{EXEC}.set_kv_cache_layout", positional=("layout_name", "cp_kv_cache_interleave_size"),
                   why="publish_layout"),
        ],
    )

    def scheduler_config(self, cls: Any, **kw: Any) -> Any:
        kw.setdefault("is_encoder_decoder", False)
        kw["async_scheduling"] = device_kind() == "cuda"
        return cls(**kw)

    def moved_names(self) -> dict[tuple[str, str], str]:
        return {**super().moved_names(), **{(KV, name): PLANNING for name in MOVED}}

    def publish_layout(self, executor: Any, layout_name: str) -> None:
        executor.set_kv_cache_layout(
            layout_name, executor.vllm_config.parallel_config.cp_kv_cache_interleave_size
        )
