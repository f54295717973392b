#!/usr/bin/env python3
"""bf16 noise of the tiny checkpoints: transformers in bf16 against transformers in fp32.

This is the yardstick the parity thresholds are relative to (docs/parity.md), plus the distance
between neighbouring layers and between sequences, which is what a capture error looks like.

    python benchmarks/parity_noise.py [--sequences 45] [--out results.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from _results import write  # benchmarks/_results.py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=45)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    from speccompat.testing.models import RECIPES, make_checkpoint
    from speccompat.testing.parity import TOKEN_COS, compare
    from speccompat.testing.reference import ReferenceModel

    rng = random.Random(7)
    seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 600))] for _ in range(args.sequences)]
    work = Path(tempfile.mkdtemp())
    doc = {"command": "python benchmarks/parity_noise.py " + " ".join(f"--sequences {args.sequences}".split()),
           "sequences": len(seqs), "models": {}}
    for kind, recipe in RECIPES.items():
        path = str(make_checkpoint(kind, work / kind))
        layers = list(range(recipe.num_hidden_layers))
        r32, r16 = ReferenceModel(path, "float32"), ReferenceModel(path, "bfloat16")
        per_layer = {i: {"rel": [], "bad": [], "min_cos": []} for i in layers}
        neighbour, cross = [], []
        prev_states = None
        for s in seqs:
            a, b = r32.hidden_states(s, layers), r16.hidden_states(s, layers)
            for i in layers:
                c = compare(b[i], a[i])
                per_layer[i]["rel"].append(c.rel)
                per_layer[i]["min_cos"].append(c.min_cos)
                cos = torch.nn.functional.cosine_similarity(b[i], a[i], dim=-1)
                per_layer[i]["bad"].append(float((cos < TOKEN_COS).float().mean()))
                if i + 1 in layers:
                    neighbour.append(compare(a[i], a[i + 1]).rel)
            if prev_states is not None:
                n = min(len(s), prev_states[0].shape[0])
                cross.append(compare(prev_states[-1][:n], a[-1][:n]).rel)
            prev_states = a
        doc["models"][kind] = {
            "layers": {
                str(i): {
                    "rel_median": round(statistics.median(v["rel"]), 4),
                    "rel_max": round(max(v["rel"]), 4),
                    "min_cos_min": round(min(v["min_cos"]), 4),
                    "tokens_below_0.99_mean": round(statistics.mean(v["bad"]), 4),
                    "tokens_below_0.99_max": round(max(v["bad"]), 4),
                }
                for i, v in per_layer.items()
            },
            "neighbouring_layer_rel_min": round(min(neighbour), 3),
            "other_sequence_rel_min": round(min(cross), 3),
        }
    write(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
