"""docs/patches.md is generated from the patches and adapters and kept current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_patch_docs_are_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
