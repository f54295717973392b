"""The patches: names speculators imported from vLLM, and speculators' own methods.

speculators binds vLLM names at import time (``from vllm.v1.request import Request``), so a fix
must replace the binding in speculators' module, never vLLM's attribute. Each patch below routes
the name through an operation of the selected adapter (:mod:`speccompat.adapter`), which knows
what that vLLM release expects. Methods whose logic is wrong on every release are replaced by
:mod:`speccompat.generator` (driver) and :mod:`speccompat.capture` (workers).

Three groups, one per speculators module, each applied all-or-nothing when that module is loaded:
``PYDANTIC`` (``speculators.utils.pydantic_utils``), ``GENERATOR`` and ``WORKER``.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from . import patching
from ._state import STATE
from .adapter import UPSTREAM_BLOCK_SIZE, UPSTREAM_CPU_ROTARY, UPSTREAM_REPLACED, UPSTREAM_SP225
from .errors import SpeccompatError, WorkerPatchError
from .patching import Patch

__all__ = [
    "APPLY_ENV",
    "GENERATOR",
    "GEN_MODULE",
    "GROUPS",
    "PYDANTIC",
    "PYDANTIC_MODULE",
    "WORKER",
    "WORKER_MODULE",
    "check_workers",
]

logger = logging.getLogger("speccompat")

#: Set by apply() for vLLM's worker processes: JSON of the settings the plugin re-applies
#: (``strict``, and the ``adapter`` the driver confirmed).
APPLY_ENV = "SPECCOMPAT_APPLY"

GEN_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_MODULE = "speculators.data_generation.custom_worker"
PYDANTIC_MODULE = "speculators.utils.pydantic_utils"
GEN_CLASS = f"{GEN_MODULE}:VllmHiddenStatesGenerator"
EXT_CLASS = f"{WORKER_MODULE}:HiddenStatesWorkerExtension"

#: ``remove_when`` of patches that stay as long as speculators 0.3/0.4 are served.
NEVER_REMOVE = "never for speculators 0.3/0.4 (their code is frozen)"


def _live_check(display: str) -> Any:
    """A check for shims built now: after ``revert()`` they raise instead of running half-undone."""
    built = patching.generation()

    def check() -> None:
        if patching.generation() != built:
            raise SpeccompatError(
                f"{display}: speccompat was reverted (speccompat.revert()); this object was made by "
                "speccompat before that. Call speccompat.apply() again, or build a new generator"
            )

    return check


def _route(op: str, display: str):
    """Build a keyword-only shim that calls ``adapter.<op>(original, **kwargs)``."""

    def build(ctx: Any, original: Any) -> Any:
        method = getattr(ctx.adapter, op)
        check = _live_check(display)

        def shim(*args: Any, **kwargs: Any) -> Any:
            check()
            if args:
                raise TypeError(f"{display}: speccompat's adapter takes keyword arguments only")
            return method(original, **kwargs)

        shim.__name__ = shim.__qualname__ = display
        shim.__doc__ = f"{display} adapted by speccompat ({ctx.adapter.name()}.{op}); original: {original!r}"
        shim.__wrapped__ = original  # type: ignore[attr-defined]
        return shim

    return build


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


def check_workers(executor: Any) -> list[dict[str, Any]]:
    """Ask every worker what it runs; raise :class:`WorkerPatchError` unless they match the driver.

    Skipped (with a warning) only when ``SPECCOMPAT_DISABLE`` leaves out the worker patch that
    answers, ``worker._speccompat_info``.
    """
    adapter = STATE.require_adapter().name()
    why = patching.disabled_reason("worker._speccompat_info")
    if why:
        logger.warning("workers are not checked: worker._speccompat_info is %s", why)
        return []
    try:
        infos = executor.collective_rpc("_speccompat_info")
    except Exception as exc:  # the RPC fails in the worker when the method does not exist
        raise WorkerPatchError(
            "vLLM's worker processes are not running speccompat (their HiddenStatesWorkerExtension "
            "has no _speccompat_info). Install speccompat in the environment the workers use (its "
            "'vllm.general_plugins' entry point re-applies it in every process) and call "
            f"speccompat.apply() before creating the generator. Worker error: {exc}"
        ) from exc
    bad = [i for i in infos if i.get("adapter") != adapter]
    if bad:
        raise WorkerPatchError(
            f"workers run adapter(s) {[i.get('adapter') for i in bad]} (pid "
            f"{', '.join(str(i.get('pid')) for i in bad)}), the driver {adapter}"
        )
    logger.info("workers patched: %s", ", ".join(f"pid {i['pid']} ({i['runner']})" for i in infos))
    STATE.workers = list(infos)
    return infos


def _speculators_line(ctx: Any) -> str:
    v = ctx.speculators.version
    return f"{v.major}.{v.minor}" if v is not None else "?"


PYDANTIC = (
    Patch(
        id="pydantic.reload_schema",
        upstream="none: a pydantic >= 2.13 / transformers 5 interaction, no upstream report found",
        target=f"{PYDANTIC_MODULE}:ReloadableBaseModel.reload_schema",
        why="with pydantic >= 2.13 (and transformers 5) `import speculators` fails: "
        "PydanticUndefinedAnnotation: name 'torch' is not defined, raised by "
        "reload_and_populate_configs() -> ReloadableBaseModel.reload_schema()",
        how="model_rebuild(force=True) is given _types_namespace={'torch': torch}",
        vllm_change="none (pydantic/transformers); vLLM >= 0.30 pulls in the versions that trigger it",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: classmethod(_reload_schema),
    ),
)


def _reload_schema(cls: Any) -> None:
    import torch

    cls.model_rebuild(force=True, _types_namespace={"torch": torch})


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
        build=lambda ctx, original: _named(_impl('platform', 'mem_get_info'), original),
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
        build=lambda ctx, original: _impl('platform', 'torch_view')(original),
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
        build=lambda ctx, original: _function_wrapper(original, _tracking(_impl('generator', 'wrap_init'))),
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
        build=lambda ctx, original: _named(_impl('generator', 'compat_generate'), original),
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
        build=lambda ctx, original: _named(_impl('generator', 'compat_del'), original),
    ),
)

WORKER = (
    Patch(
        id="worker._setup_hidden_states_capture",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._setup_hidden_states_capture",
        why="speculators replaces the base model's forward with a copy that drifts from vLLM's "
        "(embed_input_ids 0.11.1, llama_4_scaling 0.12.0, get_language_model shapes 0.15/0.16, "
        "SupportsEagle3 0.18.0, sequence-parallel MoE 0.25.0) and reads input_batch, which the "
        "V2 runner lacks (default from 0.22.0)",
        how="speccompat.capture: vLLM's forward runs; hooks on the decoder layers capture "
        "hidden_states + residual; batch order from the running runner, verified",
        vllm_change="0.11.1, 0.12.0, 0.15.0, 0.18.0, 0.22.0, 0.25.0",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(_impl('capture', 'setup_hidden_states_capture'), original),
    ),
    Patch(
        id="worker._reset_capture",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._reset_capture",
        why="pairs with the capture above",
        how="speccompat.capture.reset_capture",
        vllm_change="as above",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(_impl('capture', 'reset_capture'), original),
    ),
    Patch(
        id="worker._get_captured_states",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._get_captured_states",
        why="speculators slices by metadata it cannot verify; 0.3.0 returns one blob per layer",
        how="speccompat.capture.get_captured_states: verified per-request states, packed per layer",
        vllm_change="as above",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(_impl('capture', 'get_captured_states'), original),
    ),
    Patch(
        id="worker._speccompat_info",
        upstream="none: speccompat's own check that spawned workers are patched",
        target=f"{EXT_CLASS}._speccompat_info",
        why="with spawned workers, patches applied in the driver do not exist in the workers",
        how="an RPC the driver calls right after the workers start, to check they run speccompat "
        "with the same adapter",
        vllm_change="none",
        remove_when="never",
        build=lambda ctx, original: _impl('capture', 'worker_info'),
        adds=True,
    ),
)

GROUPS = {PYDANTIC_MODULE: PYDANTIC, GEN_MODULE: GENERATOR, WORKER_MODULE: WORKER}


#: Generators built while speccompat was applied: revert() makes their generate() say so.
_BUILT: weakref.WeakSet = weakref.WeakSet()


def _tracking(wrapper: Any) -> Any:
    def track(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapper(wrapped, instance, args, kwargs)
        if instance is not None:
            try:
                _BUILT.add(instance)
            except TypeError:  # not weak-referenceable: nothing to mark at revert
                pass
        return result

    return track


def mark_reverted() -> None:
    """After revert(): ``generate`` of every generator built under speccompat raises, saying why.

    Their engines were configured by speccompat (block size, KV layout, workers with speccompat's
    capture); speculators' own ``generate`` would fail on them with vLLM's errors or, worse, run.
    """
    for gen in list(_BUILT):
        gen.__dict__["generate"] = _reverted_generate
    _BUILT.clear()


def _reverted_generate(*args: Any, **kwargs: Any) -> Any:
    raise SpeccompatError(
        "VllmHiddenStatesGenerator.generate: speccompat was reverted (speccompat.revert()) after this "
        "generator was built under it; its engine and workers are speccompat's. Call "
        "speccompat.apply() and build a new generator"
    )


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


def _impl(module: str, name: str) -> Any:
    """The implementation ``speccompat.<module>.<name>``, imported when a patch is built."""
    import importlib

    return getattr(importlib.import_module(f"speccompat.{module}"), name)


def _function_wrapper(original: Any, wrapper: Any) -> Any:
    import wrapt  # imported here: it pulls in asyncio, too slow for `import speccompat`

    return wrapt.FunctionWrapper(original, wrapper)


def _named(fn: Any, original: Any) -> Any:
    """``fn`` (shared by every class it patches) wrapped so it can carry the original and a marker.

    As for every shim, ``__wrapped__`` is the original (the object replaced); ``__speccompat_impl__``
    is speccompat's implementation.
    """
    check = _live_check(getattr(fn, "__qualname__", repr(fn)))

    @functools.wraps(fn)
    def patched(*args: Any, **kwargs: Any) -> Any:
        check()
        return fn(*args, **kwargs)

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__speccompat_impl__ = fn  # type: ignore[attr-defined]
    return patched
