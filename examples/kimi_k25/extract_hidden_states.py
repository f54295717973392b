"""Step 2 of the Kimi-K2.5 EAGLE-3 pipeline: hidden states of tokenized samples, one file each.

Reads the JSONL written by ``prepare_data.py`` (one ``{"id", "input_ids", "loss_mask"?}`` object a
line), runs speculators' ``VllmHiddenStatesGenerator`` (made to work on this vLLM by
``speccompat.apply()``) on batches of ``--batch-size`` samples and writes one safetensors file per
sample into ``--output-dir``, plus an ``index.jsonl`` manifest. See README.md next to this file.

    python extract_hidden_states.py --model-path /models/Kimi-K2.5 --prepared-data data.jsonl \
        --output-dir hs/ --tp-size 8 --layer-ids 2 30 58 60 --batch-size 2 --max-seq-len 2048

Guarantees:

- every input problem is found before the engine starts and reported with its line number;
  ``--on-bad-line fail`` (and ``--on-long-line fail``) stop there, exit status 2, output untouched;
- a sample file is written to ``<file>.<pid>.partial``, fsynced, renamed into place and the
  directory fsynced: a file named ``*.safetensors`` is always complete, whenever the run dies;
- re-running resumes: samples whose file exists and validates are skipped (not rewritten),
  ``*.partial`` leftovers are removed, ``index.jsonl`` is reconciled with the files;
- exit status: 0 all done, 1 some samples failed or the engine failed (re-run to retry),
  2 rejected before any engine started (bad input, layer ids, disk space, output dir busy).

Only the standard library is imported at module level: vLLM's workers start with ``spawn`` and
re-import this file, which must stay cheap and side-effect free.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("extract_hidden_states")

#: Bytes per element of each supported ``--dtype``, and its safetensors name.
DTYPES = {"bfloat16": (2, "BF16"), "float16": (2, "F16"), "float32": (4, "F32")}
SUFFIX = ".safetensors"
TMP_SUFFIX = ".partial"
INDEX_NAME = "index.jsonl"
LOCK_NAME = ".extract_hidden_states.lock"
FORMAT = "kimi-k25-eagle3-hidden-states/1"
#: Per-layer statistics are logged for this many samples at the start of a run.
STATS_SAMPLES = 3
#: At most this many problems of one kind are logged line by line.
MAX_REPORTED = 100

EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2


class Rejected(Exception):
    """The run cannot start; the message says why and what to do. Exit status 2."""


class BadLine(ValueError):
    """One input line is unusable; the message says why."""


class SampleError(ValueError):
    """The engine's result for one sample failed validation."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Extract EAGLE-3 training hidden states (one safetensors file per sample).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model-path", required=True,
                    help="checkpoint directory (or hub id) of the target model")
    ap.add_argument("--prepared-data", required=True, type=Path,
                    help='JSONL from prepare_data.py: {"id", "input_ids", "loss_mask"?} per line')
    ap.add_argument("--output-dir", required=True, type=Path,
                    help="one <id>.safetensors per sample and index.jsonl; re-running resumes")
    ap.add_argument("--batch-size", type=_positive_int, default=2, help="sequences per generate() call")
    ap.add_argument("--max-seq-len", type=_positive_int, default=2048,
                    help="longest sequence kept whole (the engine gets max_model_len = this + 1)")
    ap.add_argument("--tp-size", type=_positive_int, default=1, help="tensor parallel size (GPUs)")
    ap.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8,
                    help="fraction of GPU memory vLLM may use (on CPU: use a small value, e.g. 0.1)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="decoder layers to capture; default: speculators' choice [2, L//2, L-3, L-1]")
    ap.add_argument("--limit", type=_positive_int, default=None,
                    help="use only the first N valid samples of the input")
    ap.add_argument("--overwrite", action="store_true", help="redo samples whose file already exists")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="dtype of the saved hidden states (the model itself runs in its checkpoint dtype)")
    ap.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail",
                    help="corrupt input lines: skip them with a warning, or stop before the engine starts")
    ap.add_argument("--on-long-line", choices=("truncate", "skip", "fail"), default="truncate",
                    help="lines longer than --max-seq-len: keep the first max-seq-len tokens (as "
                         "speculators does), skip them, or stop before the engine starts")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO")
    return ap.parse_args(argv)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Model facts (read from config.json, no engine)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    hidden_size: int
    num_layers: int
    vocab_size: int


def read_model_info(model_path: str) -> ModelInfo:
    """Hidden size, layer count and vocabulary of the text model (``text_config`` for Kimi-K2.5)."""
    from transformers import PretrainedConfig

    try:
        cfg, _ = PretrainedConfig.get_config_dict(model_path)
    except (OSError, ValueError) as exc:
        raise Rejected(f"cannot read the model config of {model_path}: {exc}") from exc
    text = cfg.get("text_config") or cfg
    try:
        return ModelInfo(int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]))
    except KeyError as exc:
        raise Rejected(f"{model_path}: config.json has no {exc.args[0]!r} (nor in text_config)") from None


def resolve_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    if requested is None:
        return [2, num_layers // 2, num_layers - 3, num_layers - 1]  # speculators' default
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise Rejected(f"--layer-ids {bad} outside the model's layers [0, {num_layers - 1}]")
    if len(set(requested)) != len(requested):
        raise Rejected(f"--layer-ids {requested} has duplicates")
    return list(requested)


# --------------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    id: str
    line: int
    input_ids: array  # int32, already truncated to --max-seq-len
    loss_mask: array | None  # int8, same length
    file: str
    truncated_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class Problem:
    line: int
    reason: str
    fatal: bool


@dataclass
class InputScan:
    samples: list[Sample] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    truncated: list[Sample] = field(default_factory=list)
    blank_lines: int = 0


def file_name_for(sample_id: str) -> str:
    """A safe, unique file name: ids with other characters than ``[A-Za-z0-9._-]`` (or too long,
    or starting with a dot) are cleaned up and get a short hash of the real id appended."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", sample_id).lstrip(".")[:120]
    if safe != sample_id or not safe:
        safe = f"{safe}-{hashlib.sha1(sample_id.encode()).hexdigest()[:10]}"
    return safe + SUFFIX


def parse_line(raw: bytes, vocab_size: int) -> tuple[str, list[int], list[int] | None]:
    """``(id, input_ids, loss_mask or None)`` of one line; raises :class:`BadLine`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadLine(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    sample_id = _parse_id(obj.get("id"))
    ids = _parse_token_ids(obj.get("input_ids"), vocab_size)
    mask = obj.get("loss_mask")
    return sample_id, ids, None if mask is None else _parse_loss_mask(mask, len(ids))


def _parse_id(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadLine(f'"id" must be a string or an integer, got {_describe(value)}')
    sample_id = str(value)
    if not sample_id.strip():
        raise BadLine('"id" is empty')
    return sample_id


def _parse_token_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise BadLine(f'"input_ids" must be a list of token ids, got {_describe(value)}')
    if not value:
        raise BadLine('"input_ids" is empty')
    if not all(type(t) is int for t in value):
        pos, tok = next((i, t) for i, t in enumerate(value) if type(t) is not int)
        raise BadLine(f'"input_ids"[{pos}] = {tok!r} is not an integer')
    lo, hi = min(value), max(value)
    if lo < 0 or hi >= vocab_size:
        pos = next(i for i, t in enumerate(value) if not 0 <= t < vocab_size)
        raise BadLine(f'"input_ids"[{pos}] = {value[pos]} outside the vocabulary [0, {vocab_size})')
    return value


def _parse_loss_mask(value: Any, n: int) -> list[int]:
    if not isinstance(value, list):
        raise BadLine(f'"loss_mask" must be a list of 0/1, got {_describe(value)}')
    if len(value) != n:
        raise BadLine(f'"loss_mask" has {len(value)} entries for {n} input_ids')
    bad = next((i for i, m in enumerate(value) if m not in (0, 1) or isinstance(m, float)), None)
    if bad is not None:
        raise BadLine(f'"loss_mask"[{bad}] = {value[bad]!r} is not 0 or 1')
    return [int(m) for m in value]


def _describe(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def scan_input(path: Path, *, vocab_size: int, max_seq_len: int, on_bad: str, on_long: str,
               limit: int | None) -> InputScan:
    """Read and check every line (up to ``limit`` usable samples). Blank lines are ignored."""
    scan = InputScan()
    first_line_of: dict[str, int] = {}
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise Rejected(f"cannot read --prepared-data {path}: {exc.strerror}") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if limit is not None and len(scan.samples) >= limit:
                break
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
            sample = Sample(sample_id, lineno, array("i", ids), None if mask is None else array("b", mask),
                            file_name_for(sample_id))
            problem = fit_length(sample, max_seq_len, on_long)
            if problem is not None:
                scan.problems.append(problem)
                continue
            if sample.truncated_from is not None:
                scan.truncated.append(sample)
            scan.samples.append(sample)
    return scan


def fit_length(sample: Sample, max_seq_len: int, on_long: str) -> Problem | None:
    """Apply ``--on-long-line`` to a sample: truncate it in place, or return why it is dropped."""
    n = sample.num_tokens
    if n <= max_seq_len:
        return None
    if on_long != "truncate":
        reason = f"id {sample.id!r}: {n} tokens > --max-seq-len {max_seq_len}"
        return Problem(sample.line, reason, fatal=on_long == "fail")
    sample.truncated_from = n
    sample.input_ids = sample.input_ids[:max_seq_len]
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask[:max_seq_len]
    return None


def report_scan(scan: InputScan, path: Path, max_seq_len: int) -> None:
    """Log every problem and truncation with its line number; raise if any problem is fatal."""
    for i, p in enumerate(scan.problems):
        if i == MAX_REPORTED:
            logger.warning("... and %d more problem lines", len(scan.problems) - MAX_REPORTED)
            break
        logger.log(logging.ERROR if p.fatal else logging.WARNING, "%s line %d: %s%s", path, p.line,
                   p.reason, "" if p.fatal else " -> skipped")
    for s in scan.truncated:
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


# --------------------------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """What every sample file must look like in this run."""

    out_dir: Path
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str

    def path(self, sample: Sample) -> Path:
        return self.out_dir / sample.file

    def expected_bytes(self, sample: Sample) -> int:
        """Tensor bytes of one file (its small JSON header aside)."""
        per_token = len(self.layer_ids) * self.hidden_size * DTYPES[self.dtype][0] + 8  # + input_ids
        if sample.loss_mask is not None:
            per_token += 8
        return sample.num_tokens * per_token


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent, the old file, or all of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def file_metadata(sample: Sample, layout: Layout) -> dict[str, str]:
    """The safetensors header metadata: one key, ``sample``, holding sorted JSON (safetensors
    writes several keys in random order; one key keeps equal results byte-identical)."""
    meta: dict[str, Any] = {
        "format": FORMAT,
        "id": sample.id,
        "line": sample.line,
        "num_tokens": sample.num_tokens,
        "layer_ids": list(layout.layer_ids),
        "hidden_size": layout.hidden_size,
        "dtype": layout.dtype,
    }
    if sample.truncated_from is not None:
        meta["truncated_from"] = sample.truncated_from
    return {"sample": json.dumps(meta, sort_keys=True)}


def check_file(path: Path, sample: Sample, layout: Layout) -> str | None:
    """Why the existing file of ``sample`` is not a finished result of this run (None: it is).

    Reads the header and the ``input_ids`` only, not the hidden states.
    """
    from safetensors import safe_open

    n, want_dtype = sample.num_tokens, DTYPES[layout.dtype][1]
    expected = {"input_ids": [n], **{f"hidden_states_{i}": [n, layout.hidden_size] for i in layout.layer_ids}}
    if sample.loss_mask is not None:
        expected["loss_mask"] = [n]
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("sample", "{}"))
            if meta.get("id") != sample.id:
                return f"it holds id {meta.get('id')!r}"
            if set(f.keys()) != set(expected):
                return f"tensors {sorted(f.keys())}, expected {sorted(expected)}"
            for name, shape in expected.items():
                got = f.get_slice(name)
                if got.get_shape() != shape:
                    return f"{name} has shape {got.get_shape()}, expected {shape}"
                if name.startswith("hidden_states_") and got.get_dtype() != want_dtype:
                    return f"{name} is {got.get_dtype()}, expected {want_dtype}"
            if f.get_tensor("input_ids").tolist() != sample.input_ids.tolist():
                return "its input_ids differ from the input line"
    except Exception as exc:  # noqa: BLE001 - any unreadable file is simply redone
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None


def build_tensors(sample: Sample, result: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """Validate the engine's result for ``sample`` and return the tensors to save."""
    import torch

    ids = result["input_ids"]
    if ids.tolist() != sample.input_ids.tolist():
        raise SampleError("the engine returned other input_ids than sent")
    states = result["hidden_states"]
    if len(states) != len(layout.layer_ids):
        raise SampleError(f"{len(states)} layers returned, expected {len(layout.layer_ids)}")
    tensors = {"input_ids": ids.to(torch.long).contiguous()}
    dtype = getattr(torch, layout.dtype)
    for layer, h in zip(layout.layer_ids, states, strict=True):
        if tuple(h.shape) != (sample.num_tokens, layout.hidden_size):
            raise SampleError(f"layer {layer}: shape {tuple(h.shape)}, expected "
                              f"({sample.num_tokens}, {layout.hidden_size})")
        h = h.to(dtype).contiguous()
        if not bool(torch.isfinite(h).all()):
            raise SampleError(f"layer {layer}: non-finite values (as {layout.dtype})")
        tensors[f"hidden_states_{layer}"] = h
    if sample.loss_mask is not None:
        tensors["loss_mask"] = torch.tensor(sample.loss_mask.tolist(), dtype=torch.long)
    return tensors


def log_layer_stats(sample: Sample, tensors: dict[str, Any], layout: Layout) -> None:
    for layer in layout.layer_ids:
        h = tensors[f"hidden_states_{layer}"].float()
        logger.info("stats id %r layer %d: min %.4g max %.4g mean %.4g std %.4g", sample.id, layer,
                    h.min().item(), h.max().item(), h.mean().item(), h.std().item())


# --------------------------------------------------------------------------------------------
# Index (manifest)
# --------------------------------------------------------------------------------------------


class Index:
    """``index.jsonl``: one entry per finished sample file, appended (and fsynced) after the file.

    A run killed between a file's rename and its index line leaves a valid file without an entry;
    :meth:`reconcile` at the next start adds it (and drops entries whose file is gone or changed).
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / INDEX_NAME

    def load(self) -> dict[str, dict[str, Any]]:
        """file name -> entry (the last one wins); malformed lines are reported and dropped."""
        entries: dict[str, dict[str, Any]] = {}
        if not self.path.exists():
            return entries
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    entry = json.loads(raw)
                    entries[entry["file"]] = entry
                except (ValueError, KeyError, TypeError):
                    logger.warning("%s line %d is malformed (interrupted write?); dropped", self.path, lineno)
        return entries

    def reconcile(self, finished: dict[str, Sample], redo: set[str], layout: Layout) -> None:
        """Rewrite the index (atomically, only if it changes) to match the files on disk.

        ``finished``: file -> sample of this input whose file is valid and kept; ``redo``: files
        about to be rewritten. Entries of files from other inputs are kept while their file exists.
        """
        old = self.load()
        new: dict[str, dict[str, Any]] = {}
        for name, entry in old.items():
            if name in finished or name in redo:
                continue
            try:
                if (layout.out_dir / name).stat().st_size == entry.get("bytes"):
                    new[name] = entry
            except OSError:
                pass
        for name, sample in finished.items():
            entry = old.get(name)
            size = (layout.out_dir / name).stat().st_size
            if entry is None or entry != make_entry(sample, layout, size, entry.get("sha256", "")):
                logger.info("index: adding missing entry for %s", name)
                data = (layout.out_dir / name).read_bytes()
                entry = make_entry(sample, layout, len(data), hashlib.sha256(data).hexdigest())
            new[name] = entry
        text = "".join(json.dumps(e) + "\n" for e in new.values())
        if self.path.exists() and self.path.read_text() == text:
            return
        write_atomic(self.path, text.encode())

    def append(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def make_entry(sample: Sample, layout: Layout, size: int, sha256: str) -> dict[str, Any]:
    entry = {
        "id": sample.id,
        "file": sample.file,
        "line": sample.line,
        "num_tokens": sample.num_tokens,
        "layer_ids": list(layout.layer_ids),
        "hidden_size": layout.hidden_size,
        "dtype": layout.dtype,
        "bytes": size,
        "sha256": sha256,
    }
    if sample.truncated_from is not None:
        entry["truncated_from"] = sample.truncated_from
    return entry


# --------------------------------------------------------------------------------------------
# Output directory: lock, leftovers, resume plan, disk space
# --------------------------------------------------------------------------------------------


def lock_output_dir(out_dir: Path) -> Any:
    """Hold an exclusive lock on ``out_dir`` for the life of the process (released on any exit,
    SIGKILL included). Returns the open lock file; keep a reference to it."""
    import fcntl

    handle = open(out_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        raise Rejected(f"another extraction is writing to {out_dir} (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def remove_leftovers(out_dir: Path) -> None:
    """Delete ``*.partial`` files: temporary files of a run that died (we hold the lock)."""
    leftovers = sorted(out_dir.glob(f"*{TMP_SUFFIX}"))
    for p in leftovers:
        p.unlink()
    if leftovers:
        logger.info("removed %d temporary file(s) left by an interrupted run: %s", len(leftovers),
                    ", ".join(p.name for p in leftovers[:5]) + (" ..." if len(leftovers) > 5 else ""))


def plan(samples: list[Sample], layout: Layout, overwrite: bool) -> tuple[list[Sample], dict[str, Sample]]:
    """``(to do, finished)``: samples without a valid file (all with ``overwrite``), and the rest."""
    todo: list[Sample] = []
    finished: dict[str, Sample] = {}
    for sample in samples:
        path = layout.path(sample)
        if overwrite or not path.exists():
            todo.append(sample)
            continue
        problem = check_file(path, sample, layout)
        if problem is None:
            finished[sample.file] = sample
        else:
            logger.warning("%s (line %d) exists but is not a result of this run: %s; it will be redone",
                           path.name, sample.line, problem)
            todo.append(sample)
    return todo, finished


def check_disk(out_dir: Path, todo: list[Sample], all_samples: list[Sample], layout: Layout) -> None:
    per = DTYPES[layout.dtype][0]
    total = sum(layout.expected_bytes(s) for s in all_samples)
    need = sum(layout.expected_bytes(s) for s in todo)
    free = shutil.disk_usage(out_dir).free
    logger.info(
        "expected size: %s for all %d samples, %s still to write (%d layers x tokens x hidden %d x "
        "%d bytes, + input_ids/loss_mask); free in %s: %s",
        _size(total), len(all_samples), _size(need), len(layout.layer_ids), layout.hidden_size, per,
        out_dir, _size(free),
    )
    if need > free:
        raise Rejected(f"not enough disk space in {out_dir}: {_size(need)} needed, {_size(free)} free "
                       "(free some space, or use --limit for a part of the input)")
    if need > 0.9 * free:
        logger.warning("the output will leave less than 10%% of %s free", out_dir)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------


def start_generator(args: argparse.Namespace, layer_ids: list[int]) -> Any:
    """speccompat first, then speculators' generator (which starts vLLM's workers)."""
    import speccompat

    status = speccompat.apply()
    if status.state not in ("armed", "active"):
        raise Rejected(f"speccompat could not adapt this installation ({status.state}): "
                       + "; ".join(status.warnings + status.errors))
    from speculators.data_generation import VllmHiddenStatesGenerator

    logger.info("starting the engine: %s, TP %d, layers %s, max_model_len %d", args.model_path,
                args.tp_size, layer_ids, args.max_seq_len + 1)
    return VllmHiddenStatesGenerator(
        args.model_path,
        layer_ids=layer_ids,
        # speculators (and speccompat) keep max_model_len - 1 tokens: one is reserved for the
        # single sampled token. +1 keeps sequences of exactly --max-seq-len whole.
        max_model_len=args.max_seq_len + 1,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tp_size,
    )


def stop_generator(gen: Any) -> None:
    executor = getattr(gen, "executor", None)
    if executor is not None:
        gen.executor = None
        with contextlib.suppress(Exception):
            executor.shutdown()


def generate(gen: Any, batch: list[Sample]) -> list[dict[str, Any] | Exception]:
    """Results of one batch, in order. A batch rejected by speccompat's validation is retried one
    sample at a time, so one bad sample does not take its neighbours down; other errors (the
    engine died) propagate."""
    from speccompat.errors import HiddenStatesError

    try:
        return gen.generate([s.input_ids.tolist() for s in batch])
    except HiddenStatesError as exc:
        if len(batch) == 1:
            return [exc]
        logger.warning("a batch of %d failed validation (%s); retrying one by one", len(batch), exc)
        return [generate(gen, [s])[0] for s in batch]


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclass
class Totals:
    written: int = 0
    skipped: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    loop_s: float = 0.0
    failures: list[str] = field(default_factory=list)


def save_sample(sample: Sample, result: dict[str, Any], layout: Layout, index: Index, log_stats: bool) -> int:
    """Validate, write atomically, then index one sample. Returns the bytes written."""
    from safetensors.torch import save

    tensors = build_tensors(sample, result, layout)
    if log_stats:
        log_layer_stats(sample, tensors, layout)
    data = save(tensors, metadata=file_metadata(sample, layout))
    write_atomic(layout.path(sample), data)
    index.append(make_entry(sample, layout, len(data), hashlib.sha256(data).hexdigest()))
    return len(data)


class Progress:
    """A tqdm bar (samples/s, tokens/s) on a terminal; a log line every ``every`` seconds
    otherwise, so that log files get readable progress instead of carriage returns."""

    def __init__(self, total: int, totals: Totals, every: float = 30.0) -> None:
        from tqdm import tqdm

        self.total, self.totals, self.every = total, totals, every
        self.done = 0
        self.start = self.last_log = time.monotonic()
        self.bar = tqdm(total=total, unit="sample", desc="extract", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self.totals.loop_s = elapsed = max(now - self.start, 1e-9)
        rate = f"{self.totals.tokens / elapsed:.0f} tok/s, {_size(self.totals.bytes)}"
        self.bar.set_postfix_str(rate, refresh=False)
        self.bar.update(n)
        if self.bar.disable and (now - self.last_log >= self.every or self.done == self.total):
            self.last_log = now
            eta = (self.total - self.done) * elapsed / self.done
            logger.info("progress: %d/%d samples, %.2f samples/s, %s, ETA %.0f s", self.done, self.total,
                        self.done / elapsed, rate, eta)

    def close(self) -> None:
        self.bar.close()


def run_batches(gen: Any, todo: list[Sample], layout: Layout, index: Index, batch_size: int,
                totals: Totals) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    progress = Progress(len(todo), totals)
    try:
        with logging_redirect_tqdm():
            for first in range(0, len(todo), batch_size):
                batch = todo[first:first + batch_size]
                for sample, result in zip(batch, generate(gen, batch), strict=True):
                    save_or_fail(sample, result, layout, index, totals)
                progress.update(len(batch))
    finally:
        progress.close()


def save_or_fail(sample: Sample, result: dict[str, Any] | Exception, layout: Layout, index: Index,
                 totals: Totals) -> None:
    try:
        if isinstance(result, Exception):
            raise SampleError(str(result))
        totals.bytes += save_sample(sample, result, layout, index, log_stats=totals.written < STATS_SAMPLES)
    except SampleError as exc:
        totals.failed += 1
        totals.failures.append(f"line {sample.line} id {sample.id!r}: {exc}")
        logger.error("line %d id %r failed: %s (not written)", sample.line, sample.id, exc)
        return
    totals.written += 1
    totals.tokens += sample.num_tokens


def summarize(totals: Totals, started: float, engine_s: float, out_dir: Path) -> None:
    loop = max(totals.loop_s, 1e-9)
    logger.info(
        "summary: %d written, %d already done (skipped), %d failed; %d tokens in %.1f s "
        "(engine start %.1f s, extraction %.1f s: %.0f tokens/s, %.2f samples/s); %s written to %s",
        totals.written, totals.skipped, totals.failed, totals.tokens, time.monotonic() - started, engine_s,
        totals.loop_s, totals.tokens / loop, totals.written / loop, _size(totals.bytes), out_dir,
    )
    for line in totals.failures[:MAX_REPORTED]:
        logger.error("failed: %s", line)
    if totals.failed:
        logger.error("%d sample(s) failed; re-run the same command to retry them", totals.failed)


def extract(args: argparse.Namespace) -> int:
    started = time.monotonic()
    info = read_model_info(args.model_path)
    layer_ids = resolve_layer_ids(args.layer_ids, info.num_layers)
    scan = scan_input(args.prepared_data, vocab_size=info.vocab_size, max_seq_len=args.max_seq_len,
                      on_bad=args.on_bad_line, on_long=args.on_long_line, limit=args.limit)
    report_scan(scan, args.prepared_data, args.max_seq_len)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_output_dir(args.output_dir)  # noqa: F841 - held until exit
    remove_leftovers(args.output_dir)
    layout = Layout(args.output_dir, tuple(layer_ids), info.hidden_size, args.dtype)
    todo, finished = plan(scan.samples, layout, args.overwrite)
    index = Index(args.output_dir)
    index.reconcile(finished, {s.file for s in todo}, layout)
    totals = Totals(skipped=len(finished))
    logger.info("%d of %d samples already done; %d to extract (layers %s, hidden %d, %s)", len(finished),
                len(scan.samples), len(todo), layer_ids, info.hidden_size, args.dtype)
    check_disk(args.output_dir, todo, scan.samples, layout)
    if not todo:
        logger.info("nothing to do: every sample has a valid file in %s", args.output_dir)
        summarize(totals, started, 0.0, args.output_dir)
        return EXIT_OK

    t0 = time.monotonic()
    try:
        gen = start_generator(args, layer_ids)
    except Rejected:
        raise
    except Exception:
        logger.exception("the engine did not start (nothing was written)")
        return EXIT_FAILED
    engine_s = time.monotonic() - t0
    logger.info("engine ready in %.1f s", engine_s)
    try:
        run_batches(gen, todo, layout, index, args.batch_size, totals)
    except KeyboardInterrupt:
        logger.error("interrupted; finished samples are kept, re-run to resume")
        summarize(totals, started, engine_s, args.output_dir)
        return 130
    except Exception:
        logger.exception("the engine failed; finished samples are kept, re-run to resume")
        summarize(totals, started, engine_s, args.output_dir)
        return EXIT_FAILED
    finally:
        stop_generator(gen)
    summarize(totals, started, engine_s, args.output_dir)
    return EXIT_FAILED if totals.failed else EXIT_OK


def use_spawn() -> None:
    """vLLM's GPU workers need ``spawn`` (a forked CUDA context is unusable); set it before vLLM
    (or torch) is imported."""
    import multiprocessing

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    with contextlib.suppress(RuntimeError):
        multiprocessing.set_start_method("spawn")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    use_spawn()
    try:
        return extract(args)
    except Rejected as exc:
        logger.error("%s", exc)
        return EXIT_REJECTED


if __name__ == "__main__":
    sys.exit(main())
