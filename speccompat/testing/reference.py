"""The parity oracle: hidden states of the same checkpoint computed by transformers.

For decoder layer ``i`` the reference is that layer's output (the residual stream after it, before
the final norm), taken with a forward hook - the same definition speculators uses, including the
last layer, whose ``output_hidden_states`` entry would have the final norm applied.

Kimi-K2.5 (``kimi_k25``) is transformers' own ``Kimi_K25ForConditionalGeneration``: the layers are
its language model's decoder layers, and text-only prompts go through its full forward (embedding,
no vision input). A checkpoint whose experts are compressed-tensors INT4 is first decompressed by
compressed-tensors (exactly, in float32) into a dense copy, which transformers then loads.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """A transformers model that returns per-layer residual streams for token sequences."""

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu") -> None:
        """``device``: where the forward runs (``cuda``: float32 matmuls in full float32, TF32 off; the
        states come back on the CPU either way)."""
        import torch
        import transformers

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference is float32, not TF32
            torch.backends.cudnn.allow_tf32 = False
        from .models import decompress_checkpoint, language_model

        with open(f"{path}/config.json", encoding="utf-8") as f:
            raw = json.load(f)
        if "quantization_config" in raw:
            self._dense = tempfile.TemporaryDirectory(prefix="speccompat-dense-")
            path = str(decompress_checkpoint(path, self._dense.name))
        cfg = transformers.AutoConfig.from_pretrained(path)
        if cfg.model_type == "kimi_k25":
            model, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
                path, dtype=self.dtype, output_loading_info=True)
            missing = sorted(info.get("missing_keys") or []) + sorted(info.get("unexpected_keys") or [])
            if missing:
                raise ValueError(f"{path}: transformers did not load these weights of the checkpoint: {missing[:8]}")
            self.model = model.eval()
            text = raw["text_config"]
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
            text = raw
        self.model = self.model.to(self.device)
        self.num_layers = cfg.get_text_config().num_hidden_layers
        self.layers = language_model(self.model).layers
        self.llama_4_scaling = text.get("llama_4_scaling")

    def hidden_states(self, token_ids: Sequence[int], layer_ids: Sequence[int]) -> list[Any]:
        """One float32 tensor [len(token_ids), hidden] per requested layer."""
        torch = self.torch
        out: dict[int, Any] = {}
        handles = []
        if self.llama_4_scaling:
            handles += self._llama_4_scaling_hooks(len(token_ids))
        for i in layer_ids:
            def hook(_m: Any, _inp: Any, output: Any, i: int = i) -> None:
                h = output[0] if isinstance(output, tuple) else output
                out[i] = h[0].detach().to("cpu", torch.float32, copy=True)

            handles.append(self.layers[i].register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([list(token_ids)], device=self.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return [out[i] for i in layer_ids]

    def _llama_4_scaling_hooks(self, n: int) -> list[Any]:
        """transformers' DeepseekV3 ignores ``llama_4_scaling``; apply it as vLLM does.

        vLLM (DeepseekV2 MLA, 0.12+) multiplies the whole query by
        ``1 + beta * log(1 + floor(position / original_max_position_embeddings))`` after RoPE; both
        are linear, so scaling the output of ``q_b_proj`` row by row is the same.
        """
        torch = self.torch
        cfg = self.llama_4_scaling
        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        scale = 1 + cfg["beta"] * torch.log(1 + torch.floor(pos / cfg["original_max_position_embeddings"]))

        def hook(_m: Any, _inp: Any, output: Any) -> Any:
            return output * scale.to(output.dtype)[None, :, None]

        return [layer.self_attn.q_b_proj.register_forward_hook(hook) for layer in self.layers]
