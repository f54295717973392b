"""``manifest.jsonl``: the data set's header (line 1) and one entry per finished file.

Header: ``{"speccompat_dataset": 1, "layout", "checksum", "provenance", "provenance_sha256"}``.
Entry: ``{"id", "file", "line", "num_tokens", "truncated_from"?, "input_sha256", "bytes",
"tensors": {name: {"dtype", "shape", "checksum"}}}``. Entries are appended (and fsynced) by the
writer before their files are renamed into place, so every visible sample file has its entry; the
last entry of a file wins; a resume compacts the file (atomically) when it changed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .fsutil import write_atomic

__all__ = ["MANIFEST_NAME", "SCHEMA_VERSION", "Manifest"]

logger = logging.getLogger("speccompat.dataset")

MANIFEST_NAME = "manifest.jsonl"
SCHEMA_VERSION = 1


class Manifest:
    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / MANIFEST_NAME
        self.header: dict[str, Any] | None = None
        self.entries: dict[str, dict[str, Any]] = {}  # file -> entry
        self.problems: list[str] = []  # lines that could not be read

    def load(self) -> Manifest:
        """Read the file (missing: empty). A torn last line (a crash mid-append) is dropped."""
        self.header, self.entries, self.problems = None, {}, []
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return self
        lines = raw.split(b"\n")
        for no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
            except ValueError:
                self.problems.append(f"{self.path.name} line {no} is malformed" +
                                     (" (torn last line of an interrupted append)" if no == len(lines) else ""))
                continue
            if no == 1 and "speccompat_dataset" in obj:
                self.header = obj
            elif "file" in obj and "id" in obj:
                self.entries[obj["file"]] = obj
            else:
                self.problems.append(f"{self.path.name} line {no} is neither the header nor an entry")
        return self

    @property
    def provenance(self) -> dict[str, Any] | None:
        return None if self.header is None else self.header.get("provenance")

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.entries.values()}

    def text(self) -> str:
        lines = [self.header] if self.header is not None else []
        return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in [*lines, *self.entries.values()])

    def rewrite(self) -> None:
        """Write header and entries atomically, if that changes the file."""
        text = self.text()
        try:
            if self.path.read_text(encoding="utf-8") == text:
                return
        except (FileNotFoundError, UnicodeDecodeError):
            pass
        write_atomic(self.path, text.encode("utf-8"))

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Append entries and fsync (one write, one fsync for a batch)."""
        if not entries:
            return
        data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        for e in entries:
            self.entries[e["file"]] = e
