"""The parity oracle: hidden states of the same checkpoint computed by transformers.

For decoder layer ``i`` the reference is that layer's output (the residual stream after it, before
the final norm), taken with a forward hook - the same definition speculators uses, including the
last layer, whose ``output_hidden_states`` entry would have the final norm applied.
"""

from __future__ import annotations

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

    @staticmethod
    def _find_layers(model: Any) -> Any:
        base = getattr(model, "model", model)
        return base.layers

    def hidden_states(self, token_ids: Sequence[int], layer_ids: Sequence[int]) -> list[Any]:
        """One float32 tensor [len(token_ids), hidden] per requested layer."""
        torch = self.torch
        out: dict[int, Any] = {}
        handles = []
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
