"""The instruments of ``benchmarks/`` that the speed figures rest on: what the disk probes write,
and the counters of the wake probe and the CPU snapshot.

Their figures are measured by the benchmarks themselves; here only what would make a figure wrong
without looking wrong: a "fresh" probe that writes repeated blocks, a rate taken from the wrong
fields, a phase that counts another phase's wake-ups."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import throughput  # noqa: E402  (benchmarks/throughput.py)

BLOCK = 4096


def written_blocks(monkeypatch, tmp_path, **kw) -> list[list[bytes]]:
    """The 4 KiB blocks of every file the parallel probe writes (a digest each), file by file."""
    files: list[list[bytes]] = []
    real = os.write

    def write(fd, data):
        view = memoryview(data).cast("B")
        files.append([hashlib.sha256(view[k:k + BLOCK]).digest() for k in range(0, len(view) - BLOCK + 1, BLOCK)])
        return real(fd, data)

    monkeypatch.setattr(throughput, "settle", lambda: None)
    monkeypatch.setattr(throughput.os, "write", write)
    gbps = throughput.disk_parallel_write_gbps(str(tmp_path), kw.pop("threads", 3), kw.pop("file_bytes"),
                                               kw.pop("total"), **kw)
    monkeypatch.undo()
    assert gbps > 0
    assert not list(tmp_path.iterdir())  # the probe removes what it wrote
    return files


def test_fresh_probe_writes_no_block_twice(monkeypatch, tmp_path):
    files = written_blocks(monkeypatch, tmp_path, file_bytes=16 * BLOCK + 100, total=12 * (16 * BLOCK + 100),
                           fresh=True)
    assert len(files) == 12 and all(len(f) == 16 for f in files)
    blocks = [b for f in files for b in f]
    assert len(set(blocks)) == len(blocks) == 12 * 16


def test_plain_probe_writes_one_buffer_into_every_file(monkeypatch, tmp_path):
    files = written_blocks(monkeypatch, tmp_path, file_bytes=16 * BLOCK, total=9 * 16 * BLOCK)
    assert len(files) == 9
    assert all(f == files[0] for f in files) and len(set(files[0])) == 16


def test_wake_probe_phases_split_the_wakes():
    probe = throughput.WakeProbe()
    try:
        time.sleep(0.05)
        first = probe.phase()
        time.sleep(0.05)
        second = probe.phase()
    finally:
        probe.close()
    rest = probe.phase()  # the wake-ups after the second phase, up to close()
    assert first["wakes"] > 0 and second["wakes"] > 0
    assert first["wakes"] + second["wakes"] + rest.get("wakes", 0) == len(probe.late)  # each counted once
    for phase in (first, second):
        assert 0 <= phase["p50_ms"] <= phase["p90_ms"] <= phase["p99_ms"]
        assert 0 <= phase["over_2ms"] <= 1
    assert probe.phase() == {}  # nothing new after close()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")
def test_cpu_snapshot_counts_the_writer_threads():
    import threading

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    before = throughput.cpu_snapshot(prefix="bench-test-spin")
    t = threading.Thread(target=spin, name="bench-test-spin-0")
    t.start()
    try:
        time.sleep(0.3)
        after = throughput.cpu_snapshot(prefix="bench-test-spin")
    finally:
        stop.set()
        t.join()
    phase = throughput.cpu_phase(before, after)
    assert phase["writer_cpu_s"] > 0  # the spinning thread, and only it, is counted
    assert 0 < phase["host_busy"] <= 1 and 0 <= phase["host_iowait"] <= 1
    assert throughput.cpu_phase({}, after) == {}


@pytest.mark.parametrize("drop", [False, True])
def test_probe_drops_each_file_from_the_page_cache_after_its_fsync_when_asked(monkeypatch, tmp_path, drop):
    events: list[tuple[str, int]] = []
    real_fsync = os.fsync
    monkeypatch.setattr(throughput, "settle", lambda: None)
    monkeypatch.setattr(throughput.os, "fsync", lambda fd: (events.append(("fsync", fd)), real_fsync(fd))[1])
    monkeypatch.setattr(throughput.os, "posix_fadvise",
                        lambda fd, off, n, advice: events.append(("drop", fd)) if advice == 4 else None, raising=False)
    monkeypatch.setattr(throughput.os, "POSIX_FADV_DONTNEED", 4, raising=False)
    throughput.disk_parallel_write_gbps(str(tmp_path), 1, 3 * BLOCK, 5 * 3 * BLOCK, drop_cache=drop)
    monkeypatch.undo()
    fsyncs = [fd for what, fd in events if what == "fsync"]
    assert len(fsyncs) == 5
    # with drop_cache: each fsync is followed by the drop of the same file, before the next file
    assert events == ([e for fd in fsyncs for e in (("fsync", fd), ("drop", fd))] if drop else
                      [("fsync", fd) for fd in fsyncs])


def test_ratios_name_each_page_cache_setting_against_plain_prefill():
    import argparse

    args = argparse.Namespace(model_path="/nonexistent", model="llama", set=[], min_len=1, max_len=2, warm_up="first")
    seqs = [[1, 2]] * 4

    def run(name, tps, cache=None, after=None):
        return {"workload": name, "tokens_per_s": tps, **({"page_cache": cache} if cache else {}),
                **({"disk_parallel_after_gbps": after} if after else {})}

    results = {"plain": {"workloads": [run("main", 100.0)]},
               "driver-stream-disk": {"workloads": [
                   run("main", 95.0, "drop"), run("main, keep-cache", 80.0, "keep"),
                   run("main, batch=8, keep-cache", 70.0, "keep"), run("main, batch=8", 91.0, "drop")]}}
    ratios = throughput.document(args, seqs, [{"name": "main"}], results)["ratios"]["main"]
    assert ratios["driver-stream-disk/plain"] == 0.95
    assert ratios["driver-stream-disk, keep-cache/plain"] == 0.8
    assert ratios["driver-stream-disk batch=8/plain"] == 0.91
    assert ratios["driver-stream-disk batch=8, keep-cache/plain"] == 0.7


def test_fp8_driver_modes_are_compared_with_plain_prefill_and_the_bf16_driver():
    """throughput.py's fp8 driver modes: each run against plain prefill and against the bf16 driver's
    run of the same name (same batch size, same destination)."""
    import argparse

    args = argparse.Namespace(model_path="/nonexistent", model="llama", set=[], min_len=1, max_len=2, warm_up="first",
                              fp8_scale="token", driver_format="safetensors")

    def run(name, tps):
        return {"workload": name, "tokens_per_s": tps}

    results = {"plain": {"workloads": [run("main", 100.0)]},
               "driver-stream": {"workloads": [run("main", 96.0), run("main, batch=128", 94.0)]},
               "driver-stream-fp8": {"workloads": [run("main", 93.0), run("main, batch=128", 90.0)]},
               "driver-stream-disk": {"workloads": [run("main", 80.0), run("main, batch=128", 79.0)]},
               "driver-stream-fp8-disk": {"workloads": [run("main", 88.0), run("main, batch=128", 87.0)]}}
    doc = throughput.document(args, [[1, 2]] * 4, [{"name": "main"}], results)
    ratios = doc["ratios"]["main"]
    assert ratios["driver-stream-fp8/plain"] == 0.93
    assert ratios["driver-stream-fp8 batch=128/plain"] == 0.9
    assert ratios["driver-stream-fp8/driver-stream"] == 0.969
    assert ratios["driver-stream-fp8 batch=128/driver-stream batch=128"] == round(90 / 94, 3)
    assert ratios["driver-stream-fp8-disk batch=128/driver-stream-disk batch=128"] == round(87 / 79, 3)
    assert ratios["driver-stream-fp8-disk/driver-stream-disk"] == 1.1
    assert doc["fp8_scale"] == "token"
