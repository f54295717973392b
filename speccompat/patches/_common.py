"""What the patches of every speculators module share: the module names, the shims that route a
name through an adapter operation, the worker check and the bookkeeping of ``revert()``."""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from .. import patching
from .._state import STATE
from ..errors import SpeccompatError, WorkerPatchError

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
