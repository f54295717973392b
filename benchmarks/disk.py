"""How the disk's rate depends on how much is written at once (CPU only, no engine).

``benchmarks/throughput.py`` anchors its ``-disk`` modes on two probes of the output disk: ``dd``
(one fsync'd sequential stream) and the parallel probe (``--threads`` threads writing whole files
of the driver's sample size, each fsync'd, as fio would). Both write at most 4 GiB, while one
driver pass of the 8B workload writes about 17 GB. A disk that is fast for a burst and slower for a
sustained write (a cloud volume's burst allowance, an SSD's write cache, the kernel's dirty-page
limits) would make the probe an anchor the driver cannot reach. This script measures both probes
at every ``--volumes`` value, interleaved over ``--rounds`` rounds so that each volume sees the
disk as it was that minute, with a ``sync()`` after each deletion (throughput.py's ``settle``).

The parallel probe writes one random buffer into every file; the driver's files all differ. With
``--fresh`` each round also runs the probe with fresh data (every 4 KiB block written differs from
every other, ``parallel_fresh_gbps``), which tells whether the disk writes repeated data faster.
With ``--drop-cache`` each round also runs it with each file's pages dropped from the page cache
after its fsync, as the writer does (``parallel_drop_cache_gbps``). The parallel probes of a round
run in an order that rotates from one round to the next.

    python benchmarks/disk.py --dir /data/bench --file-mb 16.5 --threads 16 --volumes 4 17 \
        --rounds 3 --out benchmarks/results/disk-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402
from throughput import disk_parallel_write_gbps, disk_write_gbps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="a directory on the disk")
    ap.add_argument("--file-mb", type=float, default=16.5, help="the parallel probe's file size (the driver's "
                    "sample size; the 8B workload's is 16.5 MB)")
    ap.add_argument("--threads", type=int, default=16, help="the parallel probe's threads (the driver's writer threads)")
    ap.add_argument("--volumes", type=float, nargs="+", default=[4.0, 17.0], help="GB written by each probe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="also run the parallel probe with fresh data in every file")
    ap.add_argument("--drop-cache", action="store_true", help="also run the parallel probe with each file's pages "
                    "dropped from the page cache after its fsync (as the writer does)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if any(v <= 0 for v in args.volumes) or args.file_mb <= 0 or args.threads < 1 or args.rounds < 1:
        ap.error("--volumes and --file-mb must be positive, --threads and --rounds at least 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    free = os.statvfs(args.dir)
    if free.f_bavail * free.f_frsize < max(args.volumes) * 1e9 * 1.1:
        ap.error(f"{args.dir} has {free.f_bavail * free.f_frsize / 1e9:.1f} GB free; the largest volume "
                 f"needs {max(args.volumes) * 1.1:.1f} GB")
    file_bytes = int(args.file_mb * 1e6)
    # the parallel probes of a round: (result key, fresh data, pages dropped)
    kinds = [("parallel_gbps", False, False), *([("parallel_fresh_gbps", True, False)] if args.fresh else []),
             *([("parallel_drop_cache_gbps", False, True)] if args.drop_cache else [])]
    rounds = []
    for r in range(args.rounds):
        for gb in args.volumes:
            total = int(gb * 1e9)
            t0 = time.perf_counter()
            probes = {}
            for key, fresh, drop in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # no kind always first
                probes[key] = disk_parallel_write_gbps(str(args.dir), args.threads, file_bytes, total, fresh=fresh,
                                                       drop_cache=drop)
            dd = disk_write_gbps(str(args.dir), total=total)
            rounds.append({"round": r, "gb": gb, **probes, "dd_gbps": dd,
                           "s": round(time.perf_counter() - t0, 1)})
            print(rounds[-1], file=sys.stderr, flush=True)
    summary = {}
    for gb in args.volumes:
        mine = [x for x in rounds if x["gb"] == gb]
        summary[str(gb)] = {k: {"mean": round(sum(x[k] for x in mine) / len(mine), 3),
                                "min": min(x[k] for x in mine), "max": max(x[k] for x in mine)}
                            for k in (*(key for key, _, _ in kinds), "dd_gbps")}
    doc = {"benchmark": "disk", "command": " ".join(["python3", *sys.argv]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "dir": str(args.dir),
           "file_bytes": file_bytes, "threads": args.threads, "rounds": rounds, "by_volume_gb": summary}
    write(doc, args.out)


if __name__ == "__main__":
    main()
