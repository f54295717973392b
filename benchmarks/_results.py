"""Shared by the benchmark scripts: how a result document is written."""

from __future__ import annotations

import json
from pathlib import Path


def write(doc: dict, out: str | None, *, echo: bool = True) -> str:
    """``doc`` as indented JSON: printed (``echo``) and written to ``out`` when given."""
    text = json.dumps(doc, indent=2)
    if echo:
        print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text
