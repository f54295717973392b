"""Patch records: what is replaced, why, and how to put the original back exactly.

A :class:`Patch` names one attribute of one of speculators' objects (a name its module imported
from vLLM, or a method of its classes) and documents itself the way vllm-ascend documents its
patches: *Why*, *How*, the *vLLM change* it answers and *when it can be removed*.

Patches are applied in groups (one group per speculators module). A group is all-or-nothing: every
replacement is built first, and only when all were built are they installed; if installing one
fails, the ones already installed are removed again. ``revert`` restores the exact original object
(the raw ``__dict__`` entry, so staticmethod/classmethod wrappers survive), or deletes the attribute
when the patch added it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from importlib import import_module
from typing import Any, NamedTuple

from .errors import PatchError

__all__ = [
    "MISSING",
    "AppliedPatch",
    "Patch",
    "PatchOutcome",
    "apply_group",
    "check_disabled",
    "disabled_reason",
    "generation",
    "patch_marker",
    "resolve_owner",
    "revert_all",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: Stands for "the attribute did not exist" (patches that add a method).
MISSING: Any = _Missing()

MARKER = "__speccompat_patch__"


def _always(ctx: Any) -> str | None:
    return None


class Patch(NamedTuple):
    """One replacement of one attribute of speculators.

    ``target`` is ``"module:Attr"`` or ``"module:Class.attr"``. ``build(ctx, original)`` returns the
    replacement (``original`` is :data:`MISSING` when the attribute does not exist). ``needed(ctx)``
    returns ``None`` when the patch must be applied, or the reason it is not needed here.
    ``optional`` patches whose target is absent are skipped instead of failing (e.g. a name only
    one speculators line imports).
    """

    id: str
    target: str
    why: str
    how: str
    vllm_change: str
    remove_when: str
    build: Callable[[Any, Any], Any]
    needed: Callable[[Any], str | None] = _always
    optional: bool = False
    adds: bool = False  # the attribute is new (a method speculators does not have)
    #: The vLLM/speculators PR or issue URL, or ``"none: <why>"`` (required by the docs check).
    upstream: str = ""

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> str:
        return self.target.split(":", 1)[1]

    def doc(self) -> dict[str, str]:
        return {
            "id": self.id,
            "target": self.target,
            "why": self.why,
            "how": self.how,
            "vllm_change": self.vllm_change,
            "remove_when": self.remove_when,
            "upstream": self.upstream,
        }


class AppliedPatch(NamedTuple):
    patch: Patch
    owner: Any
    name: str
    original: Any  # raw __dict__ entry, or MISSING when the owner did not define it itself
    replacement: Any


class PatchOutcome(NamedTuple):
    """What happened to one patch: ``applied``, ``skipped`` or ``failed`` (with the reason)."""

    id: str
    target: str
    state: str
    reason: str = ""
    doc: dict[str, str] = {}

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "target": self.target, "state": self.state, "reason": self.reason}


_lock = threading.RLock()
_applied: list[AppliedPatch] = []
_generation = 0  # bumped by revert_all(): shims built before it know they were reverted


def generation() -> int:
    """How many times patches were reverted in this process (shims compare it with their own)."""
    return _generation


def patch_marker(obj: Any) -> str | None:
    """The id of the patch that produced ``obj`` (``None`` for an original object)."""
    raw = getattr(obj, "__func__", obj)
    return getattr(raw, MARKER, None)


def resolve_owner(target: str) -> tuple[Any, str]:
    """``"pkg.mod:Cls.meth"`` -> (``Cls``, ``"meth"``). Imports nothing: the module must be loaded."""
    import sys

    module_name, path = target.split(":", 1)
    owner: Any = sys.modules.get(module_name)
    if owner is None:
        owner = import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _mark(obj: Any, patch_id: str) -> Any:
    raw = getattr(obj, "__func__", obj)
    try:
        setattr(raw, MARKER, patch_id)
    except (AttributeError, TypeError):
        pass
    return obj


#: Comma-separated patch ids (or prefixes ending in ".") to leave out, e.g. to reproduce a bug that a
#: patch fixes: ``SPECCOMPAT_DISABLE=generator.generate,worker.``
DISABLE_ENV = "SPECCOMPAT_DISABLE"


def _disable_items() -> list[str]:
    import os

    return list(filter(None, (x.strip() for x in os.environ.get(DISABLE_ENV, "").split(","))))


def _covers(item: str, patch_id: str) -> bool:
    return patch_id == item or (item.endswith(".") and patch_id.startswith(item))


def disabled_reason(patch_id: str) -> str | None:
    """Why ``patch_id`` is left out (``SPECCOMPAT_DISABLE`` names it or a prefix of it), or None."""
    for item in _disable_items():
        if _covers(item, patch_id):
            return f"disabled by {DISABLE_ENV}={item}"
    return None


def check_disabled(known: Iterable[str]) -> None:
    """Raise :class:`PatchError` naming each ``SPECCOMPAT_DISABLE`` item that leaves out no patch."""
    known = sorted(known)
    unknown = [item for item in _disable_items() if not any(_covers(item, pid) for pid in known)]
    if unknown:
        raise PatchError(
            f"{DISABLE_ENV} names {', '.join(repr(u) for u in unknown)}, which is no patch id or prefix "
            f"(ids: {', '.join(known)}; a prefix ends in '.', e.g. 'worker.')"
        )


def apply_group(patches: Iterable[Patch], ctx: Any) -> list[PatchOutcome]:
    """Apply ``patches`` all-or-nothing. Already-applied patches (same id) are left as they are.

    Raises :class:`PatchError` (after rolling back this group) when a non-optional patch cannot be
    built or installed; the message names the patch and its target.
    """
    outcomes: list[PatchOutcome] = []
    planned: list[AppliedPatch] = []
    with _lock:
        active = {a.patch.id for a in _applied}
        for p in patches:
            if p.id in active:
                outcomes.append(PatchOutcome(p.id, p.target, "applied", "already applied", p.doc()))
                continue
            reason = p.needed(ctx) or disabled_reason(p.id)
            if reason:
                outcomes.append(PatchOutcome(p.id, p.target, "skipped", reason, p.doc()))
                continue
            try:
                owner, name = resolve_owner(p.target)
            except (AttributeError, ImportError) as exc:
                if p.optional:
                    outcomes.append(PatchOutcome(p.id, p.target, "skipped", f"target absent: {exc}", p.doc()))
                    continue
                raise PatchError(f"patch {p.id}: cannot find {p.target}: {exc}") from exc
            raw = vars(owner).get(name, MISSING)
            if raw is MISSING and not p.adds and not hasattr(owner, name):
                if p.optional:
                    outcomes.append(
                        PatchOutcome(p.id, p.target, "skipped", f"{p.target} does not exist here", p.doc())
                    )
                    continue
                raise PatchError(f"patch {p.id}: {p.target} does not exist")
            if p.adds and raw is not MISSING:
                raise PatchError(f"patch {p.id}: {p.target} already exists; refusing to overwrite it")
            current = getattr(owner, name, MISSING)
            try:
                replacement = _mark(p.build(ctx, current), p.id)
            except Exception as exc:
                raise PatchError(f"patch {p.id} ({p.target}) could not be built: {exc}") from exc
            planned.append(AppliedPatch(p, owner, name, raw, replacement))
        installed: list[AppliedPatch] = []
        try:
            for a in planned:
                setattr(a.owner, a.name, a.replacement)
                installed.append(a)
        except Exception as exc:
            for a in reversed(installed):
                _restore(a)
            raise PatchError(f"patch {a.patch.id} ({a.patch.target}) could not be installed: {exc}") from exc
        _applied.extend(installed)
        outcomes.extend(PatchOutcome(a.patch.id, a.patch.target, "applied", "", a.patch.doc()) for a in installed)
    return outcomes


def _restore(a: AppliedPatch) -> None:
    if a.original is MISSING:
        if a.name in vars(a.owner):
            delattr(a.owner, a.name)
    else:
        setattr(a.owner, a.name, a.original)


def revert_all() -> list[str]:
    """Restore every original, newest first. Returns the ids of the reverted patches."""
    global _generation
    with _lock:
        _generation += 1
        reverted = []
        while _applied:
            a = _applied.pop()
            _restore(a)
            reverted.append(a.patch.id)
        return reverted


def applied_ids() -> list[str]:
    with _lock:
        return [a.patch.id for a in _applied]
