"""What identifying a checkpoint by its content costs (speccompat.dataset.provenance), CPU only.

Writes one synthetic safetensors file of ``--tensors`` tensors and ``--gib`` GiB (random bytes),
then times, on the same file:

- ``full``: SHA-256 of every byte (what a full content hash costs);
- ``sampled``: :func:`speccompat.dataset.provenance.weights_identity` (the header plus the first,
  middle and last 4 KiB of every tensor), the identity data sets store.

Both are timed with the file in the page cache (the best case; a cold read adds the disk's
sequential rate for ``full`` and its random-read rate for ``sampled``: ~3 reads per tensor).
The extrapolation to a Kimi-K2.5-sized checkpoint uses ``--target-gb`` bytes and ``--target-tensors``
tensors (default: ~600 GB; 61 layers, 60 of them MoE with 384 experts x 3 projections x 3 tensors
(int4 weight, scale, shape) ~ 207k tensors, plus attention, shared experts and vision: 210k).

    python benchmarks/model_identity.py --dir /tmp/bench --gib 1 --tensors 20000 \
        --out benchmarks/results/model-identity-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402

from speccompat.dataset.provenance import IDENTITY_METHOD, weights_identity  # noqa: E402
from speccompat.dataset.provenance import _sha256_file as sha256_full  # noqa: E402


def make_file(path: Path, nbytes: int, tensors: int) -> None:
    per = nbytes // tensors // 2 * 2
    header = {f"t{i}": {"dtype": "BF16", "shape": [per // 2], "data_offsets": [i * per, (i + 1) * per]}
              for i in range(tensors)}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        left = per * tensors
        chunk = os.urandom(8 << 20)
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the synthetic file goes (default: a temp dir)")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--target-gb", type=float, default=600.0)
    ap.add_argument("--target-tensors", type=int, default=210_000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        make_file(path, int(a.gib * (1 << 30)), a.tensors)
        size = path.stat().st_size
        sha256_full(path)  # into the page cache
        full_s = best_of(lambda: sha256_full(path), a.repeat)
        sampled_s = best_of(lambda: weights_identity([path]), a.repeat)
    full_rate = size / full_s
    per_tensor = sampled_s / a.tensors
    write({
        "benchmark": "model_identity", "method": IDENTITY_METHOD, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "file_bytes": size, "tensors": a.tensors,
        "full_sha256_s": round(full_s, 3), "full_sha256_gb_per_s": round(full_rate / 1e9, 3),
        "sampled_s": round(sampled_s, 4), "sampled_us_per_tensor": round(per_tensor * 1e6, 2),
        "extrapolated": {
            "target_gb": a.target_gb, "target_tensors": a.target_tensors,
            "full_sha256_s": round(a.target_gb * 1e9 / full_rate, 1),
            "sampled_s_cached": round(per_tensor * a.target_tensors, 2),
            "sampled_bytes_read": a.target_tensors * 3 * 4096,
        },
    }, a.out)


if __name__ == "__main__":
    main()
