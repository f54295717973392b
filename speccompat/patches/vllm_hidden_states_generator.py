"""Patches of ``speculators.data_generation.vllm_hidden_states_generator``: the vLLM names it
imported, routed through the adapter, and the generator's methods (:mod:`speccompat.generator`)."""

from __future__ import annotations

from typing import Any

from ..adapter import UPSTREAM_BLOCK_SIZE, UPSTREAM_CPU_ROTARY, UPSTREAM_REPLACED, UPSTREAM_SP225
from ..generator import compat_del, compat_generate, wrap_init
from ..patching import Patch
from ..platform import mem_get_info, torch_view
from ._common import (
    GEN_CLASS,
    GEN_MODULE,
    NEVER_REMOVE,
    _function_wrapper,
    _live_check,
    _named,
    _route,
    _speculators_line,
    _tracking,
    check_workers,
)

__all__ = ["GENERATOR"]


def _executor_class(ctx: Any, original: type) -> type:
    adapter = ctx.adapter

    check = _live_check(f"Speccompat{original.__name__}")

    class SpeccompatExecutor(original):  # type: ignore[misc, valid-type]
        """``MultiprocExecutor`` plus the engine-core steps speculators' driver skips."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check()
            super().__init__(*args, **kwargs)
            check_workers(self)
            adapter.after_executor_start(self)

        def initialize_from_config(self, kv_cache_configs: Any) -> None:
            check()
            super().initialize_from_config(kv_cache_configs)
            adapter.after_kv_cache_init(self)

    SpeccompatExecutor.__qualname__ = SpeccompatExecutor.__name__ = f"Speccompat{original.__name__}"
    SpeccompatExecutor.__module__ = __name__
    return SpeccompatExecutor


class _TrustingAutoTokenizer:
    """``transformers.AutoTokenizer`` whose ``from_pretrained`` trusts remote code by default.
    ``__wrapped__`` is the original (as for every patch: the object speccompat replaced)."""

    def __init__(self, original: Any) -> None:
        self.__wrapped__ = original

    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("trust_remote_code", True)
        return self.__wrapped__.from_pretrained(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


GENERATOR = (
    Patch(
        id="generator.VllmConfig",
        upstream=UPSTREAM_CPU_ROTARY,
        target=f"{GEN_MODULE}:VllmConfig",
        why="engine settings speculators cannot express: on vLLM's CPU platform (0.28+) MLA models "
        "need the native rotary embedding (the CPU rotary op mis-rotates DeepSeek's strided q_pe, "
        "silently giving wrong hidden states)",
        how="adapter.vllm_config()",
        vllm_change="0.28.0 CPU MLA backend",
        remove_when="when vLLM's CPU rotary op handles strided multi-head queries",
        build=_route("vllm_config", "VllmConfig"),
    ),
    Patch(
        id="generator.CacheConfig",
        upstream=UPSTREAM_BLOCK_SIZE,
        target=f"{GEN_MODULE}:CacheConfig",
        why="speculators hard-codes block_size=16 (CPU attention from vLLM 0.30 rejects it, CPU MLA "
        "forces 16, CUDA MLA backends want 64) and 0.3.0 leaves prefix caching on",
        how="adapter.cache_config(): drop block_size (the platform picks it), prefix caching off",
        vllm_change="per-backend block sizes (0.11.0+, stricter from 0.30.0)",
        remove_when=NEVER_REMOVE,
        build=_route("cache_config", "CacheConfig"),
    ),
    Patch(
        id="generator.SchedulerConfig",
        upstream=UPSTREAM_SP225,
        target=f"{GEN_MODULE}:SchedulerConfig",
        why="is_encoder_decoder: unknown in 0.11.0, required from 0.12.0 (0.3.0 omits it); "
        "async scheduling must be off for a hand-driven synchronous Scheduler",
        how="adapter.scheduler_config()",
        vllm_change="0.11.1 / 0.12.0 SchedulerConfig InitVars",
        remove_when=NEVER_REMOVE,
        build=_route("scheduler_config", "SchedulerConfig"),
    ),
    Patch(
        id="generator.get_kv_cache_config_from_groups",
        upstream=UPSTREAM_SP225,
        target=f"{GEN_MODULE}:get_kv_cache_config_from_groups",
        why="kv_cache_specs required until 0.11.2 and rejected from 0.12.0; the resolved KV layout "
        "must travel with the config from 0.29.0",
        how="adapter.kv_cache_config_from_groups()",
        vllm_change="0.12.0 signature, 0.29.0 KV layout, 0.33.0 module move",
        remove_when=NEVER_REMOVE,
        build=_route("kv_cache_config_from_groups", "get_kv_cache_config_from_groups"),
    ),
    Patch(
        id="generator.Scheduler",
        upstream=UPSTREAM_SP225,
        target=f"{GEN_MODULE}:Scheduler",
        why="block_size: required from 0.11.1 (0.3.0 omits it) and must be the size vLLM "
        "resolved, not speculators' constant 16",
        how="adapter.scheduler()",
        vllm_change="0.11.1 Scheduler(block_size=)",
        remove_when=NEVER_REMOVE,
        build=_route("scheduler", "Scheduler"),
    ),
    Patch(
        id="generator.Request",
        upstream=UPSTREAM_REPLACED,
        target=f"{GEN_MODULE}:Request",
        why="Request(eos_token_id=) is a TypeError from vLLM 0.17.0",
        how="adapter.request()",
        vllm_change="0.17.0 Request.__init__",
        remove_when=NEVER_REMOVE,
        build=_route("request", "Request"),
    ),
    Patch(
        id="generator.MultiprocExecutor",
        upstream=UPSTREAM_REPLACED,
        target=f"{GEN_MODULE}:MultiprocExecutor",
        why="the engine core resolves the KV layout (0.29.0+) and warms the model up (0.27.0+) "
        "around the executor; speculators' driver does neither. Workers must run speccompat too",
        how="a subclass that checks its workers, then calls adapter.after_executor_start() and "
        "adapter.after_kv_cache_init()",
        vllm_change="0.27.0 compile_or_warm_up_model, 0.29.0 KV layout, 0.33.0 set_kv_cache_layout",
        remove_when=NEVER_REMOVE,
        build=_executor_class,
    ),
    Patch(
        id="generator.mem_get_info",
        upstream="none: speculators 0.3/0.4 target CUDA; vLLM's CPU backend is speccompat's addition",
        target=f"{GEN_MODULE}:mem_get_info",
        why="speculators 0.4's mem_get_info returns (0, 0) without an accelerator: no KV blocks on CPU",
        how="speccompat.platform.mem_get_info (host memory on vLLM's CPU platform)",
        vllm_change="none (vLLM's CPU backend)",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(mem_get_info, original),
        optional=True,  # speculators 0.3.0 calls torch.cuda.mem_get_info instead
    ),
    Patch(
        id="generator.torch",
        upstream="none: speculators 0.3/0.4 target CUDA; vLLM's CPU backend is speccompat's addition",
        target=f"{GEN_MODULE}:torch",
        why="speculators 0.3.0 calls torch.cuda.mem_get_info(): 'Found no NVIDIA driver' on CPU",
        how="the module's `torch` name becomes a proxy whose cuda.mem_get_info/empty_cache follow "
        "the platform; everything else is the real torch",
        vllm_change="none (vLLM's CPU backend)",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: torch_view(original),
        needed=lambda ctx: None if _speculators_line(ctx) == "0.3" else "speculators 0.4 uses mem_get_info",
    ),
    Patch(
        id="generator.AutoTokenizer",
        upstream="none: no upstream report found",
        target=f"{GEN_MODULE}:AutoTokenizer",
        why="speculators loads the tokenizer with AutoTokenizer.from_pretrained(model_path) but "
        "without trust_remote_code (which it passes to AutoConfig and ModelConfig): Kimi-K2.5 ships "
        "its tokenizer as code, so the generator cannot even be built for it",
        how="from_pretrained() defaults trust_remote_code=True, as speculators does for the model",
        vllm_change="none (Kimi-K2.5 and other models with tokenizer code)",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _TrustingAutoTokenizer(original),
    ),
    Patch(
        id="generator.__init__",
        upstream="none: validation speculators never had; no upstream report found",
        target=f"{GEN_CLASS}.__init__",
        why="duplicate or non-integer layer ids are accepted and produce duplicated/misnamed layers",
        how="wrapt wrapper that rejects them before any engine starts",
        vllm_change="none",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _function_wrapper(original, _tracking(wrap_init)),
    ),
    Patch(
        id="generator.generate",
        upstream="https://github.com/vllm-project/speculators/pull/365",
        target=f"{GEN_CLASS}.generate",
        why="silent data bugs on every vLLM: only 32 sequences admitted per call, results in sorted "
        "request-id order, no sample_tokens (0.3.0), no validation",
        how="speccompat.generator.compat_generate: the engine's own step loop, input order, "
        "verified and validated results",
        vllm_change="0.11.1 two-phase execution; 0.11.1 collective_rpc bare reply",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(compat_generate, original),
    ),
    Patch(
        id="generator.__del__",
        upstream="none: an interpreter-exit error, no upstream report found",
        target=f"{GEN_CLASS}.__del__",
        why="at interpreter exit speculators' __del__ raises AttributeError ('NoneType' object has "
        "no attribute 'warning') from its logger",
        how="shut the executor down once and quietly",
        vllm_change="none",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(compat_del, original),
    ),
)
