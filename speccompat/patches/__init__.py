"""The patches: names speculators imported from vLLM, and speculators' own methods.

speculators binds vLLM names at import time (``from vllm.v1.request import Request``), so a fix
must replace the binding in speculators' module, never vLLM's attribute. Each patch below routes
the name through an operation of the selected adapter (:mod:`speccompat.adapter`), which knows
what that vLLM release expects. Methods whose logic is wrong on every release are replaced by
:mod:`speccompat.generator` (driver) and :mod:`speccompat.capture` (workers).

Three groups, one per speculators module and one file each (named after the module it patches),
each applied all-or-nothing when that module is loaded: ``PYDANTIC``
(:mod:`.pydantic_utils`), ``GENERATOR`` (:mod:`.vllm_hidden_states_generator`) and ``WORKER``
(:mod:`.custom_worker`).
"""

from __future__ import annotations

from ._common import (
    APPLY_ENV,
    EXT_CLASS,
    GEN_CLASS,
    GEN_MODULE,
    NEVER_REMOVE,
    PYDANTIC_MODULE,
    WORKER_MODULE,
    check_workers,
    mark_reverted,
)
from .custom_worker import WORKER
from .pydantic_utils import PYDANTIC
from .vllm_hidden_states_generator import GENERATOR

__all__ = [
    "APPLY_ENV",
    "EXT_CLASS",
    "GENERATOR",
    "GEN_CLASS",
    "GEN_MODULE",
    "GROUPS",
    "NEVER_REMOVE",
    "PYDANTIC",
    "PYDANTIC_MODULE",
    "WORKER",
    "WORKER_MODULE",
    "check_workers",
    "mark_reverted",
]

GROUPS = {PYDANTIC_MODULE: PYDANTIC, GEN_MODULE: GENERATOR, WORKER_MODULE: WORKER}
