"""Tiny random-weight checkpoints that real vLLM engines (CPU and CUDA) accept.

No model hub is needed: each checkpoint is built with transformers from a fixed seed, saved with a
word-level tokenizer, and is small enough to load in a second. Shapes are chosen for what the
kernels accept, not for realism:

- attention head_dim 64 (the CPU attention kernels reject 16);
- DeepseekV3 (MLA + MoE, the text architecture of Kimi-K2.5) uses DeepSeek's real head dims
  (qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512): GPU MLA prefill needs them and the CPU MLA
  decode kernel needs kv_lora_rank + qk_rope_head_dim == 576;
- ``topk_method: noaux_tc`` so vLLM creates ``e_score_correction_bias``, which transformers saves.

``make_checkpoint(kind, path)`` is idempotent: an existing checkpoint with the same recipe is reused.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RECIPES", "Recipe", "make_checkpoint"]

VOCAB_SIZE = 512


@dataclass(frozen=True)
class Recipe:
    """How to build one tiny checkpoint."""

    kind: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    #: Scale of the attention score projections (see _SOFT). 1.0 gives sharp attention.
    attn_scale: float = 1.0
    #: Scale of MoE router weights: decisive routing keeps bf16 noise from flipping a token's
    #: experts (a flip changes that token's output completely and would mask real errors).
    router_scale: float = 1.0

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

RECIPES: dict[str, Recipe] = {
    "llama": Recipe(
        kind="llama",
        architecture="LlamaForCausalLM",
        config={
            **_COMMON,
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
        },
    ),
    # DeepseekV3: MLA attention + MoE, the text architecture of Kimi-K2.5.
    "deepseek_v3": Recipe(
        kind="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        config={
            **_COMMON,
            "model_type": "deepseek_v3",
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "num_nextn_predict_layers": 0,
            "hidden_act": "silu",
            # vLLM reads these from config.json; transformers ignores them.
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
        router_scale=4.0,
    ),
}


# Projections that set the attention logits; scaled by Recipe.attn_scale (1.0 = sharp attention,
# which makes position and attention errors visible).
_SOFT = ("q_b_proj", "kv_b_proj")


def _write_tokenizer(path: Path, recipe: Recipe) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    # A chat template lets the data-preparation helper be exercised on tiny models too.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    fast.save_pretrained(path)
    # A checkpoint written by transformers 5 must also load under transformers 4.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _build_model(recipe: Recipe):
    import torch
    import transformers

    cfg_dict = {k: v for k, v in recipe.config.items() if k not in ("model_type",)}
    config_cls = transformers.AutoConfig.for_model(recipe.config["model_type"]).__class__
    config = config_cls(**cfg_dict)
    config.architectures = [recipe.architecture]
    torch.manual_seed(recipe.seed)
    model_cls = getattr(transformers, recipe.architecture)
    model = model_cls(config).to(torch.bfloat16)
    # transformers initialises some MoE parameters (router bias, expert weights) lazily or to
    # zeros; give every parameter a random value so that a wrong slice can't hide behind zeros.
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            else:
                scale = recipe.attn_scale if any(k in name for k in _SOFT) else 1.0
                if name.endswith("mlp.gate.weight"):
                    scale = recipe.router_scale
                p.copy_(torch.randn(p.shape, generator=gen) * (scale / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
    return model


def _recipe_stamp(recipe: Recipe) -> str:
    return json.dumps(asdict(recipe), sort_keys=True)


def make_checkpoint(kind: str, path: str | os.PathLike, **overrides: Any) -> Path:
    """Write the tiny checkpoint ``kind`` to ``path`` (reused if already there) and return it.

    ``overrides`` replace config keys (e.g. ``num_hidden_layers=4``).
    """
    if kind not in RECIPES:
        raise ValueError(f"unknown tiny checkpoint {kind!r}; choose from {sorted(RECIPES)}")
    base = RECIPES[kind]
    recipe = Recipe(
        base.kind, base.architecture, {**base.config, **overrides}, base.seed, base.attn_scale, base.router_scale
    )
    path = Path(path)
    stamp_file = path / ".speccompat-recipe.json"
    stamp = _recipe_stamp(recipe)
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    model = _build_model(recipe)
    model.save_pretrained(path, safe_serialization=True)
    # transformers drops keys it does not know; vLLM needs some of them (see module doc).
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("topk_method", "scoring_func"):
        if key in recipe.config:
            cfg[key] = recipe.config[key]
    cfg["torch_dtype"] = "bfloat16"
    # transformers 5 writes rope_parameters; transformers 4 (older vLLM releases) reads rope_theta.
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2))
    _write_tokenizer(path, recipe)
    stamp_file.write_text(stamp)
    return path
