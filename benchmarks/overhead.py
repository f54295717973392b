#!/usr/bin/env python3
"""Cost of ``import speccompat`` and ``speccompat.apply()``: median over fresh processes.

speccompat is installed (not editable) into a temporary folder, byte code is compiled first (as
pip does), and each measurement runs in a new interpreter that imports only what it measures.
Also reports which modules the two steps import (torch and vLLM must not be among them).

    python benchmarks/overhead.py [--runs 41] [--out results.json]

Run it with the python of an environment that has vLLM and speculators (``apply()`` reads their
versions and the matrix row), e.g. ``.envs/vllm-0.32.0/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write  # benchmarks/_results.py

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
import sys, time, json
before = set(sys.modules)
t0 = time.perf_counter()
import speccompat
t1 = time.perf_counter()
status = speccompat.apply()
t2 = time.perf_counter()
new = sorted(set(sys.modules) - before)
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3, "state": status.state,
                  "adapter": status.adapter, "modules": len(new),
                  "heavy": [m for m in new if m.split(".")[0] in ("torch", "vllm", "transformers", "speculators")]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=41)
    ap.add_argument("--out")
    ap.add_argument("--speculators-path", default="", help="folder holding speculators (mkenv environments)")
    args = ap.parse_args()
    site = Path(tempfile.mkdtemp(prefix="speccompat-overhead-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(REPO)],
                   check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site / "speccompat")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",) and not k.startswith("SPECCOMPAT_")}
    env["SPECCOMPAT_LOG_LEVEL"] = "WARNING"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.path.abspath(args.speculators_path) if args.speculators_path else "") if p)
    samples = []
    for _ in range(args.runs + 1):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=site,
                             check=True).stdout
        samples.append(json.loads(out.strip().splitlines()[-1]))
    samples = samples[1:]  # the first run may still write byte code of the standard library
    doc = {
        "command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "python": sys.version.split()[0],
        "runs": args.runs,
        "import_ms_median": round(statistics.median(s["import_ms"] for s in samples), 2),
        "apply_ms_median": round(statistics.median(s["apply_ms"] for s in samples), 2),
        "total_ms_median": round(statistics.median(s["import_ms"] + s["apply_ms"] for s in samples), 2),
        "total_ms_p90": round(sorted(s["import_ms"] + s["apply_ms"] for s in samples)[int(0.9 * len(samples))], 2),
        "state": samples[-1]["state"],
        "adapter": samples[-1]["adapter"],
        "modules_imported": samples[-1]["modules"],
        "heavy_modules_imported": samples[-1]["heavy"],
    }
    write(doc, args.out)
    return 0 if not doc["heavy_modules_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
