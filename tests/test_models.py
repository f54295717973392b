"""The tiny-checkpoint builders: Kimi-K2.5 layout, INT4 experts, margin-decided routing, and the
parity rules they make possible (speccompat.testing.models / .parity)."""

from __future__ import annotations

import json

import pytest

from speccompat.testing.parity import LOOSE, TIGHT, Agreement, Case, violations

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from speccompat.testing import models as M  # noqa: E402


def _case(seq: int, rel: float, bad: float = 0.0, noise: float = 0.01) -> Case:
    return Case(seq, 0, Agreement(rel, 0.99, 0.999), Agreement(noise, 0.999, 0.9999), bad, 0.0)


def test_tight_rule_has_no_allowance_and_loose_has_one_sequence():
    cases = [_case(0, 0.2, 0.02)] + [_case(i, 0.01) for i in range(1, 20)]
    assert len(violations(cases, TIGHT)) == 1 and violations(cases) == violations(cases, TIGHT)
    assert violations(cases, LOOSE) == []  # one sequence of 20 may exceed, below the ceiling
    assert violations([_case(0, 0.3)] + cases[1:], LOOSE)  # above the ceiling
    assert violations([_case(0, 0.029)], TIGHT) == [] and violations([_case(0, 0.031)], TIGHT)
    assert violations([_case(0, 0.01, bad=0.011)], TIGHT)  # 1% disagreeing tokens on top of the noise's


def test_int4_round_trip_is_compressed_tensors_w4a16():
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
    q = M.quantize_int4(w)
    assert q["weight_packed"].dtype == torch.int32 and tuple(q["weight_packed"].shape) == (64, 128 // 8)
    assert tuple(q["weight_scale"].shape) == (64, 128 // 32) and q["weight_scale"].dtype == torch.bfloat16
    assert q["weight_shape"].tolist() == [64, 128]
    d = M.dequantize_int4(q)
    # symmetric int4: every value is an integer multiple in [-8, 7] of its group's scale
    scale = q["weight_scale"].float().repeat_interleave(32, dim=1)
    steps = d / scale
    assert torch.equal(steps, steps.round()) and steps.min() >= -8 and steps.max() <= 7
    # the scale is compressed-tensors' minmax one: max |w| of the group / 7.5, so each value is off by
    # at most half its group's step (a little more where the bf16-rounded scale or the clamp at +7 bite)
    assert ((d - w.float()).abs() <= 0.6 * scale).all()
    assert torch.allclose(q["weight_scale"].float(),
                          (w.float().reshape(64, 4, 32).abs().amax(-1) / 7.5).to(torch.bfloat16).float())
    # round trip of what is stored is exact: quantizing again gives the same integers
    assert torch.equal(M.dequantize_int4(M.quantize_int4(w)), d)
    with pytest.raises(ValueError, match="multiple of the INT4 group size"):
        M.quantize_int4(torch.randn(4, 48))


def test_kimi_names_follow_the_released_layout():
    assert M._kimi_name("language_model.model.blocks.3.mlp.gate.weight") == "language_model.model.layers.3.mlp.gate.weight"
    assert M._kimi_name("model.mm_projector.pre_norm.weight") == "mm_projector.pre_norm.weight"
    assert M._kimi_name("vision_tower.encoder.patch_embed.proj.weight") == "vision_tower.patch_embed.proj.weight"
    with pytest.raises(RuntimeError, match="outside the released checkpoint layout"):
        M._kimi_layout({"model.language_model.layers.0.mlp.gate.weight": torch.zeros(1)})


def test_routing_margins_are_kth_minus_next():
    scores = {1: torch.tensor([[0.9, 0.1, 0.8, 0.2], [0.5, 0.49, 0.48, 0.1]])}
    assert torch.allclose(M.routing_margins(scores, 2)[1], torch.tensor([0.6, 0.01]))


@pytest.mark.skipif(not hasattr(transformers, "Kimi_K25Config"), reason="transformers without Kimi_K25Config (< 5.13)")
def test_kimi_k25_checkpoint(tmp_path):
    """Two decoder layers (one dense, one MoE): config as vLLM reads it, released tensor names,
    transformers loads every tensor back unchanged, routing margins hold, INT4 experts dequantize
    to what the bf16 experts quantize to."""
    from safetensors.torch import load_file

    from speccompat.testing.reference import ReferenceModel

    path = M.make_checkpoint("kimi_k25", tmp_path / "k", num_hidden_layers=2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["topk_method"] == "noaux_tc" and cfg["text_config"]["num_hidden_layers"] == 2
    assert json.loads((path / "preprocessor_config.json").read_text())["media_proc_cfg"]["patch_size"] == 14
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids("<|media_pad|>") == cfg["image_token_id"] >= M.VOCAB_SIZE
    tensors = load_file(path / "model.safetensors")
    assert all(k.startswith(M.KIMI_PREFIXES) for k in tensors)
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in tensors

    model, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    lm = M.language_model(model)
    assert torch.equal(lm.embed_tokens.weight, tensors["language_model.model.embed_tokens.weight"].float())
    gate_up = lm.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(gate_up[:128], tensors["language_model.model.layers.1.mlp.experts.3.gate_proj.weight"].float())
    margin = M.check_routing(model.to(torch.bfloat16), M.RECIPES["kimi_k25"])
    assert margin >= M.MIN_ROUTING_MARGIN

    # a reference on the checkpoint: layer 1 (the MoE layer) of a prompt
    ref = ReferenceModel(str(path))
    assert ref.num_layers == 2 and len(ref.layers) == 2
    seq = M.routing_sequences(1)[0][:50]
    dense = ref.hidden_states(seq, [1])[0]

    q_path = M.make_checkpoint("kimi_k25", tmp_path / "q", num_hidden_layers=2, int4_experts=True)
    qcfg = json.loads((q_path / "config.json").read_text())["quantization_config"]
    assert qcfg == M.INT4_QUANTIZATION_CONFIG
    q = load_file(q_path / "model.safetensors")
    stem = "language_model.model.layers.1.mlp.experts.3.gate_proj."
    assert {stem + k for k in ("weight_packed", "weight_scale", "weight_shape")} <= set(q) and stem + "weight" not in q
    assert "language_model.model.layers.1.mlp.shared_experts.gate_proj.weight" in q  # not quantized
    bf16 = tensors[stem + "weight"]
    assert torch.equal(M.dequantize_int4({k: q[stem + k] for k in ("weight_packed", "weight_scale", "weight_shape")}),
                       M.dequantize_int4(M.quantize_int4(bf16)))
    qref = ReferenceModel(str(q_path))
    assert qref.layers[1].mlp.experts.gate_up_proj[3][:128].equal(
        M.dequantize_int4({k: q[stem + k] for k in ("weight_packed", "weight_scale", "weight_shape")}))
    quantized = qref.hidden_states(seq, [1])[0]
    rel = float((quantized - dense).norm() / dense.norm())
    assert 1e-4 < rel < 0.3, rel  # INT4 experts change the MoE layer's output, but not beyond recognition


def test_unknown_kind_and_int4_on_a_plain_model_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny checkpoint"):
        M.make_checkpoint("kimi", tmp_path)
    with pytest.raises(ValueError, match="int4_experts is for the kimi_k25"):
        M.make_checkpoint("deepseek_v3", tmp_path, int4_experts=True)


def test_every_recipe_names_a_decoder_layer_the_adapters_declare():
    from packaging.version import Version

    from speccompat.registry import by_version

    declared = by_version(Version("0.32.0")).layer_outputs
    for kind, recipe in M.RECIPES.items():
        assert declared.get(f"vllm.model_executor.models.{recipe.decoder_layer}") == "hidden+residual", kind


def test_gemma3_norm_gains_are_about_one():
    """Gemma's RMSNorm multiplies by (1 + weight): its weights are drawn around 0, so every norm's gain
    is about 1 as in the other recipes (drawn around 1 the gain was about 2)."""
    recipe = M.RECIPES["gemma3"]
    model = M._build_model(M.dataclasses.replace(recipe, config={**recipe.config, "num_hidden_layers": 1}))
    norms = {n: p.detach().float() for n, p in model.named_parameters() if p.dim() == 1 and "norm" in n}
    assert len(norms) == 7  # input, post-attention, pre/post-feedforward, q, k, final
    x = torch.randn(3, 256)
    for name, w in norms.items():
        assert abs(float(w.mean())) < 0.05 and 0.05 < float(w.std()) < 0.15, name
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        gain = (norm(x).float().norm(dim=-1) / (x.shape[-1] ** 0.5)).mean()
    assert 0.9 < float(gain) < 1.1, float(gain)
