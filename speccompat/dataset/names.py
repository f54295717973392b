"""Sample ids -> file names, injectively, on any file system.

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

__all__ = ["MAX_STEM", "id_for_name", "name_for_id"]

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
