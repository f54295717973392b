"""Fake generator results and a tiny model directory for the data-set unit tests (no vLLM)."""

from __future__ import annotations

import json
import random
from pathlib import Path

LAYERS = [1, 2, 4, 5]
HIDDEN = 8
VOCAB = 512


def model_dir(root: Path, layers: int = 6, hidden: int = HIDDEN, **extra) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
           "vocab_size": VOCAB, **extra}
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", {"embed.weight": [0.5] * 64, "norm.weight": [1.0] * 8})
    (d / "tokenizer.json").write_text('{"model": "words"}')
    return d


def write_safetensors(path: Path, tensors: dict[str, list[float]]) -> Path:
    """A safetensors file of 1-D float32 tensors (no torch needed)."""
    import struct

    header, data = {}, b""
    for name, values in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def states(sample, seed: int = 0, dtype=None):
    """Deterministic fake hidden states of one sample: one [n, HIDDEN] tensor per layer."""
    import torch

    g = torch.Generator().manual_seed(seed + sum(sample.input_ids[:8]) + sample.num_tokens)
    return [torch.randn(sample.num_tokens, HIDDEN, generator=g).to(dtype or torch.bfloat16) for _ in LAYERS]


def jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def random_records(n: int, seed: int = 0, lo: int = 5, hi: int = 40) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(lo, hi)
        out.append({"id": f"s{i:03d}", "input_ids": [rng.randrange(4, VOCAB) for _ in range(k)],
                    "loss_mask": [rng.randrange(2) for _ in range(k)]})
    return out
