#!/usr/bin/env python3
"""Device -> driver data path of captured hidden states on a GPU, one primitive at a time.

For one batch of captured states on the device ([layers, tokens, hidden] bf16, 17 prefill steps of
8192 tokens), the median seconds of:
  gather      torch.cat of the steps + index_select into request order (on the device)
  d2h_fresh   copy into a fresh /dev/shm file mapping (pageable: page faults + staged copy)
  d2h_fallocated   the same after posix_fallocate of the file (pages allocated up front)
  d2h_registered   the same after cudaHostRegister of the mapping (DMA), incl. register/unregister
  d2h_pinned  copy into torch's pinned memory (reference: the DMA bound)
  d2h_staging     speccompat.transport.Staging: the worker's reused file (pinned on a GPU), steady state
  driver_clone    driver side, one thread: map, split, one clone per sequence and layer
  driver_block    driver side: map, one [layers, n, hidden] copy per sequence (shares storage: not used)
  driver_copy_out driver side as in the generator (speccompat.generator.copy_out), torch's threads
  driver_copy_out_t1_loop   the same with torch on one thread (as vLLM leaves the driver on GPU hosts),
                  one Python thread
  driver_copy_out_t1        the same with torch on one thread, copy_out's choice (a pool of Python
                  threads where cores allow)

    python benchmarks/device_copy.py [--tokens 132000] [--hidden 1024] [--layers 4] [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _results import write  # benchmarks/_results.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=132000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    from speccompat import transport

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, T, H = args.layers, args.tokens, args.hidden
    steps = [torch.randn(min(8192, T - s), H, device=dev).to(torch.bfloat16) for s in range(0, T, 8192)]
    index = torch.randperm(T)
    packed = torch.stack([torch.cat(steps).index_select(0, index.to(dev))] * L)
    lengths = [args.seq_len] * (T // args.seq_len)
    lengths[-1] += T - sum(lengths)
    cudart = torch.cuda.cudart() if dev == "cuda" else None

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def gather() -> None:
        for _ in range(L):
            torch.cat(steps).index_select(0, index.to(dev))
        sync()

    def fresh(populate: bool = False, register: bool = False):
        desc, buf = transport.allocate(tuple(packed.shape), packed.dtype)
        nbytes = buf.numel() * buf.element_size()
        if populate and "file" in desc:
            fd = os.open(desc["file"], os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        registered = register and cudart is not None and cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0) == 0
        buf.copy_(packed, non_blocking=registered)
        sync()
        if registered:
            cudart.cudaHostUnregister(buf.data_ptr())
        return desc

    def d2h(**kw):
        def run() -> None:
            transport.discard(fresh(**kw))
        return run

    def pinned() -> None:
        buf = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=dev == "cuda")
        buf.copy_(packed, non_blocking=True)
        sync()

    staging = transport.Staging()

    def d2h_staging() -> None:
        desc, buf = staging.allocate(tuple(packed.shape), packed.dtype, packed.device)
        buf.copy_(packed, non_blocking=True)
        staging.ready()
        transport.unpack(desc)

    def copy_out(torch_threads: int = 0, pool: bool = True):
        from speccompat import generator

        def run() -> float:
            desc, buf = staging.allocate(tuple(packed.shape), packed.dtype, packed.device)
            buf.copy_(packed, non_blocking=True)
            staging.ready()
            before = torch.get_num_threads()
            if torch_threads:
                torch.set_num_threads(torch_threads)
            try:
                parts = torch.split(transport.unpack(desc), lengths, dim=1)
                t = time.perf_counter()
                kept = generator.copy_out(parts) if pool else generator._clone_all(list(parts))  # noqa: F841
                return time.perf_counter() - t
            finally:
                torch.set_num_threads(before)
        return run

    def driver(block: bool):
        def run() -> None:
            desc = fresh()
            t = time.perf_counter()
            states = transport.unpack(desc)
            kept = []  # the caller keeps its results: new memory, as in real use
            if block:
                off = 0
                for n in lengths:
                    kept.append(list(states[:, off:off + n].clone().unbind(0)))
                    off += n
            else:
                for part in torch.split(states, lengths, dim=1):
                    kept.append([layer.clone() for layer in part])
            return time.perf_counter() - t
        return run

    cases = {"gather": gather, "d2h_fresh": d2h(), "d2h_fallocated": d2h(populate=True),
             "d2h_registered": d2h(register=True), "d2h_pinned": pinned, "d2h_staging": d2h_staging,
             "driver_clone": driver(block=False), "driver_block": driver(block=True), "driver_copy_out": copy_out(),
             # the driver as vLLM's multiprocessing executor leaves it on GPU hosts: torch on one thread
             "driver_copy_out_t1_loop": copy_out(1, pool=False), "driver_copy_out_t1": copy_out(1)}
    result = {"command": "python " + " ".join(["benchmarks/device_copy.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(0) if dev == "cuda" else f"cpu ({os.cpu_count()} cores)",
              "torch": torch.__version__, "megabytes": round(packed.numel() * 2 / 1e6), "sequences": len(lengths)}
    for name, fn in cases.items():
        fn()  # warm-up
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            inner = fn()
            times.append(inner if isinstance(inner, float) else time.perf_counter() - t)
        result[f"{name}_s"] = round(statistics.median(times), 4)
    staging.release()
    write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
