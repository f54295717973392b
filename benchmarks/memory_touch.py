"""How fast this machine hands a process memory it has not used for a while (CPU only, no engine).

A virtual machine may give memory that stays free for a few seconds back to its host (virtio-balloon
free page reporting, as Firecracker guests do); the next time the kernel hands such a page out, the
host has to fault it in again. Every page the page cache takes for a file being written is such a
page unless a page freed a moment ago is reused. This script times the first write into ``--gb`` of
newly allocated memory (``first_touch_gbps``) and a second write into the same memory
(``again_gbps``, no faults), right after the previous allocation was freed and after ``--waits``
seconds of idle memory, in rounds.

    python benchmarks/memory_touch.py --gb 3 --waits 0 5 --rounds 3 --out benchmarks/results/memory-touch-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402


def touch(gb: float) -> tuple[float, float]:
    """(GB/s of the first write into ``gb`` GB of new memory, GB/s of a second write into it)."""
    import numpy as np

    a = np.empty(int(gb * 1e9), dtype=np.uint8)
    t0 = time.perf_counter()
    a.fill(1)
    t1 = time.perf_counter()
    a.fill(2)
    t2 = time.perf_counter()
    del a
    return round(gb / (t1 - t0), 2), round(gb / (t2 - t1), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="memory allocated and written each time")
    ap.add_argument("--waits", type=float, nargs="+", default=[0.0, 5.0],
                    help="seconds the memory stays free before each allocation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gb <= 0 or args.rounds < 1 or any(w < 0 for w in args.waits):
        ap.error("--gb must be positive, --rounds at least 1, --waits not negative")
    touch(args.gb)  # the process's first allocation of this size: not counted
    runs = []
    for r in range(args.rounds):
        for wait in args.waits:
            time.sleep(wait)
            first, again = touch(args.gb)
            runs.append({"round": r, "wait_s": wait, "first_touch_gbps": first, "again_gbps": again})
            print(runs[-1], file=sys.stderr, flush=True)
    summary = {str(w): {k: round(sum(x[k] for x in runs if x["wait_s"] == w) / args.rounds, 2)
                        for k in ("first_touch_gbps", "again_gbps")} for w in args.waits}
    doc = {"benchmark": "memory_touch", "command": " ".join(["python3", *sys.argv]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
           "gb": args.gb, "runs": runs, "by_wait_s": summary}
    write(doc, args.out)


if __name__ == "__main__":
    main()
