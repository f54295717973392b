"""The background writer: samples are written on a few threads while the engine computes the next
batch; the caller waits only when more than ``max_in_flight_bytes`` of results are not yet written.

Per sample (on a writer thread): cast to the stored dtype if needed (or quantize to fp8 with its
scales, :mod:`speccompat.dataset.fp8`), encode (safetensors header + the tensors' own buffers; or
``torch.save`` for the speculators layout), reserve the space, write,
checksum each tensor's buffer, fsync, into ``<file>.<pid>.partial``, then drop the file's pages from
the page cache (:meth:`FileOps.drop_cache`): nobody reads them again soon, and on a virtual machine
that hands memory left free for a few seconds back to its host, every new cached page costs a fault
in the host, which held 16 threads writing fsync'd files to about 0.6 of their rate with the pages
dropped (benchmarks/NOTES.md, "The page cache on a virtual machine"). Per batch, once all its files
are written (in submission order; the batches finished by then together, a group commit): append
their manifest entries with one write + fsync, rename each file into place, fsync the directory
once. Hence a visible sample file is complete and has its manifest entry, whenever the process
dies; a crash between the manifest append and the renames leaves entries without files, which a
resume redoes.

A sample the writer cannot store (a cast that overflows the stored dtype, an entry that cannot be
encoded: anything but an I/O error) fails alone: its temporary file is removed, it is listed in
:attr:`DatasetWriter.failed` with the reason, and the other samples are written and committed as
usual, so one bad sample never stops a run (nor every re-run).

A full disk (ENOSPC, EDQUOT) or another I/O error stops the writer: the failing file's temporary
file is removed, files already written are still committed with their entries, and the next
``submit`` (or ``close``) raises :class:`NoSpace` / :class:`WriterFailed`. An error of the commit
itself (the manifest append, a rename, the directory fsync, ``on_commit``) is recorded the same
way, and no later batch commits: the failed batch's files that were not renamed are removed and
their entries taken out of the manifest again (rewritten atomically), so the manifest lists no
file that is not in place unless the process dies between the append and the renames (a resume
drops such entries). Every system call, the manifest append included, goes through
:class:`FileOps`, so tests inject faults into each.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checksum import digest_fn
from .errors import NoSpace, WriterFailed
from .formats import Layout
from .fsutil import FileOps, is_no_space, write_all
from .manifest import Manifest
from .names import tmp_name
from .spec import StoredSpec

__all__ = ["DatasetWriter", "WriteJob", "WriterStats"]

logger = logging.getLogger("speccompat.dataset")


@dataclass
class WriteJob:
    """One sample to write: ``entry`` is its manifest entry without the file facts, ``hidden_states``
    one tensor per layer id."""

    sample: Any
    file: str
    hidden_states: list[Any]
    entry: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0


@dataclass
class WriterStats:
    files: int = 0
    bytes: int = 0
    write_s: float = 0.0  # summed over threads
    commit_s: float = 0.0
    waited_s: float = 0.0  # time submit() blocked the caller on the in-flight budget
    waits: int = 0  # submit() calls that blocked
    peak_in_flight: int = 0
    fp8_values: int = 0  # hidden-state values quantized to fp8
    fp8_flushed: int = 0  # of them: nonzero, stored as 0 (below fp8's smallest step at their scale)


class _Batch:
    def __init__(self, jobs: list[WriteJob]) -> None:
        self.jobs = jobs
        self.left = len(jobs)
        self.done: list[tuple[WriteJob, str, dict[str, Any]]] = []  # (job, tmp path, entry)


class DatasetWriter:
    """Write :class:`WriteJob` batches into ``out_dir`` under ``manifest``, in the background."""

    def __init__(self, out_dir: Path, layout: Layout, manifest: Manifest, *, spec: StoredSpec, checksum: str,
                 threads: int = 4, max_in_flight_bytes: int = 8 << 30, ops: FileOps | None = None,
                 check_cast: bool = True, on_commit: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        import torch

        self.out_dir, self.layout, self.manifest = Path(out_dir), layout, manifest
        self.spec, self.check_cast = spec, check_cast
        self.dtype = getattr(torch, spec.torch_dtype_name)  # what a cast stores (fp8: quantized by spec.granularity)
        self.digest = digest_fn(checksum)
        self.ops = ops or FileOps()
        self.manifest.ops = self.ops  # the manifest append is one of the writer's file operations
        self.commit_failed = False  # once a commit failed, no later batch commits
        self.budget = max(1, int(max_in_flight_bytes))
        self.on_commit = on_commit
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="speccompat-writer")
        self.cond = threading.Condition()
        self.in_flight = 0
        self.batches: deque[_Batch] = deque()
        self.commit_lock = threading.Lock()  # the queue of batches and their progress
        self.committer = threading.Lock()  # held by the one thread committing (file I/O, no queue)
        self.error: BaseException | None = None
        #: (sample, reason) of every sample that could not be stored (the others are written)
        self.failed: list[tuple[Any, str]] = []
        self.stats = WriterStats()
        self.closed = False

    # -- caller side --------------------------------------------------------------------------

    def submit(self, jobs: list[WriteJob]) -> None:
        """Queue one batch. Blocks while the in-flight budget is spent (at least one batch is
        always admitted); raises the writer's error once it has stopped."""
        self.raise_if_failed()
        for job in jobs:
            job.nbytes = sum(h.numel() * h.element_size() for h in job.hidden_states)
        size = sum(j.nbytes for j in jobs)
        t0 = time.perf_counter()
        with self.cond:
            if self.in_flight and self.in_flight + size > self.budget:
                self.stats.waits += 1
            while self.in_flight and self.in_flight + size > self.budget and self.error is None:
                self.cond.wait()
            self.in_flight += size
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.in_flight)
        self.stats.waited_s += time.perf_counter() - t0
        self.raise_if_failed()
        batch = _Batch(jobs)
        with self.commit_lock:
            self.batches.append(batch)
        if not jobs:
            self._commit_ready()
        for job in jobs:
            self.pool.submit(self._run, batch, job)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, *, raise_error: bool = True) -> WriterStats:
        """Wait for every queued file, commit what was written; raise the writer's error, if any."""
        if not self.closed:
            self.closed = True
            self.pool.shutdown(wait=True)
            self._commit_ready()
        if raise_error:
            self.raise_if_failed()
        return self.stats

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(raise_error=exc[0] is None)

    # -- writer threads -----------------------------------------------------------------------

    def _run(self, batch: _Batch, job: WriteJob) -> None:
        try:
            if self.error is None:
                tmp, entry = self._write(job)
                with self.commit_lock:
                    batch.done.append((job, tmp, entry))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            if isinstance(exc, OSError):  # the disk: nothing more can be written
                self._fail(exc)
            else:  # this sample alone cannot be stored
                why = f"{type(exc).__name__}: {exc}"
                logger.error("id %r cannot be stored: %s (not written; the other samples are)",
                             getattr(job.sample, "id", "?"), why)
                with self.cond:
                    self.failed.append((job.sample, why))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self._fail(exc)
        finally:
            job.hidden_states = []  # drop the tensors: this is what frees the budget
            with self.cond:
                self.in_flight -= job.nbytes
                self.cond.notify_all()
            with self.commit_lock:
                batch.left -= 1
            self._commit_ready()

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                if is_no_space(exc):
                    self.error = NoSpace(f"no space left on {self.out_dir} ({exc.strerror}); finished files are "
                                         "kept with their manifest entries: free some space and re-run to resume")
                else:
                    self.error = WriterFailed(f"writing to {self.out_dir} failed: {type(exc).__name__}: {exc}; "
                                              "finished files are kept: re-run to resume")
                self.error.__cause__ = exc
            self.cond.notify_all()

    def _write(self, job: WriteJob) -> tuple[str, dict[str, Any]]:
        import torch

        t0 = time.perf_counter()
        # the manifest must take the entry: a sample it cannot encode fails here, alone, not in the commit
        entry_json({**job.entry, "file": job.file}).encode("utf-8")
        # for fp8, quantize() refuses a non-finite state; fp8 values never overflow
        named = self.layout.tensors(job.sample, job.hidden_states, self.spec)
        flushed = values = 0
        if self.spec.is_fp8:  # a value that is not 0 but stored as 0: counted, the run says it
            zeros_in = sum(int(torch.count_nonzero(h == 0)) for h in job.hidden_states)
            values = sum(h.numel() for h in job.hidden_states)
            zeros_out = sum(t.numel() - int(torch.count_nonzero(t.view(torch.uint8) & 0x7F))  # +0 and -0
                            for n, t in named if n.startswith("hidden_states") and t.dtype == torch.float8_e4m3fn)
            flushed = zeros_out - zeros_in
        if self.check_cast and not self.spec.is_fp8:
            src = {h.dtype for h in job.hidden_states}
            if src != {self.dtype}:  # a cast may overflow (float32 -> float16): check what is stored
                for name, t in named:
                    if name.startswith("hidden_states") and not bool(torch.isfinite(t).all()):
                        raise ValueError(f"id {job.sample.id!r}: {name} has values that do not fit "
                                         f"{self.dtype} (non-finite after the cast)")
        enc = self.layout.encode(named, job.metadata)
        tmp = str(self.out_dir / tmp_name(job.file))
        ops = self.ops
        fd = ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        tensors: dict[str, Any] = {}
        try:
            try:
                if enc.trailer is None:
                    ops.reserve(fd, enc.nbytes)
                    write_all(ops, fd, memoryview(enc.header))
                    for name, dtype, shape, buf in enc.tensors:
                        write_all(ops, fd, buf)
                        tensors[name] = {"dtype": dtype, "shape": shape, "checksum": self.digest(buf)}
                    size = enc.nbytes
                else:  # torch.save (speculators layout), through the same file operations
                    size = _torch_save(enc.trailer, fd, ops)
                    for name, dtype, shape, buf in enc.tensors:
                        tensors[name] = {"dtype": dtype, "shape": shape, "checksum": self.digest(buf)}
                ops.fsync(fd)
                ops.drop_cache(fd)
            finally:
                ops.close(fd)
        except BaseException:
            try:
                ops.unlink(tmp)
            except OSError:
                pass
            raise
        entry = {**job.entry, "file": job.file, "bytes": size, "tensors": tensors}
        with self.cond:
            self.stats.write_s += time.perf_counter() - t0
            self.stats.fp8_values += values
            self.stats.fp8_flushed += flushed
        return tmp, entry

    def _commit_ready(self) -> None:
        """Commit the finished batches at the head of the queue, in submission order. Never raises:
        an error is recorded for :meth:`raise_if_failed` (and ``close``).

        A group commit: all the batches finished by then go in one commit (one manifest append and
        fsync, one directory fsync), made by one thread at a time outside :attr:`commit_lock`, so
        that the other writer threads go on recording finished files meanwhile. A thread that finds
        a commit under way leaves its batch to that thread, which looks at the queue again after
        it. The more the disk's fsyncs lag, the more samples each commit takes."""
        while self.committer.acquire(blocking=False):
            try:
                with self.commit_lock:
                    ready = []
                    while self.batches and self.batches[0].left == 0:
                        ready.append(self.batches.popleft())
                self._commit_group([b for b in ready if b.done])
            finally:
                self.committer.release()
            with self.commit_lock:  # batches finished while this thread held the committer
                if not (self.batches and self.batches[0].left == 0):
                    return

    def _commit_group(self, ready: list[_Batch]) -> None:
        if not ready:
            return
        if self.commit_failed:
            self._discard([tmp for batch in ready for _, tmp, _ in batch.done])
            return
        done: list[tuple[WriteJob, str, dict[str, Any]]] = []
        for batch in ready:  # each batch's files in its jobs' order, the batches in submission order
            order = {id(j): k for k, j in enumerate(batch.jobs)}
            done += sorted(batch.done, key=lambda d: order[id(d[0])])
        try:
            self._commit(done)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.commit_failed = True
            self._fail(exc)

    def _discard(self, tmps: list[str]) -> None:
        for tmp in tmps:
            try:
                self.ops.unlink(tmp)
            except OSError:
                pass

    def _commit(self, done: list[tuple[WriteJob, str, dict[str, Any]]]) -> None:
        """One commit of ``done`` (job, temporary file, entry), in the order given."""
        t0 = time.perf_counter()
        entries = [entry for _, _, entry in done]
        try:
            self.manifest.append(entries)
        except BaseException:
            self._discard([tmp for _, tmp, _ in done])
            self._unlist([])  # a torn or unsynced append: the manifest again lists only what is in place
            raise
        renamed = 0
        try:
            for (job, tmp, _entry) in done:
                self.ops.replace(tmp, str(self.out_dir / job.file))
                renamed += 1
            self.ops.fsync_dir(str(self.out_dir))
        except BaseException:
            self._discard([tmp for _, tmp, _ in done[renamed:]])
            self._unlist([e["file"] for e in entries[renamed:]])
            raise
        self.stats.files += len(done)
        self.stats.bytes += sum(e["bytes"] for e in entries)
        self.stats.commit_s += time.perf_counter() - t0
        if self.on_commit is not None:
            self.on_commit(entries)

    def _unlist(self, files: list[str]) -> None:
        """Take ``files`` out of the manifest (best effort: a resume drops entries without a file)."""
        for f in files:
            self.manifest.entries.pop(f, None)
        try:
            self.manifest.rewrite()
        except OSError as exc:
            logger.warning("cannot rewrite %s after a failed commit (%s); a resume drops its entries of missing "
                           "files", self.manifest.path, exc)


class _FdWriter:
    """A minimal binary file object over ``fd`` for ``torch.save`` (through :class:`FileOps`)."""

    def __init__(self, fd: int, ops: FileOps) -> None:
        self.fd, self.ops, self.pos = fd, ops, 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        write_all(self.ops, self.fd, view)
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return False


def _torch_save(obj: Any, fd: int, ops: FileOps) -> int:
    import torch

    f = _FdWriter(fd, ops)
    torch.save(obj, f)
    return f.pos


def entry_json(entry: dict[str, Any]) -> str:
    return json.dumps(entry, ensure_ascii=False)
