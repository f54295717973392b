"""Crash a driver at a chosen sample, mid-run whatever the machine's load (``sitecustomize.py``
here says how): the environment that arms it, and what its log says it did."""

from __future__ import annotations

import os
import re
from pathlib import Path

HOOK = Path(__file__).resolve().parent


def crash_env(env: dict[str, str], *, after: int, argv: str, group: bool = False) -> dict[str, str]:
    """``env`` with the hook armed: the process whose command line holds ``argv`` (words in a row),
    handed sample ``after`` + 1, waits until ``after`` samples are committed, then SIGKILLs itself,
    or its process group with ``group``."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": os.pathsep.join([str(HOOK), *([path] if path else [])]),
            "SPECCOMPAT_TEST_CRASH_AFTER": str(after), "SPECCOMPAT_TEST_CRASH_ARGV": argv,
            "SPECCOMPAT_TEST_CRASH_GROUP": "1" if group else "0"}


def crashed_after(log: str) -> int:
    """How many committed samples the armed process had when it killed itself (from its log)."""
    m = re.search(r"crash hook: SIGKILL after (\d+) committed sample\(s\)", log)
    assert m is not None, f"the crash hook did not fire:\n{log[-3000:]}"
    return int(m.group(1))
