"""vLLM 0.17.0 - 0.26.x: Request without eos_token_id.

Also in this range, handled without version-gated code: SupportsEagle3 on DeepseekV2/Kimi (0.18.0;
speculators 0.3.0 refused those models through ``supports_eagle3``), and the V2 model runner,
opt-in since 0.12.0 and the default on GPU from 0.22.0 for more and more architectures. The V2
runner has no ``input_batch``, which speculators 0.4 reads to order captured tokens; speccompat
reads the batch order from whichever runner is running (:mod:`speccompat.capture`).
"""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_REPLACED, Change
from speccompat.probe import Symbol, fingerprint

from . import vllm_0_12_0 as prev


class Adapter(prev.Adapter):
    since = "0.17.0"
    changes = (
        Change(
            vllm="0.17.0",
            upstream=UPSTREAM_REPLACED,
            what="Request.__init__ drops eos_token_id (vllm/v1/request.py:60)",
            breaks="speculators 0.3/0.4 pass eos_token_id=: TypeError",
            how="request() drops the argument (stop conditions do not matter: max_tokens=1)",
            remove_when="never for speculators 0.3/0.4",
        ),
        Change(
            vllm="0.18.0",
            upstream="none: an improvement in vLLM, not a defect",
            what="DeepseekV2/V3 and KimiK25 implement SupportsEagle3 "
            "(vllm/model_executor/models/deepseek_v2.py:1297)",
            breaks="before it, speculators 0.3.0's supports_eagle3() check rejects DeepSeek and Kimi",
            how="capture does not depend on SupportsEagle3; it hooks decoder layers of any model",
            remove_when="n/a",
        ),
        Change(
            vllm="0.22.0",
            upstream=UPSTREAM_REPLACED,
            what="model runner V2 becomes the default on GPU (Qwen3 at 0.22, Llama at 0.23, all dense "
            "at 0.25, every model at 0.29); it has no input_batch (vllm/v1/worker/gpu/model_runner.py)",
            breaks="speculators 0.4's _store_captured_states reads model_runner.input_batch: "
            "AttributeError on the V2 runner",
            how="capture reads the batch order from the V1 input_batch or the V2 runner's "
            "per-step InputBatch, and verifies positions/token ids against it",
            remove_when="n/a",
        ),
    )
    requires = fingerprint(
        prev.Adapter.requires,
        [
            Symbol("vllm.v1.request:Request", accepts=("request_id", "prompt_token_ids", "sampling_params",
                                                       "pooling_params", "arrival_time", "block_hasher"),
                   rejects=("eos_token_id",), why="request"),
        ],
    )

    def request(self, cls: Any, **kw: Any) -> Any:
        kw.pop("eos_token_id", None)
        return cls(**kw)
