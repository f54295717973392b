"""How fast speccompat.dataset's writer puts samples on disk, against the disk itself (CPU only).

Writes ``--samples`` fake samples of ``--tokens`` x ``--hidden`` x ``--layers`` (bf16) into a
directory, in batches, through :class:`speccompat.dataset.writer.DatasetWriter` (header + raw
buffers, checksums on the writer threads, fsyncs and renames grouped per batch) for each
``--threads`` value, and compares it, in the same run and directory, with:

- ``dd``: one fsync'd sequential write of the same number of bytes in 8 MiB blocks (what the disk does);
- ``serial``: the former driver's path, per sample ``safetensors.torch.save`` (a ``bytes`` copy),
  sha256, write, fsync, rename and a directory fsync, on the caller's thread;
- ``--parallel-probe``: the disk's rate for the writer's own pattern, as fio would measure it (the
  largest ``--threads`` value of threads, each writing whole files of the sample size and fsync'ing
  each; ``benchmarks/throughput.py``'s ``disk_parallel_write_gbps``).

``--variants`` measure the writer's parts apart, each variant switching one of them off (what a
variant leaves out is not durable or not checked: these are measurements, never a mode of the
writer): ``no-reserve`` (no ``posix_fallocate`` before the write), ``no-checksum``, ``no-commit-sync``
(the commit's manifest and directory fsyncs skipped; every file still fsync'd), ``bare`` (all
three), ``keep-cache`` (each file's pages left in the page cache after its fsync, as the writer did
before it dropped them). ``writeback`` adds instead of removing: after each write the file's new range is handed to
the disk at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux), so the fsync that follows
waits for less. With ``--rounds R`` every variant runs R times, interleaved with the parallel probe
(``--parallel-probe``), so that each is compared with the disk as it was that minute; the variants'
order reverses from one round to the next.

``--fresh-probe``: the parallel probe again in each round, with fresh data in every file (the
plain probe writes one random buffer into every file; the writer's files all differ).

``--batch 1`` is how the streaming driver submits (one sample per batch). ``writer_sha256`` names the
writer code that ran (``speccompat/dataset/writer.py`` as imported), so that runs of two versions of
it, one after the other on the same disk, can be told apart.

``caller_wait_s`` is how long ``submit`` blocked the caller (the engine loop) on the in-flight
budget; the data are generated before the clock starts.

``--no-serial`` leaves the serial path out.

    python benchmarks/writer.py --dir /data/bench --samples 64 --tokens 2048 --hidden 7168 --layers 4 \
        --out benchmarks/results/writer-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402
from throughput import disk_parallel_write_gbps, disk_write_seconds, settle  # noqa: E402  (benchmarks/throughput.py)


def fake(args, torch):
    from speccompat.dataset.inputs import Sample

    g = torch.Generator().manual_seed(0)
    samples, states = [], []
    for i in range(args.samples):
        ids = array("q", [4 + (i + k) % 500 for k in range(args.tokens)])
        samples.append(Sample(f"s{i:05d}", i + 1, ids, array("b", [1] * args.tokens)))
        states.append([torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(args.layers)])
    return samples, states


def provenance(args):
    from speccompat.dataset.provenance import LAYER_MEANING

    return {"model": {"path": "bench", "hidden_size": args.hidden}, "versions": {},
            "hidden_states": {"layer_ids": list(range(args.layers)), "meaning": LAYER_MEANING, "dtype": "bfloat16"},
            "max_seq_len": args.tokens, "layout": "safetensors", "created": "bench"}


#: What each variant switches off (``writeback`` switches nothing off; it adds an early writeback).
VARIANTS: dict[str, frozenset[str]] = {
    "writer": frozenset(), "no-reserve": frozenset({"reserve"}), "no-checksum": frozenset({"checksum"}),
    "no-commit-sync": frozenset({"commit-sync"}), "bare": frozenset({"reserve", "checksum", "commit-sync"}),
    "writeback": frozenset(), "keep-cache": frozenset({"drop-cache"}),
}


def _sync_file_range():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, n: fn(fd, offset, n, 2)  # SYNC_FILE_RANGE_WRITE


def variant_ops(variant: str, manifest_path: Path):
    """The writer's file operations for ``variant`` (see the module's docstring). Every variant, the
    writer as it is included, goes through this one subclass, so that they differ only in what they
    switch off or add."""
    from speccompat.dataset.fsutil import FileOps

    off = VARIANTS[variant]
    start_writeback = _sync_file_range() if variant == "writeback" else None

    class Ops(FileOps):
        manifest_fds: set[int] = set()

        @staticmethod
        def write(fd, buf):
            n = os.write(fd, buf)
            if start_writeback is not None:
                start_writeback(fd, os.lseek(fd, 0, os.SEEK_CUR) - n, n)
            return n

        @staticmethod
        def open(path, flags, mode=0o777):
            fd = os.open(path, flags, mode)
            if str(path) == str(manifest_path):
                Ops.manifest_fds.add(fd)
            return fd

        @staticmethod
        def close(fd):
            Ops.manifest_fds.discard(fd)
            os.close(fd)

        @staticmethod
        def fsync(fd):
            if not ("commit-sync" in off and fd in Ops.manifest_fds):
                os.fsync(fd)

        @staticmethod
        def fsync_dir(path):
            if "commit-sync" not in off:
                FileOps.fsync_dir(path)

        @staticmethod
        def reserve(fd, size):
            if "reserve" not in off:
                FileOps.reserve(fd, size)

        @staticmethod
        def drop_cache(fd):
            if "drop-cache" not in off:
                FileOps.drop_cache(fd)

    return Ops()


def run_writer(args, root: Path, samples, states, threads: int, checksum: str, variant: str = "writer") -> dict:
    from speccompat.dataset.manifest import Manifest
    from speccompat.dataset.store import open_dataset

    out = root / f"writer-{threads}-{checksum}-{variant}"
    ds = open_dataset(out, samples, provenance(args))
    ds.manifest.header["checksum"] = checksum
    w = ds.writer(threads=threads, max_in_flight_bytes=int(args.max_in_flight_gb * 1e9),
                  ops=variant_ops(variant, ds.manifest.path))
    if "checksum" in VARIANTS[variant]:
        w.digest = lambda buf: "0"
    t0 = time.perf_counter()
    for k in range(0, len(samples), args.batch):
        w.submit([ds.job(s, list(h)) for s, h in zip(samples[k:k + args.batch], states[k:k + args.batch], strict=True)])
    submitted = time.perf_counter() - t0
    stats = w.close()
    s = time.perf_counter() - t0
    ds.lock.close()
    assert len(Manifest(out).load().entries) == len(samples)
    shutil.rmtree(out)
    settled = settle()
    return {"variant": variant, "threads": threads, "checksum": checksum, "s": round(s, 3),
            "gb_per_s": round(stats.bytes / s / 1e9, 3),
            "caller_wait_s": round(stats.waited_s, 3), "caller_submit_s": round(submitted, 3),
            "bytes": stats.bytes, "cleanup_sync_s": settled}


def run_serial(args, root: Path, samples, states, torch) -> dict:
    from safetensors.torch import save

    out = root / "serial"
    out.mkdir()
    t0 = time.perf_counter()
    total = 0
    for s, h in zip(samples, states, strict=True):
        tensors = {"input_ids": torch.tensor(s.input_ids, dtype=torch.int64),
                   **{f"hidden_states_{i}": x for i, x in enumerate(h)}}
        data = save(tensors, metadata={"sample": json.dumps({"id": s.id})})
        hashlib.sha256(data).hexdigest()
        tmp = out / f"{s.id}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out / f"{s.id}.safetensors")
        dfd = os.open(out, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        total += len(data)
    s = time.perf_counter() - t0
    shutil.rmtree(out)
    settle()
    return {"s": round(s, 3), "gb_per_s": round(total / s / 1e9, 3), "bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="samples per submitted batch")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--checksums", nargs="+", default=["xxh3_64", "crc32"],
                    help="'default': the data set's default here (xxh3_64 with xxhash installed, else crc32)")
    ap.add_argument("--parallel-probe", action="store_true", help="also measure the disk for the writer's pattern")
    ap.add_argument("--no-serial", action="store_true", help="leave out the former driver's serial path")
    ap.add_argument("--fresh-probe", action="store_true", help="also the parallel probe with fresh data in "
                    "every file (throughput.py's disk_parallel_write_gbps(fresh=True)), after it in each round")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["writer"],
                    help="the writer as it is, or with one of its parts switched off (a measurement only)")
    ap.add_argument("--rounds", type=int, default=1, help="run every variant this many times, each round "
                    "beside its own parallel probe")
    ap.add_argument("--max-in-flight-gb", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import speccompat.dataset.writer as writer_module
    from speccompat.dataset.checksum import default_algorithm

    args.checksums = [default_algorithm() if c == "default" else c for c in args.checksums]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="writer-bench-", dir=args.dir))
    try:
        samples, states = fake(args, torch)
        nbytes = sum(sum(x.numel() * 2 for x in h) for h in states)
        dd_s = disk_write_seconds(root / "dd.bin", nbytes, 8 << 20)
        serial = None if args.no_serial else run_serial(args, root, samples, states, torch)
        writer, probes, fresh = [], [], []
        for r in range(args.rounds):
            order = args.variants if r % 2 == 0 else args.variants[::-1]  # no variant always first after the probe
            runs = [{**run_writer(args, root, samples, states, t, c, v), "round": r}
                    for v in order for c in args.checksums for t in args.threads]
            if args.parallel_probe:
                probes.append(disk_parallel_write_gbps(str(root), max(args.threads), nbytes // len(samples), nbytes))
                runs = [{**w, "of_parallel_probe": round(w["gb_per_s"] / probes[-1], 3)} for w in runs]
            if args.fresh_probe:  # the same with fresh data in every file, as the writer's
                fresh.append(disk_parallel_write_gbps(str(root), max(args.threads), nbytes // len(samples), nbytes,
                                                      fresh=True))
                runs = [{**w, "of_parallel_fresh_probe": round(w["gb_per_s"] / fresh[-1], 3)} for w in runs]
            writer += runs
        probe = round(sum(probes) / len(probes), 3) if probes else None
        dd_s2 = disk_write_seconds(root / "dd.bin", nbytes, 8 << 20)  # again: the disk's speed may drift during the run
    finally:
        shutil.rmtree(root, ignore_errors=True)
    dd_rate = nbytes / ((dd_s + dd_s2) / 2) / 1e9
    doc = {
        "benchmark": "writer",
        "command": " ".join(["python3", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "dir": str(args.dir or tempfile.gettempdir()),
        "shape": {"samples": args.samples, "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
                  "dtype": "bfloat16", "batch": args.batch, "gb": round(nbytes / 1e9, 3)},
        "writer_sha256": hashlib.sha256(Path(writer_module.__file__).read_bytes()).hexdigest(),
        "dd_gb_per_s": round(dd_rate, 3),
        **({"parallel_probe": {"gb_per_s": probe, "threads": max(args.threads), "rounds": probes}} if probe else {}),
        **({"parallel_fresh_probe": {"gb_per_s": round(sum(fresh) / len(fresh), 3), "threads": max(args.threads),
                                     "rounds": fresh}} if fresh else {}),
        **({"serial": {**serial, "of_dd": round(serial["gb_per_s"] / dd_rate, 2)}} if serial else {}),
        "writer": [{**w, "of_dd": round(w["gb_per_s"] / dd_rate, 2)} for w in writer],
    }
    write(doc, args.out)


if __name__ == "__main__":
    main()
