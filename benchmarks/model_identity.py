"""What identifying a checkpoint by its whole content costs (speccompat.dataset.provenance), CPU only.

Writes a synthetic checkpoint of the Llama-3.1-8B shape (``--shape 8b``: 291 bfloat16 tensors in
four ``model-0000K-of-00004.safetensors`` files, 16.06 GB; random bytes) into ``--dir``, then
times :func:`speccompat.dataset.provenance.weights_identity` on it:

- ``first``: the files' pages dropped from the page cache (``posix_fadvise(DONTNEED)`` after an
  fsync) and an empty digest cache: every byte is read from the disk and hashed (XXH3-128 over
  64 MiB segments on a pool of threads), once per ``--threads`` value;
- ``cached``: the same files again with the digests cached (what a resume or a second run pays:
  a stat and a small JSON file per weight file).

The files are deleted at the end (``--keep`` keeps them).

    python benchmarks/model_identity.py --dir /tmp/identity-bench --shape 8b \\
        --out benchmarks/results/model-identity-8b-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402

from speccompat.dataset import contenthash  # noqa: E402
from speccompat.dataset.provenance import IDENTITY_METHOD, weights_identity  # noqa: E402


def llama_8b() -> list[tuple[str, list[int]]]:
    """(name, shape) of Llama-3.1-8B's tensors (bfloat16)."""
    hidden, inter, vocab, kv = 4096, 14336, 128256, 1024
    out = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(32):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.k_proj.weight", [kv, hidden]),
                (p + "self_attn.v_proj.weight", [kv, hidden]), (p + "self_attn.o_proj.weight", [hidden, hidden]),
                (p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter]), (p + "input_layernorm.weight", [hidden]),
                (p + "post_attention_layernorm.weight", [hidden])]
    return [*out, ("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]


def shards(tensors: list[tuple[str, list[int]]], n: int) -> list[list[tuple[str, list[int]]]]:
    sizes = [2 * _numel(s) for _, s in tensors]
    per = sum(sizes) / n
    out: list[list[tuple[str, list[int]]]] = [[]]
    acc = 0
    for t, size in zip(tensors, sizes, strict=True):
        if acc >= per * len(out) and len(out) < n:
            out.append([])
        out[-1].append(t)
        acc += size
    return out


def _numel(shape: list[int]) -> int:
    k = 1
    for d in shape:
        k *= d
    return k


def write_file(path: Path, tensors: list[tuple[str, list[int]]], block: bytes) -> int:
    header, offset = {}, 0
    for name, shape in tensors:
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left, k = offset, 0
        while left > 0:
            chunk = block[: min(left, len(block))]
            f.write(struct.pack("<Q", k) + chunk[8:])  # every chunk differs
            left -= len(chunk)
            k += 1
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def drop_pages(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the synthetic checkpoint goes (default: a temp dir)")
    ap.add_argument("--shape", choices=("8b",), default="8b")
    ap.add_argument("--threads", type=int, nargs="+", default=[0],
                    help="thread counts for the first computation (0: the default, contenthash.default_threads())")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="identity-bench-", dir=a.dir))
    cache = root / "cache"
    os.environ["SPECCOMPAT_CACHE_DIR"] = str(cache)
    try:
        model = root / "model"
        model.mkdir()
        block = os.urandom(64 << 20)
        files, total = [], 0
        t0 = time.perf_counter()
        parts = shards(llama_8b(), 4)
        for k, part in enumerate(parts, start=1):
            path = model / f"model-{k:05d}-of-{len(parts):05d}.safetensors"
            total += write_file(path, part, block)
            files.append(path)
        made_s = time.perf_counter() - t0
        firsts = []
        for threads in a.threads:
            shutil.rmtree(cache, ignore_errors=True)
            drop_pages(files)
            t0 = time.perf_counter()
            ident = weights_identity(files, threads=threads or None)
            s = time.perf_counter() - t0
            firsts.append({"threads": threads or contenthash.default_threads(), "s": round(s, 2),
                           "gb_per_s": round(total / 1e9 / s, 3)})
        cached = []
        for _ in range(3):
            t0 = time.perf_counter()
            again = weights_identity(files)
            cached.append(time.perf_counter() - t0)
            assert again == ident
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    write({
        "benchmark": "model_identity", "method": IDENTITY_METHOD, "segment_bytes": contenthash.SEGMENT,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "shape": a.shape,
        "files": len(files), "bytes": total, "tensors": sum(len(p) for p in parts), "write_s": round(made_s, 1),
        "first_pages_dropped": firsts, "cached_s": [round(x, 4) for x in cached],
        "python": platform.python_version(),
    }, a.out)


if __name__ == "__main__":
    main()
