"""``manifest.jsonl``: the data set's header (line 1) and one entry per finished file.

Header: ``{"speccompat_dataset": 1, "layout", "checksum", "provenance", "provenance_sha256"}``.
Entry: ``{"id", "file", "line", "num_tokens", "truncated_from"?, "input_sha256", "bytes",
"tensors": {name: {"dtype", "shape", "checksum"}}}``. Entries are appended (and fsynced) by the
writer before their files are renamed into place, so every visible sample file has its entry; the
last entry of a file wins; a resume compacts the file (atomically) when it changed.

The file is parsed once, here: a line that is not JSON, a header or an entry with a field of the
wrong kind (a ``file`` that is not a plain sample-file name of the layout, a size that is not a
number ...) is a problem naming the file and line; such an entry is dropped (its sample is
redone), a malformed header leaves ``header`` None and says why in ``header_problem``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from .checksum import ALGORITHMS
from .errors import Rejected
from .fsutil import FileOps, write_all, write_atomic
from .names import MANIFEST_NAME, bad_name
from .spec import DTYPES, LAYOUTS, SUFFIXES, StoredSpec

__all__ = ["MANIFEST_NAME", "SCHEMA_VERSION", "Manifest", "entry_problem", "header_problem"]

logger = logging.getLogger("speccompat.dataset")

SCHEMA_VERSION = 1


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def header_problem(obj: Any) -> str | None:
    """Why ``obj`` is not a usable data-set header (None when it is one)."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if obj.get("speccompat_dataset") != SCHEMA_VERSION:
        return f"speccompat_dataset is {obj.get('speccompat_dataset')!r}, this version reads {SCHEMA_VERSION}"
    if not isinstance(obj.get("layout"), str) or obj["layout"] not in LAYOUTS:
        return f"layout {obj.get('layout')!r} is not one of {', '.join(LAYOUTS)}"
    if not isinstance(obj.get("checksum"), str) or obj["checksum"] not in ALGORITHMS:
        return f"checksum {obj.get('checksum')!r} is not one of {', '.join(ALGORITHMS)}"
    prov = obj.get("provenance")
    if not isinstance(prov, dict):
        return "provenance is not an object"
    hs, model = prov.get("hidden_states"), prov.get("model")
    if not isinstance(hs, dict) or not isinstance(hs.get("layer_ids"), list) or not hs["layer_ids"] \
            or not all(_int(i) for i in hs["layer_ids"]):
        return "provenance.hidden_states.layer_ids is not a list of layer numbers"
    if not isinstance(hs.get("dtype"), str) or hs["dtype"] not in DTYPES:
        return f"provenance.hidden_states.dtype {hs.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    if not isinstance(model, dict) or not _int(model.get("hidden_size")) or not _int(model.get("vocab_size")):
        return "provenance.model.hidden_size/vocab_size are not numbers"
    if not _int(prov.get("max_seq_len")):
        return "provenance.max_seq_len is not a number"
    if not isinstance(obj.get("provenance_sha256"), str):
        return "provenance_sha256 is not a string"
    return None


def entry_problem(obj: dict[str, Any], suffix: str | None) -> str | None:
    """Why ``obj`` is not a usable entry (None when it is one); ``suffix``: the layout's file suffix."""
    if not isinstance(obj.get("id"), str):
        return "id is not a string"
    f = obj.get("file")
    why = bad_name(f)
    if why is not None:
        return f"file {f!r} {why}: not a file name inside the data set"
    if f.startswith(".") or (suffix is not None and not f.endswith(suffix)):
        return f"file {f!r} is not a sample file name of this layout"
    for key in ("line", "num_tokens", "bytes"):
        if not _int(obj.get(key)):
            return f"{key} is {obj.get(key)!r}, not a number"
    if not isinstance(obj.get("input_sha256"), str):
        return "input_sha256 is not a string"
    tensors = obj.get("tensors")
    if not isinstance(tensors, dict):
        return "tensors is not an object"
    for name, t in tensors.items():
        if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or not isinstance(t.get("checksum"), str) \
                or not isinstance(t.get("shape"), list) or not all(_int(d) for d in t["shape"]):
            return f"tensors.{name} is not {{dtype, shape, checksum}}"
    return None


class Manifest:
    def __init__(self, out_dir: Path, name: str = MANIFEST_NAME, ops: FileOps | None = None) -> None:
        self.path = Path(out_dir) / name
        self.ops = ops or FileOps()
        self.header: dict[str, Any] | None = None
        self.header_problem: str | None = None  # line 1 is a header that cannot be used, and why
        self.entries: dict[str, dict[str, Any]] = {}  # file -> entry
        self.problems: list[str] = []  # lines that could not be read
        self._read_to = 0  # bytes of the file read (complete lines), for :meth:`follow`
        self._lines = 0
        self._file: tuple[int, int] | None = None  # (device, inode) read
        self._suffix: str | None = None

    def _read(self) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        except OSError as exc:
            raise Rejected(f"cannot read {self.path}: {exc.strerror} (a manifest must be a plain file)") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Rejected(f"cannot read {self.path}: not a plain file (a manifest must be a plain file)")
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def load(self) -> Manifest:
        """Read the file (missing: empty). A torn last line (a crash mid-append) is dropped."""
        self._reset()
        self._take(self._read(), final=True)
        return self

    def follow(self) -> Manifest:
        """Read what was appended since the last :meth:`follow` (the whole file the first time), as a
        reader beside the process that appends to it: read-only, no lock taken; only complete lines
        are read (a line being appended is read once it is whole); a file replaced meanwhile (a
        resume compacts it atomically) is read anew."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # not there (yet), or not a plain file: nothing to read
            self._reset()
            return self
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a folder of that name: nothing to read
            os.close(fd)
            self._reset()
            return self
        with os.fdopen(fd, "rb") as f:
            if self._file != (st.st_dev, st.st_ino) or st.st_size < self._read_to:
                self._reset()
                self._file = (st.st_dev, st.st_ino)
            f.seek(self._read_to)
            self._take(f.read(), final=False)
        return self

    def _reset(self) -> None:
        self.header, self.header_problem, self.entries, self.problems = None, None, {}, []
        self._read_to, self._lines, self._file, self._suffix = 0, 0, None, None

    def _take(self, data: bytes, *, final: bool) -> None:
        """Parse the lines of ``data`` (the bytes after those read so far). ``final``: ``data`` is
        the rest of the file (an unterminated last line is torn); else it is kept for later."""
        lines = data.split(b"\n")
        if not final:
            lines.pop()  # the bytes after the last newline: a line not yet whole (or nothing)
            self._read_to += sum(len(x) + 1 for x in lines)
        for k, line in enumerate(lines):
            no = self._lines + k + 1
            if line.strip():
                self._parse(line, no, torn=final and k == len(lines) - 1)
        self._lines += len(lines)

    def _parse(self, line: bytes, no: int, *, torn: bool) -> None:
        where = f"{self.path.name} line {no}"
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError:
            self.problems.append(f"{where} is malformed" + (" (torn last line of an interrupted append)" if torn else ""))
            return
        if no == 1 and "speccompat_dataset" in obj:
            why = header_problem(obj)
            if why is None:
                self.header = obj
                self._suffix = SUFFIXES[obj["layout"]]
            else:
                self.header_problem = f"{where} (the header): {why}"
                self.problems.append(self.header_problem)
        elif "file" in obj and "id" in obj:
            why = entry_problem(obj, self._suffix)
            if why is None:
                self.entries[obj["file"]] = obj
            else:
                self.problems.append(f"{where}: {why}")
        else:
            self.problems.append(f"{where} is neither the header nor an entry")

    @property
    def provenance(self) -> dict[str, Any] | None:
        return None if self.header is None else self.header.get("provenance")

    @property
    def spec(self) -> StoredSpec:
        """What the set's sample files hold, as its header's provenance records (a manifest
        without a header has none: ``ValueError``)."""
        if self.header is None:
            raise ValueError(f"{self.path}: no header, so no record of what the set stores")
        return StoredSpec.of_provenance(self.header["provenance"])

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.entries.values()}

    def text(self) -> str:
        lines = [self.header] if self.header is not None else []
        return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in [*lines, *self.entries.values()])

    def rewrite(self) -> None:
        """Write header and entries atomically, if that changes the file."""
        text = self.text()
        try:
            if self._read().decode("utf-8") == text:
                return
        except Exception:  # noqa: BLE001 - unreadable (not UTF-8, a symbolic link ...): replaced
            pass
        write_atomic(self.path, text.encode("utf-8"))

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Append entries and fsync (one write, one fsync for a batch), through :attr:`ops`."""
        if not entries:
            return
        data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode("utf-8")
        ops = self.ops
        fd = ops.open(str(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            write_all(ops, fd, memoryview(data))
            ops.fsync(fd)
        finally:
            ops.close(fd)
        for e in entries:
            self.entries[e["file"]] = e
