"""Process-wide state of speccompat (one per process; workers have their own)."""

from __future__ import annotations

import threading
from typing import Any

from .errors import SpeccompatError


class State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.armed = False
        self.import_fixes = False  # speculators' import fixes armed (also without a usable vLLM)
        self.problem: str | None = None  # why only the import fixes were armed
        self.strict = False
        self.vllm: Any = None
        self.speculators: Any = None
        self.adapter_cls: Any = None  # chosen by version at apply() time
        self.adapter: Any = None  # confirmed by the live probe when speculators imports vLLM
        self.expected: str | None = None  # in a process vLLM started: the adapter the driver chose
        self.selection = ""
        self.probe = "pending"  # pending | matched | failed
        self.mismatches: list[str] = []
        self.outcomes: dict[str, Any] = {}
        self.warnings: list[str] = []
        self.errors: list[str] = []
        self.row: Any = None
        self.redirected: list[Any] = []  # modules given scoped builtins
        self.workers: list[dict[str, Any]] = []  # what the last executor's workers reported

    @property
    def adapter_name(self) -> str | None:
        if self.adapter is not None:
            return self.adapter.name()
        return self.adapter_cls.name() if self.adapter_cls is not None else None

    def require_adapter(self) -> Any:
        if self.adapter is None:
            raise SpeccompatError(
                "speccompat has no confirmed adapter in this process; call speccompat.apply() "
                "before importing speculators.data_generation"
            )
        return self.adapter

    def reset(self) -> None:
        lock = self.lock
        self.__init__()  # type: ignore[misc]
        self.lock = lock


STATE = State()
