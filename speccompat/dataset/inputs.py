"""Tokenized input: one JSON object a line, ``{"id": str|int, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}``.

Every line is read and checked before any engine starts (:func:`scan_jsonl`), and every problem is
kept with its line number: not UTF-8, bad JSON (also integers too long to convert), not an object,
a bad ``id`` (missing, empty, not a string or integer, a boolean), ``input_ids`` that are not a
non-empty list of integers in the vocabulary (floats and booleans are not token ids), a
``loss_mask`` that is not a list of 0/1 integers of the same length, an id seen before (``1`` and
``"1"`` are the same id), an id the data set cannot store (one holding a lone UTF-16 surrogate such
as ``"\\ud800"``, valid JSON that has no UTF-8 form; one longer than :data:`MAX_ID_BYTES`).
Token ids are checked by the generator's own :func:`speccompat.generator.normalize_token_ids`, so
the driver accepts exactly what ``generate()`` accepts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Rejected

__all__ = ["MAX_ID_BYTES", "BadLine", "InputScan", "Problem", "Sample", "id_problem", "input_digest", "parse_line",
           "report_scan", "scan_jsonl"]

logger = logging.getLogger("speccompat.dataset")

#: At most this many problems are logged one by one.
MAX_REPORTED = 100
#: The longest id (UTF-8 bytes) a data set stores: it is in every file's header and manifest line.
MAX_ID_BYTES = 4096


class BadLine(ValueError):
    """One input line is unusable; the message says why."""


@dataclass
class Sample:
    """One sample to extract: its id, input line, token ids (truncated to the run's length)."""

    id: str
    line: int
    input_ids: array  # 'q', already truncated
    loss_mask: array | None  # 'b', same length
    truncated_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def digest(self) -> str:
        """SHA-256 of what the engine sees and what is stored beside it (ids and loss mask)."""
        return input_digest(self.input_ids, self.loss_mask)


def input_digest(input_ids: Any, loss_mask: Any) -> str:
    """SHA-256 of token ids (int64) and a 0/1 loss mask (int8), or of their text where a value does
    not fit those types (read from a damaged file: it then matches no input's digest; never raises)."""
    h = hashlib.sha256(b"input_ids:q:")
    try:
        h.update(array("q", input_ids).tobytes())
    except (OverflowError, TypeError):
        h.update(b"!" + repr(list(input_ids)).encode())
    if loss_mask is None:
        h.update(b"|loss_mask:none")
    else:
        h.update(b"|loss_mask:b:")
        try:
            h.update(array("b", loss_mask).tobytes())
        except (OverflowError, TypeError):
            h.update(b"!" + repr(list(loss_mask)).encode())
    return h.hexdigest()


@dataclass
class Problem:
    line: int
    reason: str
    fatal: bool


@dataclass
class InputScan:
    path: Path
    samples: list[Sample] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    truncated: list[Sample] = field(default_factory=list)
    blank_lines: int = 0


def _describe(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` keeps the last one without a word: which
    ``input_ids`` or ``loss_mask`` was meant cannot be told)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise BadLine(f"duplicate key {key!r} in a JSON object: which value is meant cannot be told")
        obj[key] = value
    return obj


def parse_line(raw: bytes, vocab_size: int) -> tuple[str, list[int], list[int] | None]:
    """``(id, input_ids, loss_mask or None)`` of one line; raises :class:`BadLine`."""
    from ..generator import normalize_token_ids

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except BadLine:
        raise
    except json.JSONDecodeError as exc:
        raise BadLine(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise BadLine(f"bad JSON: {exc}") from None
    except RecursionError:
        raise BadLine("bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    value = obj.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadLine(f'"id" must be a string or an integer, got {_describe(value)}')
    sample_id = str(value)
    if not sample_id.strip():
        raise BadLine('"id" is empty')
    id_problem(sample_id)
    ids = obj.get("input_ids")
    if not isinstance(ids, list):
        raise BadLine(f'"input_ids" must be a list of token ids, got {_describe(ids)}')
    if not ids:
        raise BadLine('"input_ids" is empty')
    try:
        (ids,), _ = normalize_token_ids([ids], vocab_size=vocab_size, max_len=len(ids))
    except (TypeError, ValueError) as exc:
        raise BadLine(str(exc).replace("sequence 0, position ", '"input_ids"[').replace(": token id", "]: token id")
                      ) from None
    mask = obj.get("loss_mask")
    if mask is None:
        return sample_id, ids, None
    if not isinstance(mask, list):
        raise BadLine(f'"loss_mask" must be a list of 0/1, got {_describe(mask)}')
    if len(mask) != len(ids):
        raise BadLine(f'"loss_mask" has {len(mask)} entries for {len(ids)} input_ids')
    bad = next((i for i, m in enumerate(mask) if type(m) is not int or m not in (0, 1)), None)
    if bad is not None:
        raise BadLine(f'"loss_mask"[{bad}] = {mask[bad]!r} is not the integer 0 or 1')
    return sample_id, ids, mask


def id_problem(sample_id: str) -> None:
    """Raise :class:`BadLine` for an id the data set cannot store: the manifest, the file names and
    every file's metadata hold its UTF-8 bytes."""
    try:
        raw = sample_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadLine(f'"id" {ascii(sample_id[:40])}{"..." if len(sample_id) > 40 else ""} holds a lone UTF-16 '
                      f"surrogate ({ascii(sample_id[exc.start])} at character {exc.start}): it has no UTF-8 form "
                      "and cannot be stored") from None
    if len(raw) > MAX_ID_BYTES:
        raise BadLine(f'"id" is {len(raw)} bytes long (UTF-8), more than the {MAX_ID_BYTES} a data set stores')


def scan_jsonl(path: Path, *, vocab_size: int, max_seq_len: int, on_bad: str = "fail",
               on_long: str = "truncate", limit: int | None = None) -> InputScan:
    """Read and check every line (up to ``limit`` usable samples). Blank lines are ignored.

    ``on_bad``: ``fail`` | ``skip`` (corrupt lines); ``on_long``: ``truncate`` | ``skip`` | ``fail``
    (lines longer than ``max_seq_len``). Raises :class:`Rejected` when the file cannot be read."""
    scan = InputScan(Path(path))
    first_line_of: dict[str, int] = {}
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise Rejected(f"cannot read the input {path}: {exc.strerror}") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if limit is not None and len(scan.samples) >= limit:
                break
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte order mark (editors on Windows write one): not part of the JSON
            if not raw.strip():
                scan.blank_lines += 1
                continue
            try:
                sample_id, ids, mask = parse_line(raw, vocab_size)
                if sample_id in first_line_of:
                    raise BadLine(f"duplicate id {sample_id!r} (first on line {first_line_of[sample_id]})")
            except BadLine as exc:
                scan.problems.append(Problem(lineno, str(exc), on_bad == "fail"))
                continue
            first_line_of[sample_id] = lineno
            n = len(ids)
            if n > max_seq_len:
                if on_long != "truncate":
                    scan.problems.append(Problem(lineno, f"id {sample_id!r}: {n} tokens > --max-seq-len "
                                                 f"{max_seq_len}", fatal=on_long == "fail"))
                    continue
                ids, mask = ids[:max_seq_len], None if mask is None else mask[:max_seq_len]
            sample = Sample(sample_id, lineno, array("q", ids), None if mask is None else array("b", mask),
                            truncated_from=n if n > max_seq_len else None)
            if sample.truncated_from is not None:
                scan.truncated.append(sample)
            scan.samples.append(sample)
    return scan


def report_scan(scan: InputScan, max_seq_len: int) -> None:
    """Log every problem and truncation with its line number; raise :class:`Rejected` if any
    problem is fatal or no sample is usable."""
    path = scan.path
    for i, p in enumerate(scan.problems):
        if i == MAX_REPORTED:
            logger.warning("... and %d more problem lines", len(scan.problems) - MAX_REPORTED)
            break
        logger.log(logging.ERROR if p.fatal else logging.WARNING, "%s line %d: %s%s", path, p.line,
                   p.reason, "" if p.fatal else " -> skipped")
    for s in scan.truncated[:MAX_REPORTED]:
        logger.warning("%s line %d: id %r has %d tokens, truncated to --max-seq-len %d%s", path, s.line,
                       s.id, s.truncated_from, max_seq_len, "" if s.loss_mask is None else " (loss_mask too)")
    fatal = [p for p in scan.problems if p.fatal]
    if fatal:
        lines = ", ".join(str(p.line) for p in fatal[:20]) + (" ..." if len(fatal) > 20 else "")
        raise Rejected(
            f"{len(fatal)} unusable line(s) in {path} (lines {lines}); nothing was run or written. "
            "Fix them, or pass --on-bad-line skip (corrupt lines) / --on-long-line truncate|skip"
        )
    if not scan.samples:
        raise Rejected(f"no usable samples in {path}")
    logger.info("input: %d samples (%d tokens) from %s; %d problem lines skipped, %d truncated, "
                "%d blank lines", len(scan.samples), sum(s.num_tokens for s in scan.samples), path,
                len(scan.problems), len(scan.truncated), scan.blank_lines)
