#!/usr/bin/env python3
"""Nightly canary: does the installed vLLM (typically a nightly) still work with speccompat?

Runs, in the current environment (vLLM + speculators installed, speccompat installed):
  1. ``speccompat doctor --json --import`` (versions, live fingerprint probe of every adapter, patches);
  2. the real-engine parity tests for Llama (both speculators lines), or ``--tests`` given;
and, when everything passed, records the vLLM build as the last known good one:

    python scripts/canary.py --speculators-path DIR --record canary/last-known-good.json

Downstream training repos pin that build (its ``install`` line) when the newest nightly fails.
Exit status: 0 passed (and recorded), 1 failed (nothing recorded), 2 usage error.

The canary follows nightlies (builds of vLLM's main branch, from vLLM's own index); released
versions on the package index are followed by the release watch, ``python -m speccompat.matrix
--watch`` (docs/release-watch.md). Both name the distributions that provide ``vllm`` from
``speccompat.detect.VLLM_DISTRIBUTIONS``, and the canary says when its build's release is one the
matrix does not know yet.
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
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))


def vllm_build() -> dict:
    """``{dist, version, commit}`` of the installed vLLM ({} when none): the distribution and version
    as speccompat detects them (package metadata), the commit from ``vllm._version``."""
    from speccompat.detect import detect_vllm

    found = detect_vllm()
    if not found.present:
        return {}
    code = (
        "import json\n"
        "try:\n"
        "    from vllm import _version; print(json.dumps(getattr(_version, '__commit_id__', None) or getattr(_version, 'commit_id', None)))\n"
        "except Exception: print('null')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    commit = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
    return {"dist": found.dist, "version": found.raw, "commit": commit}


def matrix_note(version: str) -> str | None:
    """What the canary says when the build's release is not one compat_matrix.yaml knows yet."""
    from packaging.version import InvalidVersion, Version

    from speccompat.matrix import known_releases

    try:
        release = Version(version).base_version
    except InvalidVersion:
        return None
    known = known_releases(str(REPO / "compat_matrix.yaml"))
    if release in known:
        return None
    return (f"canary: vLLM {release} (this build's release) is not in compat_matrix.yaml yet; once it is on the "
            "package index, `python -m speccompat.matrix --watch` checks it statically")


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
    note = matrix_note(build["version"])
    if note:
        print(note)
    # --import: the live check (speculators imported, patches applied), whose state and probe follow
    doctor = subprocess.run([sys.executable, "-m", "speccompat", "doctor", "--json", "--import"], capture_output=True,
                            text=True, env=env)
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
