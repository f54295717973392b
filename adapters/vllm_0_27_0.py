"""vLLM 0.27.0 - 0.28.x: the engine core warms the model up itself."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, Change
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_17_0 as prev
from .vllm_0_11_0 import EXEC


class Adapter(prev.Adapter):
    since = "0.27.0"
    changes = (
        Change(
            vllm="0.27.0",
            upstream=UPSTREAM_REPLACED,
            what="Executor.initialize_from_config no longer runs compile_or_warm_up_model; "
            "EngineCore calls executor.compile_or_warm_up_model() itself "
            "(vllm/v1/executor/abstract.py:118, vllm/v1/engine/core.py:332)",
            breaks="speculators skips the warm-up: workers start serving without the sampler / "
            "kernel warm-up the engine always does",
            how="after_kv_cache_init() calls executor.compile_or_warm_up_model()",
            remove_when="never for speculators 0.3/0.4",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol(f"{EXEC}.compile_or_warm_up_model", new=True, why="after_kv_cache_init: warm-up"),
        ],
    )

    def after_kv_cache_init(self, executor: Any) -> None:
        super().after_kv_cache_init(executor)
        executor.compile_or_warm_up_model()
