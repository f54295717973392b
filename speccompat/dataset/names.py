"""Every name inside an output directory, and sample ids -> file names, injectively, on any file system.

The fixed names (the manifest, its header and shard parts, the locks, the temporary suffix, the
folders speccompat creates and deletes, each layout's side files) are defined here and nowhere else;
:class:`~speccompat.dataset.directory.DatasetDir` composes them into paths.

An id's UTF-8 bytes are percent-encoded: ``a-z 0-9 _ -`` stay as they are, every other byte (upper
case letters, ``.``, ``/``, ``%``, NUL, non-ASCII) becomes ``%xx`` with lower-case hex. So

- the name is reversible (:func:`id_for_name`) and two ids never share a name;
- names hold no upper-case letter, so a case-insensitive file system (macOS, Windows, some
  NFS/SMB exports) cannot fold two names together (``A`` is ``%41``, ``a`` is ``a``);
- no name is ``.``/``..``, starts with a dot, or contains a separator.

Names longer than :data:`MAX_STEM` (a file name must fit in 255 bytes) keep a readable prefix and
end in ``~`` + the first 128 bits of the id's SHA-256; ``~`` never occurs in an encoded name, so a
long name cannot equal a short one, and two long ones are equal only for a SHA-256 collision.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["ARROW_BUILD_DIR", "ARROW_HS_DIR", "ARROW_INFO_NAME", "ARROW_STATE", "ARROW_TOKEN_FREQ",
           "EXPORT_STAGING", "HEADER_LOCK_NAME", "HEADER_NAME", "LOCK_NAME", "MANIFEST_NAME", "MAX_STEM", "OWN_DIRS",
           "PART_LOCK_RE", "PART_RE", "PROVENANCE_NAME", "SPECULATORS_SIDE_FILES", "TMP_SUFFIX", "TRASH_NAME", "bad_name", "id_for_name",
           "name_for_id", "part_lock_name", "part_name", "tmp_name", "token_freq_beside"]

#: The manifest of a whole run (and of a merged set).
MANIFEST_NAME = "manifest.jsonl"
#: What ``speccompat serve`` records beside the hidden states it stores (its ``--hidden-states-dir``).
PROVENANCE_NAME = "provenance.json"
#: The header every shard of a data set shares (created once by the first shard).
HEADER_NAME = "manifest.header.json"
#: The extraction's lock (one writer per directory).
LOCK_NAME = ".speccompat-dataset.lock"
#: Held by a shard while it decides on the shared header (short: one shard at a time).
HEADER_LOCK_NAME = ".speccompat-header.lock"
#: What a file being written is called until it is renamed into place: ``<name>.<pid><TMP_SUFFIX>``.
TMP_SUFFIX = ".partial"
#: Where ``--overwrite`` moves the old set before anything new is written (removed once moved).
TRASH_NAME = ".speccompat-overwrite"
#: Where ``speccompat export`` builds the new data set inside its output directory.
EXPORT_STAGING = ".speccompat-export-staging"
PART_RE = re.compile(r"^manifest\.shard-(\d+)-of-(\d+)\.jsonl$")
PART_LOCK_RE = re.compile(r"^\.speccompat-shard-(\d+)-of-(\d+)\.lock$")

#: The ``speculators-arrow`` layout's trainer view (speculators >= 0.5): the hard-linked sample
#: files, the rows' record, the token counts, the ``datasets`` state, the folder it is built in.
ARROW_HS_DIR = "hidden_states"
ARROW_INFO_NAME = "speccompat_arrow.json"
ARROW_TOKEN_FREQ = "token_freq.pt"
ARROW_STATE = "state.json"
ARROW_BUILD_DIR = ".speccompat-arrow-build"
#: The ``speculators`` (0.3/0.4) layout's side files.
SPECULATORS_SIDE_FILES = ("data_config.json", "sample_lengths.json")

#: Folders speccompat creates and deletes inside a data set (the Arrow layout's build and view
#: folders, --overwrite's trash, export's staging): never followed when they are links.
OWN_DIRS = (ARROW_BUILD_DIR, ARROW_HS_DIR, TRASH_NAME, EXPORT_STAGING)


def token_freq_beside(root: Path) -> Path:
    """The token-frequency file of the 0.3/0.4 layout: ``<DIR>.token_freq.pt`` beside the directory
    (never inside: speculators' loader takes every file ending in ``pt`` under it for a sample). The
    directory is resolved first, so ``--output-dir .`` works."""
    root = Path(root).resolve()
    return root.with_name(root.name + ".token_freq.pt")


def tmp_name(name: str, pid: int | None = None) -> str:
    """What ``name`` is called while this process (or ``pid``) writes it: ``<name>.<pid><TMP_SUFFIX>``."""
    return f"{name}.{os.getpid() if pid is None else pid}{TMP_SUFFIX}"


def part_name(index: int, num_shards: int) -> str:
    """The manifest part of shard ``index`` of ``num_shards``."""
    return f"manifest.shard-{index:05d}-of-{num_shards:05d}.jsonl"


def part_lock_name(index: int, num_shards: int) -> str:
    """The lock of shard ``index`` of ``num_shards``."""
    return f".speccompat-shard-{index:05d}-of-{num_shards:05d}.lock"


def bad_name(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside a directory (None when it is one)."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if "/" in name or "\\" in name or "\0" in name:
        return "contains a path separator or NUL"
    if name in (".", ".."):
        return "is . or .."
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "is longer than 255 bytes"
    return None


_KEEP = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")
#: Longest encoded stem kept whole (room for a suffix and a temporary-file suffix within 255 bytes).
MAX_STEM = 160


def name_for_id(sample_id: str, suffix: str = "") -> str:
    """The file name of ``sample_id`` (plus ``suffix``, e.g. ``.safetensors``)."""
    raw = sample_id.encode("utf-8", "surrogatepass")
    stem = "".join(chr(b) if b in _KEEP else f"%{b:02x}" for b in raw)
    if len(stem) > MAX_STEM:
        cut = stem[:96]
        if "%" in cut[-2:]:  # do not cut an escape in half
            cut = cut[: cut.rindex("%")]
        stem = f"{cut}~{hashlib.sha256(raw).hexdigest()[:32]}"
    return stem + suffix


def id_for_name(name: str, suffix: str = "") -> str | None:
    """The id whose name is ``name``; None for a hashed (long-id) name, whose id is in the manifest."""
    stem = name[: len(name) - len(suffix)] if suffix and name.endswith(suffix) else name
    if "~" in stem:
        return None
    out = bytearray()
    i = 0
    while i < len(stem):
        if stem[i] == "%":
            out.append(int(stem[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(stem[i]))
            i += 1
    return out.decode("utf-8", "surrogatepass")
