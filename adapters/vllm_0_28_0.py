"""vLLM 0.28.0: DeepSeek MLA runs on the CPU platform, with a rotary op that mis-rotates it."""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_CPU_ROTARY, Change
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_27_0 as prev


class Adapter(prev.Adapter):
    since = "0.28.0"
    changes = (
        Change(
            vllm="0.28.0",
            upstream=UPSTREAM_CPU_ROTARY,
            what="a CPU MLA backend makes DeepseekV2/V3 (Kimi) runnable on vLLM's CPU platform "
            "(vllm/v1/attention/backends/mla/cpu_mla.py). MLA applies RoPE to q[..., qk_nope:], a "
            "strided [tokens, heads, 64] view; the CPU rotary custom op (RotaryEmbedding.forward_cpu "
            "-> ops.rotary_embedding) rotates such views wrongly, where forward_native is right",
            breaks="hidden states (and logits) of every DeepSeek-style model on CPU are wrong beyond "
            "bf16 noise, silently: prompt logprobs off by up to 0.4 nats on a tiny DeepseekV3",
            how="vllm_config() disables the rotary_embedding custom op "
            "(compilation_config.custom_ops += ['-rotary_embedding']) on the CPU platform for MLA "
            "models, so vLLM uses its native implementation; other models and platforms unchanged",
            remove_when="when vLLM's CPU rotary op handles strided multi-head queries",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend", new=True, why="vllm_config: CPU MLA"),
            Symbol("vllm.config:CompilationConfig", accepts=("custom_ops",), why="vllm_config"),
        ],
    )

    def vllm_config(self, cls: Any, **kw: Any) -> Any:
        from vllm.platforms import current_platform

        model_config = kw.get("model_config")
        if current_platform.is_cpu() and model_config is not None and model_config.use_mla:
            from vllm.config import CompilationConfig

            cc = kw.get("compilation_config") or CompilationConfig()
            if "-rotary_embedding" not in cc.custom_ops:
                cc.custom_ops = [*cc.custom_ops, "-rotary_embedding"]
            kw["compilation_config"] = cc
        return super().vllm_config(cls, **kw)
