"""``speccompat verify DIR``: check a finished data set offline, one line per problem.

Checks: the manifest's header and lines; every entry's file is there, with the recorded size,
tensor names, dtypes, shapes and checksums; shapes agree with the provenance (layer ids, hidden
size, the entry's token count); the input ids and loss mask hash to the entry's ``input_sha256``;
hidden states are finite; every file's provenance (safetensors metadata) equals the manifest's;
ids are unique; no file is in the directory that the manifest does not list (temporary files
included). Exit status 0 when nothing is wrong, 1 otherwise, 2 when DIR is not a data set.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import provenance as prov_mod
from .checksum import digest_fn
from .formats import DTYPES, layout_named
from .fsutil import LOCK_NAME
from .inputs import input_digest
from .manifest import MANIFEST_NAME, Manifest

__all__ = ["add_parser", "main", "verify_dataset"]


def _frombuffer(buf: memoryview, dtype: Any) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():  # read-only mmap: the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype)


def _check_entry(out_dir: Path, entry: dict[str, Any], layout: Any, digest: Any, prov: dict[str, Any],
                 prov_sha: str) -> list[str]:
    import torch

    name = entry["file"]
    path = out_dir / name
    p: list[str] = []
    if not path.is_file():
        return [f"{name}: missing (id {entry['id']!r})"]
    size = path.stat().st_size
    if size != entry.get("bytes"):
        p.append(f"{name}: {size} bytes, the manifest says {entry.get('bytes')}")
    try:
        meta, tensors, _keep = layout.read(path)
    except (OSError, ValueError) as exc:
        return [*p, f"{name}: unreadable: {exc}"]
    want = entry.get("tensors") or {}
    layer_ids = prov["hidden_states"]["layer_ids"]
    hidden = prov["model"]["hidden_size"]
    n = entry.get("num_tokens")
    st_dtype = DTYPES[prov["hidden_states"]["dtype"]][1]
    expected = layout.expected_tensors(n, layer_ids, hidden, "loss_mask" in want or "loss_mask" in tensors)
    if set(tensors) != set(expected):
        p.append(f"{name}: tensors {sorted(tensors)}, expected {sorted(expected)}")
    for t, (dtype, shape, buf) in sorted(tensors.items()):
        if t in expected and shape != expected[t]:
            p.append(f"{name}: {t} has shape {shape}, expected {expected[t]}")
        if t.startswith("hidden_states") and dtype != st_dtype:
            p.append(f"{name}: {t} is {dtype}, the data set stores {st_dtype}")
        w = want.get(t)
        if w is None:
            p.append(f"{name}: tensor {t} is not in the manifest")
            continue
        if [dtype, shape] != [w["dtype"], w["shape"]]:
            p.append(f"{name}: {t} is {dtype} {shape}, the manifest says {w['dtype']} {w['shape']}")
        elif digest(buf) != w["checksum"]:
            p.append(f"{name}: {t} checksum differs from the manifest")
        if t.startswith("hidden_states") and dtype in ("BF16", "F16", "F32") and len(buf):
            x = _frombuffer(buf, {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype])
            if not bool(torch.isfinite(x).all()):
                p.append(f"{name}: {t} has {int((~torch.isfinite(x)).sum())} non-finite values")
    for t in set(want) - set(tensors):
        p.append(f"{name}: tensor {t} of the manifest is missing from the file")
    if "input_ids" in tensors and entry.get("input_sha256"):
        ids = _frombuffer(tensors["input_ids"][2], torch.int64).tolist() if len(tensors["input_ids"][2]) else []
        mask = None
        if "loss_mask" in tensors:  # safetensors: when the input had one; other layouts: always (ones)
            mask = _frombuffer(tensors["loss_mask"][2], torch.int64).tolist()
        if input_digest(ids, mask) != entry["input_sha256"] and not (
                layout.name != "safetensors" and input_digest(ids, None) == entry["input_sha256"]
                and set(mask or []) <= {1}):
            p.append(f"{name}: input_ids/loss_mask do not hash to the manifest's input_sha256")
    if layout.suffix == ".safetensors":
        raw = meta.get("speccompat_provenance")
        if raw is None:
            p.append(f"{name}: no provenance in its metadata")
        else:
            try:
                fprov = json.loads(raw)
            except ValueError:
                p.append(f"{name}: provenance metadata is not JSON")
            else:
                if prov_mod.digest(fprov) != prov_sha:
                    diffs = prov_mod.differences(prov, fprov)
                    p.append(f"{name}: provenance differs from the manifest's: " + "; ".join(diffs[:3]))
        sample = json.loads(meta.get("speccompat_sample", "{}") or "{}")
        if sample.get("id") != entry["id"]:
            p.append(f"{name}: its metadata names id {sample.get('id')!r}, the manifest {entry['id']!r}")
    return p


def verify_dataset(out_dir: Path, threads: int = 4) -> tuple[list[str], int]:
    """(problems, number of entries checked)."""
    out_dir = Path(out_dir)
    m = Manifest(out_dir).load()
    problems = list(m.problems)
    if m.header is None:
        return [*problems, f"{m.path}: no manifest header: not a speccompat data set"], 0
    prov = m.provenance or {}
    layout = layout_named(m.header.get("layout", "safetensors"), prov.get("hidden_states", {}).get("layer_ids"))
    digest = digest_fn(m.header.get("checksum", "crc32"))
    prov_sha = m.header.get("provenance_sha256") or prov_mod.digest(prov)
    if prov_mod.digest(prov) != prov_sha:
        problems.append(f"{MANIFEST_NAME}: provenance_sha256 does not match its provenance")
    ids = Counter(e["id"] for e in m.entries.values())
    problems += [f"{MANIFEST_NAME}: id {i!r} has {c} entries" for i, c in ids.items() if c > 1]
    entries = list(m.entries.values())
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for res in pool.map(lambda e: _check_entry(out_dir, e, layout, digest, prov, prov_sha), entries):
            problems += res
    known = {MANIFEST_NAME, LOCK_NAME, *m.entries, *layout.side_files}
    if hasattr(layout, "check_view"):  # a layout's derived files (speculators-arrow: the trainer's view)
        view_problems, view_names = layout.check_view(out_dir, m)
        problems += view_problems
        known |= view_names
    for p in sorted(out_dir.iterdir()):
        if p.name not in known:
            kind = "temporary file of an interrupted run" if p.name.endswith(".partial") else "not in the manifest"
            if p.name.startswith("manifest.shard-"):
                kind = f"a manifest part not merged: run `speccompat merge {out_dir}`"
            problems.append(f"{p.name}: extra file ({kind})")
    return problems, len(entries)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    v = sub.add_parser("verify", help="check a data set written by speccompat.dataset offline "
                       "(exit 0 intact, 1 problems found, 2 not a data set)")
    v.add_argument("dir", type=Path, help="the data set's directory (holds manifest.jsonl)")
    v.add_argument("--threads", type=int, default=4, help="files checked in parallel")
    return v


def main(args: argparse.Namespace) -> int:
    out_dir: Path = args.dir
    if not out_dir.is_dir() or not (out_dir / MANIFEST_NAME).is_file():
        from .shards import find_parts

        parts = find_parts(out_dir) if out_dir.is_dir() else []
        hint = f"; it holds {len(parts)} manifest part(s): run `speccompat merge {out_dir}`" if parts else ""
        print(f"{out_dir}: not a data set directory (no {MANIFEST_NAME}){hint}", file=sys.stderr)
        return 2
    problems, n = verify_dataset(out_dir, args.threads)
    for line in problems:
        print(f"{out_dir}/{line}" if not line.startswith(str(out_dir)) else line)
    print(f"verify {out_dir}: {n} entries, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0
