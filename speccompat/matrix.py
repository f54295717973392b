"""``compat_matrix.yaml``: which (speculators, vLLM) cells are supported, and how that was shown.

Schema (``schema: 1``)::

    releases: [vLLM releases the matrix speaks about]
    speculators: [speculators versions the matrix speaks about]
    rows:
      - speculators: "0.4.0.1"        # exact speculators version
        vllm: "0.32.0"                # exact vLLM release
        adapter: vllm_0_29_0          # module in speccompat.adapters
        status: supported             # see STATUSES
        evidence:                     # how it was shown, and when
          - {kind: static, date: 2026-11-29, ref: evidence/static/releases.json}
          - {kind: cpu-e2e, date: 2026-11-29, ref: evidence/cpu/vllm-0.32.0.json}

Status values claim only what the evidence shows: ``supported`` needs an end-to-end parity run
(``cpu-e2e`` or ``gpu-e2e``) of that exact cell on the current capture path of its release
(:func:`speccompat.evidence.capture_path.release_capture_path`: the core files of ``HOT_PATH``, the
adapter modules the release runs and its fingerprint); ``stale`` means such runs exist but all of them
ran older capture code (:func:`speccompat.evidence.freshness.is_stale`; their evidence items say
``stale: "true"``); ``static`` means the adapter's fingerprint was checked against that release's
sources and nothing was run; ``unsupported`` says why in ``note``.

This module is the core's part: the lookup ``apply()`` and ``doctor`` use (:func:`lookup`,
:func:`known_releases`, :func:`known_speculators`, :func:`load`), standard library and ``packaging``
only. The file is generated from the files under ``evidence/`` by ``python -m speccompat.matrix
--write`` (the dev tooling's :mod:`speccompat.evidence`); a test regenerates it and fails when the two
differ.
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache
from typing import Any, NamedTuple

from packaging.version import Version

__all__ = ["EVIDENCE_KINDS", "STATUSES", "Matrix", "Row", "load"]

STATUSES = ("supported", "stale", "static", "unsupported")
EVIDENCE_KINDS = ("static", "cpu-e2e", "gpu-e2e")
E2E_KINDS = ("cpu-e2e", "gpu-e2e")
#: Outcomes of an architecture on a release: parity shown (on the current capture path or an older one),
#: parity not shown, the engine refused it; or, for a decoder-layer class an adapter declares, accepted
#: by its output convention with no run on record (:func:`accepted_by_convention`).
ARCH_OUTCOMES = ("proven", "stale", "failed", "refused", "accepted")
#: evidence/<platform>/architectures-vllm-<V>.json: the architecture runs (kind of such a file).
ARCH_KIND = "architectures"


class MatrixError(ValueError):
    """compat_matrix.yaml does not follow the schema; the message names the row and the field."""


class Row(NamedTuple):
    speculators: str
    vllm: str
    adapter: str
    status: str
    evidence: tuple[dict[str, str], ...] = ()
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "speculators": self.speculators,
            "vllm": self.vllm,
            "adapter": self.adapter,
            "status": self.status,
            "evidence": [dict(e) for e in self.evidence],
        }
        if self.note:
            d["note"] = self.note
        return d

    def kinds(self) -> set[str]:
        return {e["kind"] for e in self.evidence}


class Matrix:
    def __init__(self, releases: list[str], speculators: list[str], rows: list[Row],
                 architectures: list[dict[str, Any]] | None = None) -> None:
        self.releases = releases
        self.speculators = speculators
        self.rows = rows
        #: One entry per (architecture, vLLM release, platform): see :func:`architectures`.
        self.architectures = architectures or []


def _fail(where: str, msg: str) -> MatrixError:
    return MatrixError(f"compat_matrix.yaml {where}: {msg}")


def parse(data: Any) -> Matrix:
    """Validate the loaded YAML and build a :class:`Matrix`."""
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise _fail("top level", "expected a mapping with schema: 1")
    for key in ("releases", "speculators", "rows"):
        if not isinstance(data.get(key), list):
            raise _fail("top level", f"'{key}' must be a list")
    from .registry import all_adapters

    adapters = {a.name() for a in all_adapters()}
    rows = []
    seen = set()
    for i, raw in enumerate(data["rows"]):
        where = f"row {i}"
        if not isinstance(raw, dict):
            raise _fail(where, "must be a mapping")
        for key in ("speculators", "vllm", "adapter", "status", "evidence"):
            if key not in raw:
                raise _fail(where, f"missing '{key}'")
        spec, vllm = str(raw["speculators"]), str(raw["vllm"])
        where = f"row {i} (speculators {spec}, vLLM {vllm})"
        if spec not in data["speculators"] or vllm not in data["releases"]:
            raise _fail(where, "names a version not listed under speculators/releases")
        if (spec, vllm) in seen:
            raise _fail(where, "duplicate cell")
        seen.add((spec, vllm))
        if raw["status"] not in STATUSES:
            raise _fail(where, f"status {raw['status']!r} not in {STATUSES}")
        if raw["adapter"] not in adapters:
            raise _fail(where, f"adapter {raw['adapter']!r} does not exist (have {sorted(adapters)})")
        evidence = []
        for e in raw["evidence"]:
            if not isinstance(e, dict) or e.get("kind") not in EVIDENCE_KINDS:
                raise _fail(where, f"evidence {e!r}: kind must be one of {EVIDENCE_KINDS}")
            import datetime

            try:
                datetime.date.fromisoformat(str(e.get("date")))
            except ValueError:
                raise _fail(where, f"evidence {e!r}: date must be YYYY-MM-DD") from None
            evidence.append({k: str(v) for k, v in e.items()})
        row = Row(spec, vllm, raw["adapter"], raw["status"], tuple(evidence), str(raw.get("note", "")))
        kinds = row.kinds()
        fresh = {e["kind"] for e in row.evidence if e.get("stale") != "true"}
        if row.status == "supported" and not fresh & set(E2E_KINDS):
            raise _fail(where, "status supported without current cpu-e2e/gpu-e2e evidence")
        if row.status == "stale" and (fresh & set(E2E_KINDS) or not kinds & set(E2E_KINDS)):
            raise _fail(where, "status stale needs cpu-e2e/gpu-e2e evidence, all of it stale")
        if row.status == "static" and "static" not in kinds:
            raise _fail(where, "status static without static evidence")
        rows.append(row)
    archs = data.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, dict) and a.get("outcome") in ARCH_OUTCOMES for a in archs):
        raise _fail("architectures", f"must be a list of mappings with an outcome in {ARCH_OUTCOMES}")
    return Matrix([str(r) for r in data["releases"]], [str(s) for s in data["speculators"]], rows, archs)


def read(text: str) -> dict[str, Any]:
    """The generated file as data, without a YAML parser: comments, ``key: <JSON>`` lines and,
    under ``rows:``, ``  - <JSON object>`` lines (the layout :meth:`Matrix.to_yaml` writes; any
    YAML parser reads the same). Anything else is a :class:`MatrixError` naming the line."""
    data: dict[str, Any] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if line.startswith("- ") and isinstance(data.get("rows"), list):
                data["rows"].append(json.loads(line[2:]))
                continue
            key, sep, value = line.partition(":")
            if not sep or raw[:1].isspace():
                raise ValueError("not a 'key: value' line")
            data[key.strip()] = [] if key.strip() == "rows" and not value.strip() else json.loads(value)
        except ValueError as exc:
            raise MatrixError(f"compat_matrix.yaml line {n}: {exc}: {raw[:80]!r}") from None
    return data


def packaged_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat_matrix.yaml")


def _public(version: Any) -> str | None:
    if version is None:
        return None
    try:
        return Version(str(version)).public
    except ValueError:
        return None


def lookup(speculators: Any, vllm: Any, path: str | None = None) -> Row | None:
    """The row of one cell, read without a YAML parser (fast enough for ``apply()``).

    Relies on the generated layout (one JSON object per row); :func:`load` validates the whole file.
    """
    spec, rel = _public(speculators), _public(vllm)
    if spec is None or rel is None:
        return None
    key = f'{{"speculators": "{spec}", "vllm": "{rel}",'
    path = path or packaged_path()
    last = ""
    for line in _lines(path):
        line = line.strip()
        if line.startswith("- " + key):
            try:
                d = json.loads(line[2:])
                return Row(d["speculators"], d["vllm"], d["adapter"], d["status"],
                           tuple(d.get("evidence", ())), d.get("note", ""))
            except (ValueError, KeyError, TypeError):
                raise MatrixError(f"{path} is damaged (the row of speculators {spec} with vLLM {rel} does not "
                                  f"read): reinstall speccompat") from None
        last = line or last
    if not last.startswith(LAST_KEY + ":"):  # a file cut short may have lost this row
        raise MatrixError(f"{path} is truncated (its last line is not the '{LAST_KEY}:' one): reinstall speccompat")
    return None


#: The key of the line the generated file ends with: a file without it was cut short.
LAST_KEY = "architectures"


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except FileNotFoundError:
        raise MatrixError(f"{path} is missing: reinstall speccompat") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MatrixError(f"{path} cannot be read ({exc}): reinstall speccompat") from None


def _header(key: str, path: str | None) -> list[str]:
    path = path or packaged_path()
    lines = _lines(path)
    if not any(line.strip() for line in lines):
        raise MatrixError(f"{path} is empty: reinstall speccompat")
    for line in lines:
        if line.startswith(f"{key}:"):
            try:
                value = json.loads(line.split(":", 1)[1])
            except ValueError:
                value = None
            if isinstance(value, list) and value:
                return [str(v) for v in value]
            break
    raise MatrixError(f"{path} has no list of {key}: it is damaged or truncated; reinstall speccompat")


def problem(path: str | None = None) -> str | None:
    """What is wrong with the file (the packaged copy unless ``path`` is given), in one line - missing,
    unreadable, empty, truncated (it does not end with the ``architectures:`` line the generator
    writes last) or off the schema - or None when it is whole."""
    path = path or packaged_path()
    try:
        text = "".join(_lines(path))
        if not text.strip():
            return f"{path} is empty: reinstall speccompat"
        last = text.rstrip().rsplit("\n", 1)[-1]
        if not text.endswith("\n") or not last.startswith(LAST_KEY + ":"):
            return f"{path} is truncated (its last line is not the '{LAST_KEY}:' one): reinstall speccompat"
        parse(read(text))
    except MatrixError as exc:
        return str(exc) if str(exc).startswith(path) else f"{path}: {exc}"
    return None


def known_releases(path: str | None = None) -> list[str]:
    """The vLLM releases the matrix speaks about (from evidence/static/releases.json)."""
    return _header("releases", path)


def known_speculators(path: str | None = None) -> list[str]:
    """The speculators versions the matrix speaks about (from evidence/static/releases.json)."""
    return _header("speculators", path)


@lru_cache(maxsize=4)
def load(path: str | None = None) -> Matrix:
    """Load and validate the matrix (the packaged copy unless ``path`` is given)."""
    with open(path or packaged_path(), encoding="utf-8") as f:
        return parse(read(f.read()))


if __name__ == "__main__":  # an entry point, never run on import: the dev tooling's command
    from speccompat.evidence.cli import main

    sys.exit(main())
