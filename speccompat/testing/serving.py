"""The serving-path oracle: hidden states as vLLM itself computes them for EAGLE-3.

vLLM's EAGLE-3 serving (and its ``extract_hidden_states`` speculative method) asks the target model
for auxiliary hidden states: ``SupportsEagle3.set_aux_hidden_state_layers(ids)`` makes the model's
own forward (``EagleModelMixin._maybe_add_hidden_state`` in ``llama.py``, ``qwen2.py``,
``gpt_oss.py``, ..., or ``deepseek_v2.py``'s loop) return ``(hidden_states, [aux ...])``, where aux id
``k`` is the residual stream after ``k`` decoder layers. speccompat's (and speculators 0.3/0.4's)
layer ``i`` is the output of decoder layer ``i``, so it must equal aux id ``i + 1``.

This module runs a plain vLLM engine (no speculators, no speccompat patches) with a worker
extension that sets the aux layers through the model's own ``set_aux_hidden_state_layers`` and keeps
what the model's forward returns: the model code path EAGLE-3 serving runs, without a draft model.
Each sequence is one prefill (``max_tokens=1``, no prefix caching, no chunking), so a forward's
first ``len(sequence)`` rows are that sequence's tokens.

    python -m speccompat.testing.serving --model PATH --aux-ids 1 3 5 6 --sequences IN.json --out OUT.pt

A model class without ``SupportsEagle3`` (vLLM 0.32.0's Gemma3ForCausalLM, ``gemma3.py``) has no aux
path: ``--layer-hooks`` then reads the residual stream after decoder layer ``k - 1`` by a forward hook
on that layer of the plain engine (``hidden + residual`` of a ``(hidden, residual)`` output), vLLM's
own computation without speculators or speccompat, but the same output convention as the capture.

``OUT.pt`` holds ``{"aux_ids": [...], "results": [{"input_ids": LongTensor[n],
"hidden_states": [Tensor[n, H] per aux id]}, ...]}``. The engine's run-to-run noise: ``--repeat 2``
runs every sequence twice and stores the second pass as ``"repeat"``.

``--native`` reads the same states through vLLM's own ``extract_hidden_states`` speculative method
instead (what speculators >= 0.5 and NVIDIA Model-Optimizer extract with): the aux ids go into the
draft config as ``eagle_aux_hidden_state_layer_ids``, ``ExampleHiddenStatesConnector`` writes each
request's ``[n, len(aux_ids), H]`` states to a safetensors file, read back here. The connector's
write-out uses CUDA streams (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py, ``_submit_async_write``): it runs on GPUs only; ``--cpu-connector``
does that copy on the CPU (:mod:`speccompat.testing.native_cpu`) and keeps the rest vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, NamedTuple

__all__ = ["AuxCaptureExtension", "LayerHookExtension", "OracleAgreement", "agreement", "native_engine_args", "run",
           "run_native"]


class AuxCaptureExtension:
    """vLLM worker extension (``worker_extension_cls``): capture the model's own aux hidden states."""

    def speccompat_set_aux_layers(self, aux_ids: list[int]) -> str:
        import torch

        model = self.model_runner.get_model()
        model.set_aux_hidden_state_layers(tuple(aux_ids))
        self._speccompat_aux: list[Any] = []
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                hidden, aux = out
                self._speccompat_aux.append(torch.stack([a.detach().to("cpu", copy=True) for a in aux]))
                return hidden
            raise RuntimeError(f"{type(model).__name__}.forward returned {type(out).__name__}, not "
                               f"(hidden_states, aux_hidden_states) after set_aux_hidden_state_layers({aux_ids})")

        model.forward = forward
        return type(model).__name__

    def speccompat_take_aux(self) -> bytes:
        """The aux states of every forward since the last call, one [num_aux, tokens, hidden] tensor
        each, as ``torch.save`` bytes (vLLM's RPC reply encoding does not carry nested tensors)."""
        import io

        import torch

        out, self._speccompat_aux = self._speccompat_aux, []
        buf = io.BytesIO()
        torch.save(out, buf)
        return buf.getvalue()


class OracleAgreement(NamedTuple):
    """speccompat's states against an oracle's, case by case (sequence x layer)."""

    cases: int
    bit_equal: int
    worst_rel: float
    off: list[str]  # the cases beyond the engine's run-to-run noise, described


def agreement(layer_ids: list[int], single: list[Any], batched: list[Any], oracle: list[Any]) -> OracleAgreement:
    """Layer ``i`` of ``single`` (speccompat's generator, one sequence per call) against aux id ``i+1``
    of ``oracle``: each case bit-equal, or within the run-to-run noise of that case (the same
    generator's states of that sequence batched with the others, ``batched``)."""
    import torch

    from .parity import compare

    off, equal, worst, cases = [], 0, 0.0, 0
    for n, (cap, cap_b, srv) in enumerate(zip(single, batched, oracle, strict=True)):
        for j, layer in enumerate(layer_ids):
            got, want = cap["hidden_states"][j], srv["hidden_states"][j]
            if got.shape != want.shape:
                raise ValueError(f"sequence {n}, layer {layer}: shape {tuple(got.shape)} != oracle {tuple(want.shape)}")
            cases += 1
            if torch.equal(got, want):
                equal += 1
                continue
            rel, noise = compare(got, want).rel, compare(cap_b["hidden_states"][j], got).rel
            worst = max(worst, rel)
            if rel > noise:
                off.append(f"sequence {n}, layer {layer} vs aux {layer + 1}: rel {rel:.3g} > run-to-run noise {noise:.3g}")
    return OracleAgreement(cases, equal, worst, off)


class LayerHookExtension(AuxCaptureExtension):
    """vLLM worker extension: aux id ``k`` read by a forward hook on decoder layer ``k - 1`` (for a
    model without ``set_aux_hidden_state_layers``)."""

    def speccompat_set_aux_layers(self, aux_ids: list[int]) -> str:
        import torch

        model = self.model_runner.get_model()
        if hasattr(model, "set_aux_hidden_state_layers"):
            raise RuntimeError(f"{type(model).__name__} has vLLM's aux hidden-state path (SupportsEagle3): "
                               "read its states there, not by layer hooks")
        layers = model.model.layers
        self._speccompat_aux = []
        current: dict[int, Any] = {}

        def hook(_mod: Any, _inp: Any, out: Any, k: int) -> None:
            if isinstance(out, tuple):
                if len(out) != 2:
                    raise RuntimeError(f"{type(_mod).__name__} returned a {len(out)}-tuple, not (hidden, residual)")
                out = out[0] + out[1]
            current[k] = out.detach().to("cpu", copy=True)
            if len(current) == len(aux_ids):
                self._speccompat_aux.append(torch.stack([current.pop(i) for i in aux_ids]))

        for k in aux_ids:
            layers[k - 1].register_forward_hook(lambda m, i, o, k=k: hook(m, i, o, k))
        return type(model).__name__


def _one_pass(llm: Any, sequences: list[list[int]], n_aux: int) -> list[dict[str, Any]]:
    import io

    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    results = []
    for seq in sequences:
        llm.generate([{"prompt_token_ids": list(seq)}], params, use_tqdm=False)
        forwards = torch.load(io.BytesIO(llm.collective_rpc("speccompat_take_aux")[0]))  # the first worker's
        if not forwards:
            raise RuntimeError("the model's forward returned no aux hidden states")
        first = forwards[0]  # the prefill; nothing else runs for max_tokens=1
        if first.shape[0] != n_aux or first.shape[1] < len(seq):
            raise RuntimeError(f"prefill of {len(seq)} tokens gave aux states of shape {tuple(first.shape)}")
        results.append({"input_ids": torch.tensor(seq), "hidden_states": [a[: len(seq)].clone() for a in first],
                        "forwards": len(forwards)})
    return results


def cpu_mla_rotary_fix(model: str) -> dict[str, Any]:
    """``compilation_config`` for an MLA model (DeepseekV2/V3, Kimi-K2/K2.5) on vLLM's CPU platform:
    the rotary custom op off. Its CPU kernel (``RotaryEmbedding.forward_cpu``) mis-rotates the
    strided ``[tokens, heads, 64]`` query view MLA passes (docs/parity.md, "Findings on the way";
    the ``vllm_0_28_0`` adapter does the same for speculators' engines). Without it the oracle's
    own states are wrong by rel 0.45-0.75 from the second token on. Empty elsewhere."""
    import os

    from vllm.platforms import current_platform

    config_file = os.path.join(model, "config.json")
    if not current_platform.is_cpu() or not os.path.isfile(config_file):
        return {}
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    text = config.get("text_config") or config
    return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if text.get("kv_lora_rank") else {}


#: A fixed KV cache for the oracles' engines (bytes), set where several engines start side by side on one GPU
#: (``scripts/gpu/device_run.sh proof``): vLLM's memory profiling assumes no other process frees GPU memory while
#: it measures (``gpu_worker.determine_available_memory``: "Error in memory profiling ... other processes sharing
#: the same container release GPU memory"), and another shard's engine exiting breaks that. The size of the KV
#: cache is all it changes: not one computation of the states.
ORACLE_KV_CACHE_ENV = "SPECCOMPAT_ORACLE_KV_CACHE_BYTES"


def fixed_kv_cache() -> dict[str, Any]:
    """``LLM(...)``'s ``kv_cache_memory_bytes`` from :data:`ORACLE_KV_CACHE_ENV`, when it is set."""
    value = os.environ.get(ORACLE_KV_CACHE_ENV, "")
    return {"kv_cache_memory_bytes": int(value)} if value else {}


def run(model: str, aux_ids: list[int], sequences: list[list[int]], *, repeat: int = 1,
        max_model_len: int = 1024, gpu_memory_utilization: float = 0.1, layer_hooks: bool = False,
        max_num_batched_tokens: int = 0) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(model=model, enforce_eager=True, max_model_len=max_model_len, enable_prefix_caching=False,
              max_num_batched_tokens=max_num_batched_tokens or max(2048, max_model_len), max_num_seqs=8,
              gpu_memory_utilization=gpu_memory_utilization, **cpu_mla_rotary_fix(model), **fixed_kv_cache(),
              worker_extension_cls="speccompat.testing.serving."
                                   + ("LayerHookExtension" if layer_hooks else "AuxCaptureExtension"))
    (model_class,) = llm.collective_rpc("speccompat_set_aux_layers", args=(list(aux_ids),))
    doc: dict[str, Any] = {"aux_ids": list(aux_ids), "model_class": model_class,
                           "oracle": "decoder-layer hooks" if layer_hooks else "aux hidden states",
                           "results": _one_pass(llm, sequences, len(aux_ids))}
    if repeat > 1:
        doc["repeat"] = _one_pass(llm, sequences, len(aux_ids))
    return doc


def native_engine_args(aux_ids: list[int], store: str, cpu_connector: bool = False) -> dict[str, Any]:
    """``LLM(...)`` arguments of vLLM's ``extract_hidden_states`` path, as speculators >= 0.5 and
    NVIDIA Model-Optimizer configure it: the aux ids in the draft config, ``ExampleHiddenStatesConnector``
    writing each request's states under ``store``, chunked prefill and prefix caching off.
    ``cpu_connector``: the same connector with its CUDA-stream copy done on the CPU
    (:mod:`speccompat.testing.native_cpu`)."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if cpu_connector:
        connector = {"kv_connector": "CpuHiddenStatesConnector",
                     "kv_connector_module_path": "speccompat.testing.native_cpu"}
    return {"enable_prefix_caching": False, "enable_chunked_prefill": False,
            "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": list(aux_ids)}}},
            "kv_transfer_config": {**connector, "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": store}}}


def run_native(model: str, aux_ids: list[int], sequences: list[list[int]], *, max_model_len: int = 1024,
               gpu_memory_utilization: float = 0.1, cpu_connector: bool = False) -> dict[str, Any]:
    """The same states through vLLM's ``extract_hidden_states`` (configured as speculators 0.5+ does:
    chunked prefill and prefix caching off, one token sampled), one request per sequence."""
    import shutil
    import tempfile

    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehs

    store = tempfile.mkdtemp(prefix="speccompat-native-")
    try:
        llm = LLM(model=model, enforce_eager=True, max_model_len=max_model_len,
                  max_num_batched_tokens=max(2048, max_model_len), max_num_seqs=8,
                  gpu_memory_utilization=gpu_memory_utilization, **cpu_mla_rotary_fix(model), **fixed_kv_cache(),
                  **native_engine_args(aux_ids, store, cpu_connector))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        results = []
        for seq in sequences:
            (out,) = llm.generate([{"prompt_token_ids": list(seq)}], params, use_tqdm=False)
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"extract_hidden_states returned no hidden_states_path: {out.kv_transfer_params}")
            data = ehs.load_hidden_states(path)
            states, ids = data["hidden_states"], data["token_ids"]
            if ids.tolist() != list(seq) or tuple(states.shape[:2]) != (len(seq), len(aux_ids)):
                raise RuntimeError(f"extract_hidden_states wrote states {tuple(states.shape)} for token ids "
                                   f"{ids.tolist()[:8]}... of a {len(seq)}-token sequence and {len(aux_ids)} aux ids")
            results.append({"input_ids": torch.tensor(seq), "forwards": None,
                            "hidden_states": [states[:, j].clone() for j in range(len(aux_ids))]})
            ehs.cleanup_hidden_states(path)
        arch = ",".join(llm.llm_engine.model_config.architectures or ["?"])
        return {"aux_ids": list(aux_ids), "model_class": f"{arch} via extract_hidden_states", "results": results}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--aux-ids", type=int, nargs="+", required=True)
    ap.add_argument("--sequences", required=True, help="JSON file: a list of token id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--native", action="store_true",
                    help="through vLLM's extract_hidden_states speculative method (its connector: GPU only)")
    ap.add_argument("--cpu-connector", action="store_true",
                    help="--native with the connector's CUDA-stream copy done on the CPU (speccompat.testing.native_cpu)")
    ap.add_argument("--layer-hooks", action="store_true",
                    help="read the states by forward hooks on the decoder layers (a model without SupportsEagle3)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: max(2048, max model length)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1,
                    help="on vLLM's CPU platform: the fraction of CPU memory for the KV cache")
    args = ap.parse_args()
    with open(args.sequences, encoding="utf-8") as f:
        sequences = json.load(f)
    if args.native:
        doc = run_native(args.model, args.aux_ids, sequences, max_model_len=args.max_model_len,
                         gpu_memory_utilization=args.gpu_memory_utilization, cpu_connector=args.cpu_connector)
    else:
        doc = run(args.model, args.aux_ids, sequences, repeat=args.repeat, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.gpu_memory_utilization, layer_hooks=args.layer_hooks,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    torch.save(doc, args.out)


if __name__ == "__main__":
    main()
