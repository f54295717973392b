"""Shared by the benchmark scripts: how a result document is written."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def code(vllm: str | None) -> dict:
    """What a result records of the code it ran (:func:`speccompat.evidence.capture_path.code_record`): the capture
    path's hash, with ``vllm`` that release's own capture path (what ``benchmarks/report.py`` compares
    with today's to say whether a figure is current), and the commit where this is a git checkout."""
    import sys

    sys.path.insert(0, str(REPO))
    from packaging.version import InvalidVersion, Version

    from speccompat.evidence import capture_path

    try:
        return capture_path.code_record(REPO, Version(vllm).base_version if vllm else None)
    except (InvalidVersion, RuntimeError, KeyError, ValueError):  # a release no adapter knows: the core alone
        return capture_path.code_record(REPO)


def write(doc: dict, out: str | None, *, echo: bool = True) -> str:
    """``doc`` as indented JSON: printed (``echo``) and written to ``out`` when given, with the code
    that ran (``code``) unless the document says it already."""
    if out and "code" not in doc:
        doc = {**doc, "code": code(doc.get("vllm") if isinstance(doc.get("vllm"), str) else None)}
    text = json.dumps(doc, indent=2)
    if echo:
        print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text
