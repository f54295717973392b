"""The instruments of ``benchmarks/`` that the speed figures rest on: what the disk probes write,
how a disk pass's phases turn into rates, and the counters of the wake probe and the CPU snapshot.

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

import report  # noqa: E402  (benchmarks/report.py)
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


def test_phase_rates_from_a_pass():
    last = {"bytes": 10e9, "writer_backlog_at_last_step_gb": 2.0, "engine_calls_s": 8.0, "tail_s": 0.5}
    during, alone = report.phase_rates(last)
    assert during == pytest.approx(1.0) and alone == pytest.approx(4.0)
    # a writer that kept up (backlog under 5% of the bytes), a tail that is latency, missing fields
    assert report.phase_rates({**last, "writer_backlog_at_last_step_gb": 0.4}) is None
    assert report.phase_rates({**last, "tail_s": 0.2}) is None
    assert report.phase_rates({k: v for k, v in last.items() if k != "tail_s"}) is None
    assert report.phase_rates({**last, "engine_calls_s": 0}) is None


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
