"""What the model's files and this machine decide about a run's settings, before any engine starts.

``speccompat extract`` (:func:`preflight`, :func:`machine_problems`) and ``speccompat serve`` (:func:`too_long`)
refuse a setting vLLM would refuse minutes later, naming the flag, the value, the model's fact and a value
that works. Only the standard library: the settings are duck-typed (``ExtractConfig`` and the like).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["machine_problems", "max_model_len_limit", "preflight", "tokenizer_config", "too_long"]

#: config.json keys vLLM takes the model's longest sequence from (the smallest present wins).
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "model_max_length")

#: RoPE types whose ``factor`` does not lengthen the model's limit (vLLM's ``_get_and_verify_max_len``).
_UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def tokenizer_config(model_path: str | Path) -> dict[str, Any] | None:
    """The model's tokenizer_config.json as a dict, or ``None`` where it has none that parses."""
    try:
        return json.loads((Path(model_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None


def max_model_len_limit(model_config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> Any:
    """``(limit, what)``: the longest max_model_len vLLM accepts for this config (its rule: the
    smallest length key of config.json, the tokenizer's ``model_max_length``, times a RoPE scaling
    factor), or ``None`` when config.json names no length."""
    text = model_config.get("text_config") or model_config
    limits = {f"config.json {k}": text[k] for k in _MAX_LEN_KEYS if isinstance(text.get(k), int) and text[k] > 0}
    tok = (tokenizer_config or {}).get("model_max_length")
    if isinstance(tok, int) and tok > 0:
        limits["tokenizer_config.json model_max_length"] = tok
    if not limits:
        return None
    key, limit = min(limits.items(), key=lambda kv: kv[1])
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)) and \
            rope.get("rope_type", rope.get("type")) not in _UNSCALED_ROPE:
        return int(limit * rope["factor"]), f"{key} {limit} x the RoPE scaling factor {rope['factor']}"
    return limit, f"{key} {limit}"


def too_long(max_model_len: int, model_config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None,
             ) -> Any:
    """``(limit, what)`` of :func:`max_model_len_limit` where vLLM would refuse ``max_model_len`` (longer than the
    model allows, and ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` unset), else ``None``."""
    found = max_model_len_limit(model_config, tokenizer_config)
    if found and max_model_len > found[0] and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") in ("", "0"):
        return found
    return None


def preflight(cfg: Any, model_config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None,
              ) -> list[str]:
    """What config.json already decides about the settings (``cfg``: ``max_seq_len``, ``max_model_len``,
    ``tp_size``), checked before any engine starts or anything is written: each problem names the flag, the
    value, the model's fact and a value that works. ``model_config``: config.json as a dict
    (``tokenizer_config``: tokenizer_config.json)."""
    text = model_config.get("text_config") or model_config
    problems = []
    if found := too_long(cfg.max_model_len, model_config, tokenizer_config):
        problems.append(
            f"--max-seq-len {cfg.max_seq_len}: the engine gets max_model_len = max_seq_len + 1 = "
            f"{cfg.max_model_len}, more than the model allows ({found[1]}), which vLLM refuses; "
            f"use --max-seq-len {found[0] - 1} or less")
    heads = text.get("num_attention_heads")
    if isinstance(heads, int) and heads > 0 and heads % cfg.tp_size:
        problems.append(f"--tp-size {cfg.tp_size}: the model's {heads} attention heads (num_attention_heads) are "
                        f"not divisible by it; use one of {_divisors(heads)}")
    kv = text.get("num_key_value_heads")
    if isinstance(kv, int) and 0 < kv != heads and (kv % cfg.tp_size if kv >= cfg.tp_size else cfg.tp_size % kv):
        problems.append(f"--tp-size {cfg.tp_size}: the model's {kv} KV heads (num_key_value_heads) can neither be "
                        f"split over it nor replicated evenly; use a divisor or a multiple of {kv}")
    return problems


def machine_problems(cfg: Any) -> list[str]:
    """What this machine decides: ``--tp-size`` GPUs must be visible (when ``CUDA_VISIBLE_DEVICES``
    says which; several engines are checked where they are placed, ``speccompat.dataset.parallel``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or cfg.ray or cfg.data_parallel_size > 1:
        return []
    n = len([d for d in visible.split(",") if d.strip()])
    if n and cfg.tp_size > n:
        return [f"--tp-size {cfg.tp_size}: only {n} GPU(s) are visible (CUDA_VISIBLE_DEVICES={visible})"]
    return []


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]
