"""The background writer (speccompat.dataset.writer) with fake results: the in-flight budget, group
commits in submission order, a failed commit, and the page cache dropped once a file is durable."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from support.dataset_fakes import HIDDEN, LAYERS, jsonl, model_dir, random_records, states
from support.dataset_runs import manifest_entries, needs_torch, provenance, scan

from speccompat.dataset.fsutil import FileOps


class SlowDisk(FileOps):
    def write(self, fd, buf):
        time.sleep(0.02)
        return os.write(fd, buf)


@needs_torch
def test_the_in_flight_budget_bounds_memory_and_the_caller_does_not_wait_below_it(tmp_path):
    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(12, lo=30, hi=31)))
    per = 30 * HIDDEN * 2 * len(LAYERS)
    ds = open_dataset(tmp_path / "out", samples, provenance(model))
    w = ds.writer(threads=2, max_in_flight_bytes=3 * per, ops=SlowDisk())
    w.submit([ds.job(s, states(s)) for s in ds.todo[:2]])
    assert w.stats.waits == 0  # below the budget: returns without waiting
    for k in range(2, 12, 2):
        w.submit([ds.job(s, states(s)) for s in ds.todo[k:k + 2]])
    stats = w.close()
    assert stats.files == 12 and stats.waits > 0 and stats.waited_s > 0 and stats.peak_in_flight <= 4 * per


class SlowFsyncDir(FileOps):
    """Directory fsyncs of 50 ms (a disk whose journal commits lag); counts them. The
    ``fail_rename``-th rename fails with EIO when set."""

    def __init__(self, fail_rename: int | None = None) -> None:
        self.calls, self.renames, self.fail_rename = 0, 0, fail_rename

    def fsync_dir(self, path):
        self.calls += 1
        time.sleep(0.05)
        return super().fsync_dir(path)

    def replace(self, src, dst):
        self.renames += 1
        if self.renames == self.fail_rename:
            raise OSError(errno.EIO, "Input/output error")
        return super().replace(src, dst)


@needs_torch
def test_batches_finished_during_a_commit_are_committed_together_in_submission_order(tmp_path):
    from speccompat.dataset import open_dataset, verify_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(40, lo=30, hi=31)))
    ds = open_dataset(tmp_path / "out", samples, provenance(model))
    ops = SlowFsyncDir()
    w = ds.writer(threads=4, ops=ops)
    for s in ds.todo:
        w.submit([ds.job(s, states(s))])  # one sample per batch, as the streaming driver submits
    stats = w.close()
    ds.lock.close()
    assert stats.files == 40
    # a commit per batch would take 40 directory fsyncs (2 s); the writer threads finish batches
    # while one commits, and the next commit takes all of them
    assert ops.calls < 40 / 2, ops.calls
    assert [e["id"] for e in manifest_entries(tmp_path / "out")] == [s.id for s in samples]
    problems, _ = verify_dataset(tmp_path / "out")
    assert problems == []


@needs_torch
def test_a_failed_group_commit_lists_only_files_in_place_and_commits_nothing_later(tmp_path):
    from speccompat.dataset import WriterFailed, open_dataset, verify_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(24, lo=30, hi=31)))
    out = tmp_path / "out"
    ds = open_dataset(out, samples, provenance(model))
    w = ds.writer(threads=4, ops=SlowFsyncDir(fail_rename=5))
    with pytest.raises(WriterFailed, match="Input/output error"):
        for s in ds.todo:
            w.submit([ds.job(s, states(s))])
        w.close()
    w.close(raise_error=False)
    ds.lock.close()
    kept = manifest_entries(out)
    assert [e["id"] for e in kept] == [s.id for s in samples[:4]]  # the files renamed before the failure
    assert {p.name for p in out.glob("*.safetensors")} == {e["file"] for e in kept}
    assert not list(out.glob("*.partial"))
    problems, _ = verify_dataset(out)
    assert problems == []


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), from ``mincore`` on a mapping that
    touches none of them."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


class OpsLog(FileOps):
    """Records, per file descriptor, the writer's calls on it (drop_cache as the writer makes it)."""

    def __init__(self, keep_cache: bool = False) -> None:
        self.calls: dict[int | str, list[str]] = {}  # by fd while open, by "path#fd" once closed
        self.paths: dict[int, str] = {}
        self.keep_cache = keep_cache
        self.lock = threading.Lock()

    def _log(self, fd, what):
        with self.lock:
            self.calls.setdefault(fd, []).append(what)

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        with self.lock:
            self.calls[fd], self.paths[fd] = [], str(path)
        return fd

    def write(self, fd, buf):
        self._log(fd, "write")
        return os.write(fd, buf)

    def fsync(self, fd):
        self._log(fd, "fsync")
        os.fsync(fd)

    def drop_cache(self, fd):
        self._log(fd, "drop_cache")
        if not self.keep_cache:
            FileOps.drop_cache(fd)

    def close(self, fd):
        self._log(fd, "close")
        with self.lock:
            self.calls[f"{self.paths[fd]}#{fd}"] = self.calls.pop(fd)  # an fd number is reused
        os.close(fd)


def written(tmp_path: Path, hidden: int, ops: FileOps, n: int = 6):
    """``n`` samples of 40 tokens x ``hidden`` written through ``ops``; the data set's directory."""
    import torch

    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path / f"m{hidden}", hidden=hidden)
    samples = scan(jsonl(tmp_path / f"d{hidden}.jsonl", random_records(n, lo=40, hi=41)))
    out = tmp_path / f"out-{type(ops).__name__}-{getattr(ops, 'keep_cache', '')}"
    ds = open_dataset(out, samples, provenance(model))
    w = ds.writer(threads=2, ops=ops)
    g = torch.Generator().manual_seed(0)
    for s in ds.todo:
        w.submit([ds.job(s, [torch.randn(s.num_tokens, hidden, generator=g).to(torch.bfloat16) for _ in LAYERS])])
    stats = w.close()
    ds.lock.close()
    assert stats.files == n
    return out


@needs_torch
def test_each_sample_file_is_dropped_from_the_page_cache_once_it_is_durable(tmp_path):
    ops = OpsLog()
    out = written(tmp_path, HIDDEN, ops)
    files = {k: v for k, v in ops.calls.items() if ".safetensors." in k}
    assert len(files) == 6
    for name, calls in files.items():
        # reserve is not logged; the header and the tensors are written, then fsync, then the drop
        assert calls[-3:] == ["fsync", "drop_cache", "close"], (name, calls)
        assert calls.count("drop_cache") == 1 and set(calls[:-3]) == {"write"}, (name, calls)
    manifest = [c for k, c in ops.calls.items() if k.startswith(str(out / "manifest.jsonl"))]
    assert manifest and all("drop_cache" not in c for c in manifest)  # the manifest is read back at once
    from speccompat.dataset import verify_dataset

    assert verify_dataset(out) == ([], 6)


@needs_torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise as on Linux")
def test_written_sample_files_leave_no_pages_in_the_page_cache(tmp_path):
    # what this file system does with a written, fsync'd file once told its pages are not needed
    probe = tmp_path / "probe.bin"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT)
    os.write(fd, os.urandom(64 * 4096))
    os.fsync(fd)
    cached_after_write = resident_pages(probe)[0]
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if cached_after_write == 0 or resident_pages(probe)[0] > 0:
        pytest.skip(f"the file system of {tmp_path} keeps no written pages or keeps them whatever it is told "
                    "(tmpfs, some network file systems): nothing to drop")
    hidden = 1024  # files of 80 pages and more
    dropped = written(tmp_path, hidden, OpsLog())
    kept = written(tmp_path, hidden, OpsLog(keep_cache=True))  # the control: the pages were there to drop
    for out, expect_cached in ((dropped, False), (kept, True)):
        files = sorted(out.glob("*.safetensors"))
        assert len(files) == 6
        for f in files:
            cached, pages = resident_pages(f)
            assert pages >= 80
            assert (cached > pages // 2) if expect_cached else cached == 0, (f.name, cached, pages)


@needs_torch
def test_a_failing_page_cache_drop_is_no_write_error(tmp_path, monkeypatch):
    from speccompat.dataset import verify_dataset

    calls = []

    def refuse(fd, offset, length, advice):
        calls.append(advice)
        raise OSError(errno.ESPIPE, "Illegal seek")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    monkeypatch.setattr(os, "POSIX_FADV_DONTNEED", 4, raising=False)
    out = written(tmp_path, HIDDEN, FileOps())
    assert len(calls) == 6  # asked for each file; refused; the files are written all the same
    assert verify_dataset(out) == ([], 6)
