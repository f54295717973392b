"""The tiny CPU stand-in for Kimi-K2.5 and a toy chat data set, under .speccompat-demo/kimi/ (ignored by git).

    python examples/kimi_k25/make_stand_in.py      # prints the directory

Writes ``model/`` (a tiny random-weight checkpoint of Kimi-K2.5's text architecture: 6 layers,
hidden 256, MLA + MoE, word-level tokenizer) and ``toy-chats.jsonl`` (16 conversations in that
tokenizer's words). :data:`STAND_IN` is the checkpoint kind of ``speccompat.testing.models``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

#: The checkpoint kind that stands in for Kimi-K2.5 (its text architecture is DeepseekV3's).
STAND_IN = "deepseek_v3"
ROOT = Path(__file__).resolve().parents[2] / ".speccompat-demo" / "kimi"


def main(root: Path = ROOT) -> Path:
    from speccompat.testing.models import make_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    make_checkpoint(STAND_IN, root / "model")
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(4, 512)}" for _ in range(n))

    with open(root / "toy-chats.jsonl", "w") as f:
        for i in range(16):
            turns = [{"role": r, "content": words(rng.randrange(20, 200))} for r in ("user", "assistant") * 2]
            f.write(json.dumps({"id": f"toy-{i:03d}", "messages": turns}) + "\n")
    print(root)
    return root


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
