"""vLLM 0.34.0: the V1 model runner is gone; the KV cache is extensible by default on CUDA."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, Change
from speccompat.errors import DriftError
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_33_0 as prev
from .vllm_0_11_0 import RUNNER, _worker_drift
from .vllm_0_12_0 import RUNNER_V2

UPSTREAM_EXTENSIBLE = "https://github.com/vllm-project/vllm/pull/50779"
EXTENSIBLE = "vllm.config:CacheConfig.enable_extensible_kv_cache"
#: What backs an extensible KV cache: vLLM's engine core, which speculators' engine does not run.
ENGINE_STEPS = ("EngineCore._initialize_kv_caches: compile_or_warm_up_model() -> "
                "finalize_extensible_kv_cache(...) -> executor.extend_kv_cache(num_blocks) "
                "(vllm/v1/engine/core.py)")


class Adapter(prev.Adapter):
    since = "0.34.0"
    changes = (
        Change(
            vllm="0.34.0",
            upstream=UPSTREAM_REPLACED,
            what="the V1 model runner is removed: vllm/v1/worker/gpu_model_runner.py, gpu_input_batch.py "
            "and cpu_model_runner.py are deleted and Worker._make_model_runner always builds "
            "vllm.v1.worker.gpu.model_runner.GPUModelRunner (vllm/v1/worker/gpu_worker.py:579-587); "
            "VLLM_USE_V2_MODEL_RUNNER set to anything but 1 raises in EngineArgs "
            "(vllm/platforms/interface.py:1481-1490)",
            breaks="speculators 0.3/0.4 never name the runner; speccompat's capture would read a V1 "
            "input_batch that no longer exists",
            how="the fingerprint requires the V1 runner to be gone and the V2 runner's prepare_inputs; "
            "the worker side reads the V2 runner only and refuses any other runner, naming it",
            remove_when="not a workaround: the capture reads the one runner vLLM has",
        ),
        Change(
            vllm="0.34.0",
            upstream=UPSTREAM_EXTENSIBLE,
            what="CacheConfig.enable_extensible_kv_cache (vllm/config/cache.py:395) is resolved to True on "
            "CUDA/ROCm by VllmConfig.__post_init__ (_resolve_extensible_kv_cache, vllm/config/vllm.py:"
            "3180-3263) unless set; the workers then reserve the KV cache's address range and commit only "
            "the null block (vllm/v1/worker/gpu_worker.py:909-944) until " + ENGINE_STEPS,
            breaks="speculators' hand-built engine never runs those steps: the scheduler hands out KV "
            "blocks that no memory backs, an illegal-address fault at best, states computed over "
            "unmapped KV blocks at worst; no signature changed, so no fingerprint can see it",
            how="cache_config() passes enable_extensible_kv_cache=False (an explicit False is honoured: "
            "vllm/config/vllm.py:3250-3254), so the workers allocate the whole KV cache up front as before; "
            "vllm_config() refuses a config in which it is still on, and the worker refuses the step of "
            "a runner that holds an extensible KV cache before it runs, so no state is ever returned",
            remove_when="never for speculators 0.3/0.4 (their engine has no place for the three steps)",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            # the V1 runner, which the earlier adapters' fingerprints read, must be gone
            Symbol(f"{RUNNER}.execute_model", absent=True, why="worker: V2 runner only"),
            Symbol("vllm.v1.worker.gpu_input_batch:InputBatch.req_ids", absent=True, why="worker: V2 runner only"),
            Symbol("vllm.config:CacheConfig", accepts=("block_size", "gpu_memory_utilization",
                                                       "enable_prefix_caching", "enable_extensible_kv_cache"),
                   why="cache_config: extensible KV cache off"),
            Symbol(f"{RUNNER_V2}.initialize_kv_cache", accepts=("extensible",), called=False,
                   why="worker: a runner's KV cache may be extensible"),
        ],
    )

    # ------------------------------------------------------------------------------ config time
    def cache_config(self, cls: Any, **kw: Any) -> Any:
        kw["enable_extensible_kv_cache"] = False
        return super().cache_config(cls, **kw)

    def vllm_config(self, cls: Any, **kw: Any) -> Any:
        config = super().vllm_config(cls, **kw)
        if getattr(config.cache_config, "enable_extensible_kv_cache", False):
            raise DriftError(
                "vLLM turned the extensible KV cache on for this engine: speculators' engine never runs "
                f"{ENGINE_STEPS}, so its KV blocks would not be backed by memory",
                symbol=EXTENSIBLE,
                problem="on (the CUDA default from vLLM 0.34.0); speccompat sets it off in CacheConfig",
            )
        return config

    # ------------------------------------------------------------------------------ worker side
    def watch_batch(self, runner: Any, on_batch: Any) -> list[tuple[Any, str, Any]]:
        _require_v2(self, runner)

        def on_step_batch(batch: Any) -> None:
            # Every step, before the model runs: an extensible KV cache is backed only by vLLM's
            # engine core, which this engine does not run.
            if getattr(runner, "extensible_kv_cache", None) is not None:
                raise _worker_drift(EXTENSIBLE, RuntimeError(
                    f"{type(runner).__name__} holds an extensible KV cache: its blocks are committed only by "
                    f"{ENGINE_STEPS}, which this engine does not run"))
            on_batch(batch)

        return super().watch_batch(runner, on_step_batch)

    def batch_order(self, runner: Any, batch: Any) -> list[str | None]:
        _require_v2(self, runner)
        return super().batch_order(runner, batch)

    def step_token_ids(self, runner: Any, batch: Any, num_tokens: int) -> Any:
        _require_v2(self, runner)
        return super().step_token_ids(runner, batch, num_tokens)


def _require_v2(adapter: Adapter, runner: Any) -> None:
    if not adapter._is_v2(runner):
        raise _worker_drift(f"{RUNNER_V2}.prepare_inputs", AttributeError(
            f"{type(runner).__module__}.{type(runner).__name__} is not the V2 model runner, the only one "
            "vLLM 0.34 has"))
