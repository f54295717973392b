#!/usr/bin/env python3
"""bf16 noise of the tiny checkpoints: transformers in bf16 against transformers in fp32.

This is the yardstick the parity thresholds are relative to (docs/parity.md), plus the distance
between neighbouring layers and between sequences, which is what a capture error looks like.
For MoE checkpoints also the routing: the smallest top-k margin over all tokens, the largest change
of a routing score between bf16 and fp32, and how many tokens choose other experts in bf16.

    python benchmarks/parity_noise.py [--sequences 45] [--models deepseek_v3 kimi_k25 kimi_k25-int4] [--out results.json]

``kimi_k25-int4`` is the kimi_k25 checkpoint with compressed-tensors INT4 experts (its reference:
the experts dequantized).
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
    ap.add_argument("--models", nargs="*", help="default: every tiny checkpoint, and kimi_k25-int4")
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    from speccompat.testing.models import RECIPES, make_checkpoint, router_scores, routing_margins
    from speccompat.testing.parity import TOKEN_COS, compare
    from speccompat.testing.reference import ReferenceModel

    rng = random.Random(7)
    seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 600))] for _ in range(args.sequences)]
    work = Path(tempfile.mkdtemp())
    models = args.models or [*RECIPES, "kimi_k25-int4"]
    doc = {"command": f"python benchmarks/parity_noise.py --sequences {args.sequences} --models {' '.join(models)}",
           "sequences": len(seqs), "models": {}}
    for name in models:
        kind, int4 = name.removesuffix("-int4"), name.endswith("-int4")
        recipe = RECIPES[kind]
        path = str(make_checkpoint(kind, work / name, **({"int4_experts": True} if int4 else {})))
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
        doc["models"][name] = {
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
        if "n_routed_experts" in recipe.config:
            k = recipe.config["num_experts_per_tok"]
            s32, s16 = router_scores(r32.model, seqs), router_scores(r16.model, seqs)
            margins = routing_margins(s32, k)
            doc["models"][name]["routing"] = {
                str(i): {
                    "margin_min": round(float(margins[i].min()), 4),
                    "margin_median": round(float(margins[i].median()), 4),
                    "bf16_score_change_max": round(float((s32[i] - s16[i]).abs().max()), 4),
                    "tokens_routed_differently_in_bf16": int(
                        (s32[i].topk(k).indices.sort().values != s16[i].topk(k).indices.sort().values).any(-1).sum()),
                    "tokens": int(s32[i].shape[0]),
                }
                for i in sorted(s32)
            }
        write(doc, args.out, echo=False)  # after each model, so a run cut short keeps what it measured
    write(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
