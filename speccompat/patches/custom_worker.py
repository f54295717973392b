"""Patches of ``speculators.data_generation.custom_worker``: the worker extension's capture,
replaced by :mod:`speccompat.capture`."""

from __future__ import annotations

from ..capture import get_captured_states, reset_capture, setup_hidden_states_capture, worker_info
from ..patching import Patch
from ._common import EXT_CLASS, NEVER_REMOVE, _named

__all__ = ["WORKER"]

WORKER = (
    Patch(
        id="worker._setup_hidden_states_capture",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._setup_hidden_states_capture",
        why="speculators replaces the base model's forward with a copy that drifts from vLLM's "
        "(embed_input_ids 0.11.1, llama_4_scaling 0.12.0, get_language_model shapes 0.15/0.16, "
        "SupportsEagle3 0.18.0, sequence-parallel MoE 0.25.0) and reads input_batch, which the "
        "V2 runner lacks (default from 0.22.0)",
        how="speccompat.capture: vLLM's forward runs; hooks on the decoder layers capture "
        "hidden_states + residual; batch order from the running runner, verified",
        vllm_change="0.11.1, 0.12.0, 0.15.0, 0.18.0, 0.22.0, 0.25.0",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(setup_hidden_states_capture, original),
    ),
    Patch(
        id="worker._reset_capture",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._reset_capture",
        why="pairs with the capture above",
        how="speccompat.capture.reset_capture",
        vllm_change="as above",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(reset_capture, original),
    ),
    Patch(
        id="worker._get_captured_states",
        upstream="https://github.com/vllm-project/speculators/issues/279",
        target=f"{EXT_CLASS}._get_captured_states",
        why="speculators slices by metadata it cannot verify; 0.3.0 returns one blob per layer",
        how="speccompat.capture.get_captured_states: verified per-request states, packed per layer",
        vllm_change="as above",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: _named(get_captured_states, original),
    ),
    Patch(
        id="worker._speccompat_info",
        upstream="none: speccompat's own check that spawned workers are patched",
        target=f"{EXT_CLASS}._speccompat_info",
        why="with spawned workers, patches applied in the driver do not exist in the workers",
        how="an RPC the driver calls right after the workers start, to check they run speccompat "
        "with the same adapter",
        vllm_change="none",
        remove_when="never",
        build=lambda ctx, original: worker_info,
        adds=True,
    ),
)
