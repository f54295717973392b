#!/usr/bin/env python3
"""Worker -> driver transport of captured hidden states: pickled reply vs shared-memory file.

Measures, for one batch of packed states ([layers, tokens, hidden] bf16), what the driver pays to
get per-sequence tensors it owns:
  pickle  what a collective_rpc reply costs at the least (pickle.dumps + loads, protocol 5; vLLM's
          message queue adds its own copies on top) followed by per-sequence split + clone;
  shm     speccompat.transport: one copy into /dev/shm by the worker, map + unlink + per-sequence
          clone by the driver.

    python benchmarks/transport.py [--tokens 66148] [--hidden 1024] [--layers 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from _results import write  # benchmarks/_results.py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=66148)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=516)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    from speccompat import transport

    layers = [torch.randn(args.tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]
    lengths = [args.seq_len] * (args.tokens // args.seq_len)
    lengths[-1] += args.tokens - sum(lengths)

    def via_pickle() -> None:
        reply = pickle.loads(pickle.dumps({"layers": layers}, protocol=5))
        split = [torch.split(t, lengths) for t in reply["layers"]]
        [[split[j][i].clone() for j in range(len(split))] for i in range(len(lengths))]

    def via_shm() -> None:
        states = transport.unpack(transport.pack(layers))
        split = torch.split(states, lengths, dim=1)
        [[layer.clone() for layer in split[i]] for i in range(len(lengths))]

    result = {"command": "python benchmarks/transport.py", "megabytes": round(
        args.layers * args.tokens * args.hidden * 2 / 1e6), "sequences": len(lengths)}
    for name, fn in (("pickle", via_pickle), ("shm", via_shm)):
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        result[f"{name}_s_median"] = round(statistics.median(times), 3)
    result["speedup"] = round(result["pickle_s_median"] / result["shm_s_median"], 2)
    write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
