"""Stand-ins for names that speculators imports at ``import speculators`` time and that newer
libraries removed. They exist so that the import (and the hidden-state extraction, which never
calls them) works; calling one raises a clear error naming what to install instead."""

from __future__ import annotations

from typing import Any

__all__ = ["_prepare_4d_causal_attention_mask"]


def _prepare_4d_causal_attention_mask(*args: Any, **kwargs: Any) -> Any:
    """Removed from transformers in 5.24 (``transformers.modeling_attn_mask_utils``).

    speculators 0.3/0.4 import it in ``speculators/models/eagle.py`` (EAGLE-1 training forward),
    so ``import speculators`` failed with transformers >= 5.24. Hidden-state extraction does not
    use it.
    """
    raise NotImplementedError(
        "speculators' EAGLE-1 model calls transformers' _prepare_4d_causal_attention_mask, which "
        "transformers removed in 5.24; install transformers<5.24 to train that model with "
        "speculators 0.3/0.4 (hidden-state extraction does not need it)"
    )
