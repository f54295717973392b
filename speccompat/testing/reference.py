"""The parity oracle: hidden states of the same checkpoint computed by transformers.

For decoder layer ``i`` the reference is that layer's output (the residual stream after it, before
the final norm), taken with a forward hook - the same definition speculators uses, including the
last layer, whose ``output_hidden_states`` entry would have the final norm applied.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """A transformers model that returns per-layer residual streams for token sequences."""

    def __init__(self, path: str, dtype: str = "float32") -> None:
        import torch
        import transformers

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        cfg = transformers.AutoConfig.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
        self.num_layers = cfg.num_hidden_layers
        self.layers = self._find_layers(self.model)
        with open(f"{path}/config.json", encoding="utf-8") as f:
            self.llama_4_scaling = json.load(f).get("llama_4_scaling")

    @staticmethod
    def _find_layers(model: Any) -> Any:
        base = getattr(model, "model", model)
        return base.layers

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
                out[i] = h[0].detach().float().clone()

            handles.append(self.layers[i].register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([list(token_ids)]), use_cache=False)
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
        pos = torch.arange(n, dtype=torch.float32)
        scale = 1 + cfg["beta"] * torch.log(1 + torch.floor(pos / cfg["original_max_position_embeddings"]))

        def hook(_m: Any, _inp: Any, output: Any) -> Any:
            return output * scale.to(output.dtype)[None, :, None]

        return [layer.self_attn.q_b_proj.register_forward_hook(hook) for layer in self.layers]
