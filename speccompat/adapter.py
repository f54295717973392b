"""The adapter contract: what differs between vLLM releases, as overridable operations.

Each module under ``speccompat.adapters`` (the ``adapters/`` folder of the repository) serves a
contiguous range of vLLM releases. It subclasses the adapter of the previous range and overrides
only the operations that vLLM changed, recording each change as a :class:`Change`. Supporting a new
vLLM release therefore means one new module (plus one ``compat_matrix.yaml`` row), and reading the
modules in order reads the history of the internals speculators touches.

The operations are called from the patches in :mod:`speccompat.patches` (names speculators imported
from vLLM, replaced in speculators' own module namespace) and from the fixed ``generate``
(:mod:`speccompat.generator`). They never change vLLM's own modules.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from packaging.version import Version

from .probe import Symbol

__all__ = ["Adapter", "Change"]


class Change(NamedTuple):
    """One vLLM change answered by an adapter: patch notes in the vllm-ascend style.

    ``vllm``: the release that introduced it. ``what``: the change in vLLM, with evidence
    (file:line of that release). ``breaks``: what it does to speculators 0.3/0.4 without
    speccompat. ``how``: what the adapter does about it. ``remove_when``: when the code can go.
    """

    vllm: str
    what: str
    breaks: str
    how: str
    remove_when: str

    def as_dict(self) -> dict[str, str]:
        return dict(self._asdict())


class Adapter:
    """Base of every adapter. Subclasses set :attr:`since`, :attr:`changes`, :attr:`requires`."""

    #: First vLLM release served (inclusive). The next adapter's ``since`` is the exclusive end.
    since: ClassVar[str] = "0"
    #: Changes answered by this class itself (not its parents).
    changes: ClassVar[tuple[Change, ...]] = ()
    #: The fingerprint: every vLLM symbol the operations rely on, keyed by path. Subclasses merge
    #: their parent's with :func:`speccompat.probe.fingerprint`.
    requires: ClassVar[dict[str, Symbol]] = {}

    @classmethod
    def name(cls) -> str:
        return cls.__module__.rsplit(".", 1)[-1]

    @classmethod
    def since_version(cls) -> Version:
        return Version(cls.since)

    @classmethod
    def history(cls) -> list[Change]:
        """Every change answered by this adapter and its parents, oldest first."""
        out: list[Change] = []
        for klass in reversed(cls.__mro__):
            out.extend(vars(klass).get("changes", ()))
        return out

    def __repr__(self) -> str:
        return f"<adapter {self.name()} (vLLM >= {self.since})>"

    # ------------------------------------------------------------------------------ import time
    def moved_names(self) -> dict[tuple[str, str], str]:
        """``(module, name)`` that speculators imports -> module that holds the name in this vLLM."""
        return {}

    # ----------------------------------------------------------------------------- config time
    def vllm_config(self, cls: Any, **kw: Any) -> Any:
        return cls(**kw)

    def cache_config(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def scheduler_config(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def scheduler(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def request(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    # --------------------------------------------------------------------------- executor life
    def after_executor_start(self, executor: Any) -> None:
        """Engine-core steps due right after the executor's workers are up."""

    def after_kv_cache_init(self, executor: Any) -> None:
        """Engine-core steps due right after ``initialize_from_config``."""

    def execute(self, executor: Any, scheduler_output: Any) -> Any:
        """Run one scheduled step; return the ``ModelRunnerOutput``."""
        raise NotImplementedError

    def unique_reply(self, reply: Any) -> Any:
        """Normalise the reply of ``collective_rpc(..., unique_reply_rank=0)`` to the bare value."""
        raise NotImplementedError
