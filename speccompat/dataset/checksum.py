"""Per-tensor checksums: computed on the writer threads while a file is written, checked on resume
and by ``speccompat verify``.

``xxh3_64`` (the ``xxhash`` package, in the ``speccompat[dataset]`` extra) is the default: it ran at
3.1 GB/s per thread on the 2-core test machine (zlib.crc32 0.80, sha256 0.41, blake2b 0.16), so it
keeps up with the disk on one thread, and releases the GIL. Without ``xxhash`` installed, stdlib
``zlib.crc32`` is used. The manifest names the algorithm, so a data set is checked with its own.
Figures and command: docs/dataset.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["ALGORITHMS", "default_algorithm", "digest_fn"]


def _xxh3() -> Callable[[memoryview], str]:
    import xxhash

    return lambda buf: f"{xxhash.xxh3_64_intdigest(buf):016x}"


def _crc32() -> Callable[[memoryview], str]:
    return lambda buf: f"{zlib.crc32(buf):08x}"


ALGORITHMS: dict[str, Callable[[], Callable[[memoryview], str]]] = {"xxh3_64": _xxh3, "crc32": _crc32}


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


def digest_fn(name: str) -> Callable[[memoryview], str]:
    """The hex digest function of algorithm ``name``; raises with what to install."""
    try:
        make = ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {name!r} (known: {', '.join(ALGORITHMS)})") from None
    try:
        return make()
    except ImportError as exc:
        raise ValueError(f"the data set's checksums are {name}, which needs the {exc.name} package "
                         "(pip install 'speccompat[dataset]')") from None
