"""vLLM 0.29.0 - 0.32.x: the KV-cache layout must be resolved before KV-cache planning."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, Change
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_28_0 as prev
from .vllm_0_11_0 import EXEC

LAYOUT = "vllm.v1.attention.backends.utils:resolve_kv_cache_layout"


class Adapter(prev.Adapter):
    since = "0.29.0"
    changes = (
        Change(
            vllm="0.29.0",
            upstream=UPSTREAM_REPLACED,
            what="get_kv_cache_config_from_groups reads cache_config.get_resolved_kv_cache_layout(), "
            "which raises until the engine ran resolve_kv_cache_layout(...) and "
            "executor.set_kv_cache_layout(...) (vllm/v1/core/kv_cache_utils.py:1435; "
            "vllm/v1/engine/core.py resolves it right after the executor starts)",
            breaks="speculators 0.3/0.4: ValueError 'KV cache layout has not been resolved yet'",
            how="after_executor_start() resolves the layout from the workers' KV specs and supported "
            "layouts and publishes it, as EngineCore does; the KV cache config carries it to workers",
            remove_when="never for speculators 0.3/0.4",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol(LAYOUT, positional=("vllm_config", "supported_layouts", "kv_cache_specs"), new=True,
                   why="after_executor_start: layout"),
            Symbol(f"{EXEC}.get_supported_kv_cache_layouts"),
            Symbol(f"{EXEC}.get_kv_cache_specs"),
            Symbol(f"{EXEC}.set_kv_cache_layout", positional=("layout_name",),
                   rejects=("cp_kv_cache_interleave_size",), why="publish_layout"),
        ],
    )

    def after_executor_start(self, executor: Any) -> None:
        super().after_executor_start(executor)
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        specs = executor.get_kv_cache_specs()
        layout = resolve_kv_cache_layout(
            executor.vllm_config,
            executor.get_supported_kv_cache_layouts(),
            [s for per_worker in specs for s in per_worker.values()],
        )
        self.publish_layout(executor, layout.name)

    def publish_layout(self, executor: Any, layout_name: str) -> None:
        executor.set_kv_cache_layout(layout_name)

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        kv_cache_config = super().kv_cache_config_from_groups(fn, **kw)
        # EngineCore stamps the resolved layout on every KV cache config it hands to workers.
        kv_cache_config.kv_cache_layout = kw["vllm_config"].cache_config.kv_cache_layout
        return kv_cache_config
