"""The tiny CPU stand-in for Kimi-K2.5 and a toy chat data set, under .speccompat-demo/kimi/ (ignored by git).

    python examples/kimi_k25/make_stand_in.py      # prints the directory

Writes ``model/`` (a tiny random-weight checkpoint of Kimi-K2.5's own architecture,
``KimiK25ForConditionalGeneration``: a one-block MoonViT vision tower and projector around a
DeepseekV3 language model of 6 layers, hidden 256, MLA + MoE; a word-level tokenizer of 512 words
with Kimi's special and media tokens above them) and ``toy-chats.jsonl`` (16 conversations in that
tokenizer's plain words, never its special or media tokens). :data:`STAND_IN` is the checkpoint
kind of ``speccompat.testing.models``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

#: The checkpoint kind that stands in for Kimi-K2.5: its own architecture (vision tower + DeepseekV3), tiny.
STAND_IN = "kimi_k25"
ROOT = Path(__file__).resolve().parents[2] / ".speccompat-demo" / "kimi"


def plain_words(model: Path) -> list[str]:
    """The tokens of the model's tokenizer that are neither special nor added (Kimi's media and
    special tokens are added tokens), by id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    reserved = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return [t for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if i not in reserved]


def main(root: Path = ROOT) -> Path:
    from speccompat.testing.models import make_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    vocab = plain_words(make_checkpoint(STAND_IN, root / "model"))
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(n))

    with open(root / "toy-chats.jsonl", "w") as f:
        for i in range(16):
            turns = [{"role": r, "content": words(rng.randrange(20, 200))} for r in ("user", "assistant") * 2]
            f.write(json.dumps({"id": f"toy-{i:03d}", "messages": turns}) + "\n")
    print(root)
    return root


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
