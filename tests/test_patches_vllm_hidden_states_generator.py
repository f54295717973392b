"""speccompat.patches.vllm_hidden_states_generator: the vLLM names speculators' generator module
imported (routed through the adapter) and the generator's methods."""

from __future__ import annotations

import types

import pytest

from speccompat import generator, patching, platform
from speccompat.errors import SpeccompatError
from speccompat.patches import GEN_MODULE
from speccompat.patches.vllm_hidden_states_generator import GENERATOR

BY_ID = {p.id: p for p in GENERATOR}


class Adapter:
    def __init__(self):
        self.calls = []

    def name(self):
        return "test_adapter"

    def cache_config(self, cls, **kw):
        self.calls.append((cls, kw))
        return cls(**kw)


def test_every_patch_targets_the_generator_module():
    assert len(GENERATOR) == 13 and all(p.target.startswith(f"{GEN_MODULE}:") for p in GENERATOR)


def test_a_routed_name_calls_the_adapter_with_the_original_and_takes_keywords_only(monkeypatch):
    adapter = Adapter()
    shim = BY_ID["generator.CacheConfig"].build(types.SimpleNamespace(adapter=adapter), dict)
    assert shim(block_size=16) == {"block_size": 16}
    assert adapter.calls == [(dict, {"block_size": 16})] and shim.__wrapped__ is dict
    with pytest.raises(TypeError, match="CacheConfig: speccompat's adapter takes keyword arguments only"):
        shim(16)
    monkeypatch.setattr(patching, "_generation", patching.generation() + 1)  # as revert() does
    with pytest.raises(SpeccompatError, match=r"CacheConfig: speccompat was reverted"):
        shim(block_size=16)


def test_methods_are_the_generator_implementations_themselves():
    ctx = types.SimpleNamespace(adapter=Adapter())

    def original(*a, **k):
        return "original"

    for pid, impl in (("generator.generate", generator.compat_generate), ("generator.__del__", generator.compat_del),
                      ("generator.mem_get_info", platform.mem_get_info)):
        built = BY_ID[pid].build(ctx, original)
        assert built.__speccompat_impl__ is impl and built.__wrapped__ is original, pid


def test_the_tokenizer_trusts_remote_code_unless_told_otherwise():
    seen = []
    auto = types.SimpleNamespace(from_pretrained=lambda *a, **k: seen.append(k) or "tok", other=1)
    tok = BY_ID["generator.AutoTokenizer"].build(types.SimpleNamespace(adapter=None), auto)
    assert tok.from_pretrained("m") == "tok" and tok.from_pretrained("m", trust_remote_code=False) == "tok"
    assert seen == [{"trust_remote_code": True}, {"trust_remote_code": False}]
    assert tok.other == 1 and tok.__wrapped__ is auto
