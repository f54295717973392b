"""vLLM 0.11.0: the release speculators 0.3.0 was written against (root of the adapter chain).

Everything later adapters override is implemented here the 0.11.0 way. Besides, three things are
fixed for every release, because speculators' own choices break on some platform or build:

- the KV block size: speculators hard-codes 16; the platform must choose it (CPU attention wants
  a multiple of 32 from 0.16, CPU MLA forces 16, CUDA FlashMLA 64), and the scheduler must use the
  size vLLM resolved, or it maps tokens to the wrong KV slots;
- prefix caching: 0.3.0 leaves it on (the V1 default); states must never come from another call;
- async scheduling: speculators drives the synchronous ``Scheduler`` by hand, so the config must
  say synchronous, or workers take the asynchronous output path.
"""

from __future__ import annotations

from typing import Any

from speccompat.adapter import UPSTREAM_BLOCK_SIZE, Change, Done
from speccompat.adapter import Adapter as _Base
from speccompat.errors import DriftError, HiddenStatesError
from speccompat.probe import Symbol, fingerprint

KV = "vllm.v1.core.kv_cache_utils"
EXEC = "vllm.v1.executor.multiproc_executor:MultiprocExecutor"
SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SCHED_OUT = "vllm.v1.core.sched.output"
MODELS = "vllm.model_executor.models"


class Adapter(_Base):
    since = "0.11.0"
    changes = (
        Change(
            vllm="0.11.0",
            upstream=UPSTREAM_BLOCK_SIZE,
            what="CacheConfig.block_size defaults to None and the platform picks it "
            "(vllm/platforms/cpu.py: 128 with IPEX, else 16; later releases differ per backend)",
            breaks="speculators passes block_size=16 to CacheConfig and to Scheduler: rejected by "
            "CPU attention from 0.30 ('No common block size for 16'), and a scheduler block size "
            "different from the KV cache's maps tokens to wrong slots",
            how="CacheConfig is built without speculators' block_size; Scheduler gets the size "
            "vLLM resolved (cache_config.block_size, checked against the KV cache group)",
            remove_when="never for speculators 0.3/0.4 (their constant is fixed at 16)",
        ),
        Change(
            vllm="0.11.0",
            upstream="none: speculators 0.4 disables it itself (CacheConfig(enable_prefix_caching=False)); "
            "0.3.0 gets no fix",
            what="V1 enables prefix caching by default (CacheConfig.enable_prefix_caching)",
            breaks="speculators 0.3.0 does not disable it; hidden states of repeated prefixes "
            "could come from KV computed in an earlier call",
            how="CacheConfig(enable_prefix_caching=False) for every speculators line",
            remove_when="never for speculators 0.3.0",
        ),
    )
    requires = fingerprint(
        [
            Symbol("vllm.config:CacheConfig", accepts=("block_size", "gpu_memory_utilization",
                                                       "enable_prefix_caching"), why="cache_config"),
            Symbol("vllm.config:SchedulerConfig", accepts=("max_num_seqs", "max_num_batched_tokens",
                                                           "max_model_len", "async_scheduling"),
                   rejects=("is_encoder_decoder",), why="scheduler_config"),
            Symbol("vllm.config:ModelConfig", accepts=("model", "tokenizer", "trust_remote_code",
                                                       "dtype", "max_model_len", "enforce_eager")),
            Symbol("vllm.config:ParallelConfig", accepts=("tensor_parallel_size", "worker_extension_cls")),
            Symbol("vllm.config:DeviceConfig"),
            Symbol("vllm.config:LoadConfig"),
            Symbol("vllm.config:VllmConfig", accepts=("model_config", "cache_config", "parallel_config",
                                                      "scheduler_config", "device_config", "load_config")),
            Symbol("vllm.sampling_params:SamplingParams", accepts=("max_tokens", "temperature")),
            Symbol(f"{KV}:get_kv_cache_config_from_groups",
                   accepts=("vllm_config", "kv_cache_groups", "kv_cache_specs", "available_memory"),
                   why="kv_cache_config_from_groups"),
            Symbol(f"{KV}:_get_kv_cache_groups_uniform_spec", positional=("kv_cache_specs",)),
            Symbol(f"{KV}:unify_hybrid_kv_cache_specs", positional=("kv_cache_spec",)),
            Symbol(f"{KV}:get_request_block_hasher", positional=("block_size|hash_block_size", "caching_hash_fn"),
                   why="speculators 0.4 calls it"),
            Symbol(f"{KV}:init_none_hash", positional=("hash_fn",)),
            Symbol("vllm.utils:get_hash_fn_by_name", positional=("hash_fn_name",),
                   why="speculators 0.4 imports it from vllm.utils.hashing (moved_names)"),
            Symbol(SCHED, accepts=("vllm_config", "kv_cache_config", "structured_output_manager"),
                   rejects=("block_size",), why="scheduler"),
            Symbol(f"{SCHED}.schedule"),
            Symbol(f"{SCHED}.add_request", positional=("request",)),
            Symbol(f"{SCHED}.update_from_output", positional=("scheduler_output", "model_runner_output"),
                   why="generate: finish each request when its prefill is done"),
            Symbol(f"{SCHED}.finish_requests", positional=("request_ids", "finished_status")),
            Symbol("vllm.v1.request:Request", accepts=("request_id", "prompt_token_ids", "sampling_params",
                                                       "pooling_params", "eos_token_id", "arrival_time",
                                                       "block_hasher"), why="request"),
            Symbol("vllm.v1.request:RequestStatus.FINISHED_ABORTED"),
            Symbol("vllm.v1.structured_output:StructuredOutputManager", accepts=("vllm_config",)),
            Symbol(EXEC, accepts=("vllm_config",), why="executor"),
            Symbol(f"{EXEC}.collective_rpc", accepts=("method", "args", "unique_reply_rank"), positional=("method",),
                   rejects=("kv_output_aggregator",), why="unique_reply: list reply"),
            Symbol(f"{EXEC}.execute_model", positional=("scheduler_output",), why="submit"),
            Symbol(f"{EXEC}.sample_tokens", absent=True, why="execute: one phase"),
            Symbol(f"{EXEC}.initialize_from_config", positional=("kv_cache_configs",)),
            Symbol(f"{EXEC}.shutdown"),
            Symbol("vllm.v1.worker.gpu_worker:Worker.get_kv_cache_spec",
                   why="speculators' __init__ calls collective_rpc('get_kv_cache_spec')"),
            Symbol("vllm.distributed:get_tp_group", why="worker capture: TP rank 0 keeps the states"),
            Symbol("vllm.distributed:get_pp_group", why="speculators' worker module imports it"),
            Symbol("vllm.sequence:IntermediateTensors", called=False, why="speculators' worker module imports it"),
            Symbol("vllm.model_executor.models.interfaces:supports_eagle3", positional=("model",),
                   why="speculators 0.3.0's worker module calls it"),
            Symbol("vllm.distributed:tensor_model_parallel_all_gather", positional=("input_", "dim"),
                   why="worker capture: SP shards"),
            Symbol("vllm.platforms:current_platform"),
            # Worker side: what speccompat.capture reads of the runner and the scheduler output.
            Symbol(f"{RUNNER}.execute_model", accepts=("scheduler_output",), called=False,
                   why="worker: capture wraps it"),
            Symbol("vllm.v1.worker.gpu_input_batch:InputBatch.req_ids", why="worker: batch_order (V1 runner)"),
            Symbol(f"{SCHED_OUT}:SchedulerOutput", accepts=("scheduled_new_reqs", "num_scheduled_tokens",
                                                           "total_num_scheduled_tokens"), called=False,
                   why="worker: step_of"),
            Symbol(f"{SCHED_OUT}:NewRequestData", accepts=("req_id", "prompt_token_ids"), called=False,
                   why="worker: step_of"),
            Symbol("vllm.v1.utils:CpuGpuBuffer", accepts=("dtype", "device"), called=False,
                   why="worker: step_token_ids reads runner.input_ids.gpu"),
            Symbol("vllm.model_executor.models.interfaces:SupportsMultiModal.get_language_model",
                   why="worker: decoder_layers under a multimodal wrapper"),
        ]
    )

    # Decoder-layer classes of the architectures speccompat proves, by what their forward returns
    # in this range (vllm/model_executor/models/<file>.py, ``return hidden_states, residual``).
    layer_outputs = {
        f"{MODELS}.{module}:{cls}": "hidden+residual"
        for module, cls in (
            ("llama", "LlamaDecoderLayer"),
            ("mistral", "MistralDecoderLayer"),
            ("llama4", "Llama4DecoderLayer"),
            ("qwen2", "Qwen2DecoderLayer"),
            ("qwen3", "Qwen3DecoderLayer"),
            ("qwen3_moe", "Qwen3MoeDecoderLayer"),
            ("deepseek_v2", "DeepseekV2DecoderLayer"),  # DeepseekV3, Kimi-K2/K2.5's language model
            ("gemma3", "Gemma3DecoderLayer"),
            ("glm4_moe", "Glm4MoeDecoderLayer"),
            ("gpt_oss", "TransformerBlock"),  # ``return output, residual``
        )
    }

    # ------------------------------------------------------------------------------ import time
    def moved_names(self) -> dict[tuple[str, str], str]:
        # speculators 0.4 imports get_hash_fn_by_name from where 0.11.1 put it.
        return {("vllm.utils.hashing", "get_hash_fn_by_name"): "vllm.utils"}

    # ------------------------------------------------------------------------------ config time
    def cache_config(self, cls: Any, **kw: Any) -> Any:
        kw.pop("block_size", None)
        kw["enable_prefix_caching"] = False
        return cls(**kw)

    def scheduler_config(self, cls: Any, **kw: Any) -> Any:
        # SchedulerConfig has no is_encoder_decoder yet (speculators 0.4 passes it).
        kw.pop("is_encoder_decoder", None)
        kw["async_scheduling"] = False
        return cls(**kw)

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        # 0.11.x still requires kv_cache_specs; speculators 0.4 no longer passes it. It is exactly
        # the per-layer spec of the groups, so rebuild it from them.
        if kw.get("kv_cache_specs") is None:
            kw["kv_cache_specs"] = {
                layer: group.kv_cache_spec for group in kw["kv_cache_groups"] for layer in group.layer_names
            }
        return fn(**kw)

    @staticmethod
    def resolved_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
        """The block size of the KV cache the workers built, made the config's, as EngineCore does.

        Workers may change the block size after loading the model (vLLM 0.18+:
        ``update_block_size_for_backend``), so the driver's config can be stale; the KV cache
        specs the workers reported are the truth.
        """
        sizes = [g.kv_cache_spec.block_size for g in getattr(kv_cache_config, "kv_cache_groups", ())]
        if sizes:
            vllm_config.cache_config.block_size = min(sizes)
        return int(vllm_config.cache_config.block_size)

    def scheduler(self, cls: Any, **kw: Any) -> Any:
        self.resolved_block_size(kw["vllm_config"], kw["kv_cache_config"])
        kw.pop("block_size", None)  # no block_size parameter yet
        return cls(**kw)

    def request(self, cls: Any, **kw: Any) -> Any:
        return cls(**kw)

    # ---------------------------------------------------------------------------- executor life
    def submit(self, executor: Any, scheduler_output: Any) -> Any:
        return Done(executor.execute_model(scheduler_output))

    def in_flight(self, executor: Any) -> int:
        # One-phase execution: steps stay synchronous (the overlap needs sample_tokens' future).
        return 1

    # ------------------------------------------------------------------------------ worker side
    def decoder_layers(self, model: Any) -> tuple[Any, Any]:
        # Text models: model.model.layers. Multimodal wrappers: get_language_model() returns a
        # CausalLM (Kimi-K2.5 from 0.16) or a bare base model (0.15.x).
        candidates = []
        if hasattr(model, "get_language_model"):
            try:
                lm = model.get_language_model()
            except Exception:  # noqa: BLE001 - some wrappers raise when they have no LM
                lm = None
            if lm is not None:
                candidates += [getattr(lm, "model", None), lm]
        candidates += [getattr(model, "model", None), model]
        for cand in candidates:
            if cand is not None and hasattr(cand, "layers") and hasattr(cand, "forward"):
                return cand, cand.layers
        raise HiddenStatesError(
            f"cannot find decoder layers in {type(model).__name__} "
            "(looked at get_language_model().model, get_language_model(), .model and the model itself)"
        )

    def step_of(self, scheduler_output: Any) -> tuple[dict[str, int], int, dict[str, list[int]]]:
        so = scheduler_output
        try:
            scheduled = dict(so.num_scheduled_tokens)
            total = int(so.total_num_scheduled_tokens)
            new = {r.req_id: list(r.prompt_token_ids) for r in so.scheduled_new_reqs
                   if r.prompt_token_ids is not None}
        except AttributeError as exc:
            raise _worker_drift(f"{SCHED_OUT}:SchedulerOutput", exc) from exc
        return scheduled, total, new

    def is_warm_up(self, scheduler_output: Any, kwargs: dict[str, Any]) -> bool:
        return scheduler_output is None

    def watch_batch(self, runner: Any, on_batch: Any) -> list[tuple[Any, str, Any]]:
        if not hasattr(runner, "input_batch"):
            raise _worker_drift("vllm.v1.worker.gpu_input_batch:InputBatch.req_ids",
                                AttributeError(f"{type(runner).__name__} has no input_batch"))
        return []

    def batch_order(self, runner: Any, batch: Any) -> list[str | None]:
        return list(runner.input_batch.req_ids)

    def step_positions(self, positions: Any) -> Any:
        return positions[0] if positions.dim() > 1 else positions  # M-RoPE: (3, num_tokens)

    def step_token_ids(self, runner: Any, batch: Any, num_tokens: int) -> Any:
        # With inputs_embeds the V1 runner still stages the step's token ids in its input_ids
        # buffer (a CpuGpuBuffer; _prepare_inputs copies them to .gpu before the forward).
        buf = getattr(getattr(runner, "input_ids", None), "gpu", None)
        return buf[:num_tokens] if buf is not None else None

    def gather_layer_output(self, stream: Any, num_tokens_padded: int, tp_size: int) -> Any:
        if stream.shape[0] < num_tokens_padded and tp_size > 1:
            # Sequence-parallel MoE (DeepseekV2 with expert parallelism, 0.25+) keeps a token shard
            # per TP rank between layers.
            from vllm.distributed import tensor_model_parallel_all_gather

            stream = tensor_model_parallel_all_gather(stream.contiguous(), 0)
        return stream

    def unique_reply(self, reply: Any) -> Any:
        if not isinstance(reply, list) or len(reply) != 1:
            raise DriftError(
                "collective_rpc(unique_reply_rank=0) was expected to return a one-element list "
                f"on this vLLM, got {type(reply).__name__}",
                symbol=f"{EXEC}.collective_rpc",
                problem="reply shape",
            )
        return reply[0]


def _worker_drift(symbol: str, exc: Exception) -> DriftError:
    return DriftError(f"vLLM's worker objects differ from what this adapter reads: {symbol}: {exc}",
                      symbol=symbol, problem=str(exc))
