"""The engine environment the engine tests run in: ``speccompat-env.json`` beside the interpreter
(``SPECCOMPAT_ENV_FILE`` names another; None when there is none), whether engines start without
``speccompat.apply()`` (``SPECCOMPAT_TEST_NO_APPLY=1``), and the pool engine a test declares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV_FILE = Path(os.environ.get("SPECCOMPAT_ENV_FILE") or Path(sys.prefix) / "speccompat-env.json")
ENGINE_ENV = json.loads(ENV_FILE.read_text()) if ENV_FILE.exists() else None
NO_APPLY = os.environ.get("SPECCOMPAT_TEST_NO_APPLY") == "1"


def pool_key(item) -> tuple | None:
    """(speculators, kind, variant) of the pool engine a test declares with ``pool``, else None."""
    mark = item.get_closest_marker("pool")
    if mark is None:
        return None
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return (mark.kwargs.get("speculators", params.get("speculators", "0.4.0.1")),
            mark.kwargs.get("kind", params.get("kind", "llama")), mark.kwargs.get("variant", ""))
