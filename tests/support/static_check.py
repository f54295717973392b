"""``scripts/static_check.py`` loaded as a module (it is a script, not a package module), and the
folder of vLLM sources the tests read it from (``SPECCOMPAT_STATIC_SOURCES``; None: its own cache)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("static_check", REPO / "scripts" / "static_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("static_check", module)
    spec.loader.exec_module(module)
    return module


sc = _load_script()
SOURCES = Path(os.environ["SPECCOMPAT_STATIC_SOURCES"]) if os.environ.get("SPECCOMPAT_STATIC_SOURCES") else None
