"""The settings the model's files and the machine decide are refused before any engine starts, naming the flag,
the value, the model's fact and a value that works (no vLLM needed)."""

from __future__ import annotations

import pytest

from speccompat.dataset import extract as ex
from speccompat.dataset import preflight as pf


def cfg(**kw):
    return ex.ExtractConfig(model_path="m", prepared_data="d.jsonl", output_dir="out", **kw)


@pytest.mark.parametrize(("settings", "config", "problem"), [
    ({}, {"max_position_embeddings": 2048},
     "--max-seq-len 2048: the engine gets max_model_len = max_seq_len + 1 = 2049, more than the model allows "
     "(config.json max_position_embeddings 2048), which vLLM refuses; use --max-seq-len 2047 or less"),
    ({"tp_size": 8}, {"num_attention_heads": 4, "num_key_value_heads": 4},
     "--tp-size 8: the model's 4 attention heads (num_attention_heads) are not divisible by it; use one of [1, 2, 4]"),
    ({"tp_size": 4}, {"num_attention_heads": 12, "num_key_value_heads": 6},
     "--tp-size 4: the model's 6 KV heads (num_key_value_heads) can neither be split over it nor replicated "
     "evenly; use a divisor or a multiple of 6"),
])
def test_preflight_names_the_setting_and_a_value_that_works(settings, config, problem):
    assert pf.preflight(cfg(**settings), config) == [problem]


def test_preflight_accepts_settings_that_fit():
    config = {"text_config": {"max_position_embeddings": 4096, "num_attention_heads": 8, "num_key_value_heads": 2}}
    assert pf.preflight(cfg(max_seq_len=4095, tp_size=4), config) == []
    assert pf.preflight(cfg(tp_size=8), {"num_attention_heads": 8, "num_key_value_heads": 2}) == []  # replicated
    assert pf.preflight(cfg(max_seq_len=9000), {"max_position_embeddings": 2048,
                                                "rope_scaling": {"type": "linear", "factor": 8}}) == []


def test_the_length_limit_follows_vllms_rule():
    limit = pf.max_model_len_limit
    assert limit({"max_position_embeddings": 2048, "seq_length": 1024}) == (1024, "config.json seq_length 1024")
    assert limit({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}) == \
        (4096, "config.json max_position_embeddings 2048 x the RoPE scaling factor 2.0")
    yarn = {"max_position_embeddings": 131072, "rope_scaling": {"type": "yarn", "factor": 32.0}}  # Kimi-K2
    assert limit(yarn) == (131072, "config.json max_position_embeddings 131072")
    assert limit({"max_position_embeddings": 4096}, {"model_max_length": 1000}) == \
        (1000, "tokenizer_config.json model_max_length 1000")
    assert limit({"hidden_size": 8}) is None
    assert pf.preflight(cfg(max_seq_len=1000), {"max_position_embeddings": 4096}, {"model_max_length": 1000}) == [
        "--max-seq-len 1000: the engine gets max_model_len = max_seq_len + 1 = 1001, more than the model allows "
        "(tokenizer_config.json model_max_length 1000), which vLLM refuses; use --max-seq-len 999 or less"]


def test_tp_size_needs_that_many_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert pf.machine_problems(cfg(tp_size=4)) == ["--tp-size 4: only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1)"]
    assert pf.machine_problems(cfg(tp_size=2)) == []
    assert pf.machine_problems(cfg(tp_size=4, data_parallel_size=2)) == []  # placed by speccompat.dataset.parallel
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert pf.machine_problems(cfg(tp_size=4)) == []




def test_a_length_vllm_refuses_is_named_unless_vllm_is_told_to_allow_it(monkeypatch):
    config = {"max_position_embeddings": 2048}
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert pf.too_long(2049, config) == (2048, "config.json max_position_embeddings 2048")
    assert pf.too_long(2048, config) is None
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert pf.too_long(2049, config) is None


def test_the_tokenizer_config_is_read_where_it_parses(tmp_path):
    assert pf.tokenizer_config(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert pf.tokenizer_config(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 1000}')
    assert pf.tokenizer_config(tmp_path) == {"model_max_length": 1000}
