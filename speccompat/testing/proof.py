"""A release's GPU proof in one call: its tests split into shards that run side by side, then one
evidence file.

Engine starts dominate a proof (60-117 s each on vLLM 0.34.0 with CUDA; a test's extraction takes
under a second), so the tests are grouped by the engine they share (the engine pool's key,
``tests/engine/conftest.py``) and every group runs whole in one shard: no engine starts twice.
:func:`partition` gives each shard about the same number of engine starts (longest first, each to
the least loaded shard); ``pytest --proof --shard K/N`` runs shard K (``tests/conftest.py``), and
``scripts/gpu/device_run.sh proof`` runs the N shards side by side and merges what they wrote:

    python -m speccompat.testing.proof merge --out DIR --wall SECONDS SHARD_DIR

:func:`merge` joins the shards' evidence files (one end-to-end file and one architectures file, each
with ``proof_wall_s``, every test's seconds and outcome, and every engine start with its seconds and
the tests that used it). Shards must have run the same code on the same release, or nothing is
written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["merge", "partition"]


def partition(groups: Iterable[tuple[Hashable, float]], shards: int) -> dict[Hashable, int]:
    """Shard index (0-based) of each group, ``(key, cost)``: the costliest first, each to the shard
    with the least cost so far (ties: the lower index; groups of equal cost in key order, so that
    every shard's process computes the same split)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    load = [0.0] * shards
    out: dict[Hashable, int] = {}
    for key, cost in sorted(groups, key=lambda kc: (-kc[1], repr(kc[0]))):
        if key in out:
            raise ValueError(f"group {key!r} given twice")
        k = min(range(shards), key=lambda i: (load[i], i))
        out[key] = k
        load[k] += cost
    return out


#: What every shard of one proof must agree on (else they did not run the same proof).
SAME = ("vllm", "vllm_dist", "torch", "device", "tp", "runner", "applied")


def _join(docs: list[dict[str, Any]], what: str) -> dict[str, Any]:
    first = docs[0]
    for key in (*SAME, "code"):
        values = {json.dumps(d.get(key), sort_keys=True) for d in docs if key in d}
        if len(values) > 1:
            raise ValueError(f"the shards' {what} files disagree on {key}: {sorted(values)}")
    cells = [c for d in docs for c in d["cells"]]
    return {**first, "date": max(d["date"] for d in docs), "cells": cells}


def merge(shard_dir: str | Path, out: str | Path, wall_s: float) -> list[Path]:
    """Join the shards' files under ``shard_dir`` (``evidence-K.json``, ``architectures-K.json``,
    ``times-K.json``, ``starts-K.json``) into ``out``/``vllm-V-tpT-R-proof.json`` and
    ``out``/``architectures-vllm-V.json``. Returns the files written."""
    shard_dir, out = Path(shard_dir), Path(out)

    def read(pattern: str) -> list[dict[str, Any]]:
        return [json.loads(f.read_text()) for f in sorted(shard_dir.glob(pattern))]

    times: dict[str, Any] = {}
    for t in read("times-*.json"):
        times.update(t)
    starts = [s for doc in read("starts-*.json") for s in doc]
    proof = {"proof_wall_s": round(wall_s, 1), "shards": len(read("times-*.json")),
             "tests": dict(sorted(times.items())), "engine_starts": starts}
    written = []
    evidence = read("evidence-*.json")
    if evidence:
        doc = {**_join(evidence, "evidence"), **proof}
        path = out / f"vllm-{doc['vllm']}-tp{doc['tp']}-{_runner(doc)}-proof.json"
        written.append(_write(path, doc))
    arch = read("architectures-*.json")
    if arch:
        doc = {**_join(arch, "architectures"), **proof}
        written.append(_write(out / f"architectures-vllm-{doc['vllm']}.json", doc))
    if not written:
        raise ValueError(f"{shard_dir}: no shard wrote evidence")
    return written


def _runner(doc: dict[str, Any]) -> str:
    return "v2" if doc.get("runner") in (None, "default") else str(doc["runner"])


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speccompat.testing.proof", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="join the shards' evidence files")
    m.add_argument("shard_dir")
    m.add_argument("--out", required=True)
    m.add_argument("--wall", type=float, required=True, help="the whole proof's wall time, seconds")
    args = ap.parse_args(argv)
    try:
        written = merge(args.shard_dir, args.out, args.wall)
    except (OSError, ValueError) as exc:
        print(f"speccompat.testing.proof: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
