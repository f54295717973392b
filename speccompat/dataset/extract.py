"""``speccompat extract``: the hidden states of tokenized samples, one file each (EAGLE-3 step 2).

Arguments -> :class:`ExtractConfig` -> checks (:mod:`.preflight`: what config.json decides, before
anything starts or is written) -> samples -> generator -> writer. speculators'
``VllmHiddenStatesGenerator`` (made to work on this vLLM by ``speccompat.apply()``) is fed
continuously (:func:`speccompat.generator.stream`): samples are admitted to the engine as it frees
slots, up to a token budget taken from ``--max-in-flight-gb``, and each sample's states go to the
writer as soon as the step that completed it ran, so no call boundary leaves the engine idle. The
data-set machinery (``speccompat.dataset``) checks the input, the output directory and what
produced it before the engine starts, writes each sample in the background, and resumes. The example drivers
(``examples/kimi_k25/extract_hidden_states.py``, ``examples/llama/``) run this command.

    speccompat extract --model-path /models/Kimi-K2.5 --prepared-data data.jsonl \
        --output-dir hs/ --tp-size 8 --layer-ids 2 30 58 60 --max-seq-len 2048

Exit status: 0 every sample has its file; 1 some samples failed, the engine failed or the disk
filled up (finished files are kept: re-run to resume; a KV cache too small for the samples is a
setting to change, named in the message); 2 refused before any engine started or anything was
written; 130 interrupted.

Only the standard library is imported at module level: vLLM's workers start with ``spawn`` and
re-import the script that runs this, which must stay cheap and side-effect free. Imports are
absolute so that this file also runs as a script (``speccompat.dataset.parallel`` starts one per engine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .args import DeprecatedFlag, positive_finite, positive_int
from .spec import LAYOUTS, SAFETENSORS

DESCRIPTION = "Extract EAGLE-3 training hidden states (one file per sample)."

logger = logging.getLogger("speccompat.extract")
#: Per-layer statistics are logged for this many samples at the start of a run.
STATS_SAMPLES = 3
#: A progress line at most this often (and after the last batch).
PROGRESS_EVERY_S = 30.0


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    add_arguments(ap)
    return ap.parse_args(argv)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, but for switches (``--no-progress``, ``--overwrite``),
    whose "default: True" would read as the switch being on."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help or ""
        return super()._get_help_string(action)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of ``speccompat extract`` (and of the example drivers, which are this command)."""
    ap.add_argument("--model-path", required=True, type=model_path,
                    help="checkpoint directory (or hub id) of the target model")
    ap.add_argument("--prepared-data", required=True, type=Path,
                    help='JSONL from prepare_data.py: {"id", "input_ids", "loss_mask"?} per line')
    ap.add_argument("--output-dir", required=True, type=output_dir, help="the data set; re-running resumes")
    ap.add_argument("--layout", choices=LAYOUTS, default=SAFETENSORS,
                    help="safetensors: <id>.safetensors per sample; speculators: data_<i>.pt and "
                         "data_config.json as speculators' own data_generation_offline.py writes them "
                         "(speculators 0.3/0.4); speculators-arrow: the Arrow dataset + hidden_states/hs_<row>"
                         ".safetensors speculators >= 0.5 trains on (layers ascending, the last the final "
                         "layer; needs speccompat[arrow])")
    ap.add_argument("--format", dest="layout", choices=LAYOUTS, action=DeprecatedFlag, new="--layout",
                    help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=positive_int, default=None,
                    help="accepted for older commands, no longer used: samples are admitted to the engine as it "
                         "frees slots (the in-flight budget is --max-in-flight-gb)")
    ap.add_argument("--max-seq-len", type=positive_int, default=2048,
                    help="longest sequence kept whole (the engine gets max_model_len = this + 1)")
    ap.add_argument("--tp-size", type=positive_int, default=1, help="tensor parallel size (GPUs)")
    ap.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8,
                    help="fraction of GPU memory vLLM may use (on CPU: use a small value, e.g. 0.1)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="decoder layers to capture; default: speculators' choice [2, L//2, L-3, L-1]")
    ap.add_argument("--limit", type=positive_int, default=None, help="use only the first N valid samples")
    ap.add_argument("--overwrite", action="store_true",
                    help="start the data set anew: redo every sample, also when the model or settings changed")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "fp8"), default="bfloat16",
                    help="dtype of the saved hidden states (the model runs in its checkpoint dtype); fp8: "
                         "float8_e4m3fn with float32 scales, hs-connectors' fp8 schema (speculators >= 0.9 "
                         "reads it with --hidden-states-backend fp8), about half the bytes of bfloat16; "
                         "not for --layout speculators (0.3/0.4 cannot read it); docs/dataset.md")
    ap.add_argument("--fp8-scale", choices=("token", "token-layer"), default=None,
                    help="--dtype fp8 only: one scale per token over all stored layers ([n,1,1], hs-connectors' "
                         "own; the default), or one per token and layer ([n,layers,1]: 4 more bytes per token and "
                         "layer)")
    ap.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail",
                    help="corrupt input lines: skip them with a warning, or stop before the engine starts")
    ap.add_argument("--on-long-line", choices=("truncate", "skip", "fail"), default="truncate",
                    help="lines longer than --max-seq-len: keep the first max-seq-len tokens, skip, or stop")
    ap.add_argument("--writer-threads", type=positive_int, default=default_writer_threads(),
                    help="threads writing files (default: one per CPU this process may use, 2 to 16; "
                         "%(default)s here)")
    ap.add_argument("--max-in-flight-gb", type=positive_finite, default=8.0,
                    help="memory for states in flight: half for samples admitted to the engine and not yet "
                         "handed out, half for results not yet written (beyond it the engine waits)")
    ap.add_argument("--token-freq-path", type=Path, default=None,
                    help="--layout speculators: token-frequency file (default: <output-dir>.token_freq.pt)")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO",
                    help="the least severe log lines shown (on stderr)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar (it shows on a terminal when tqdm is installed)")
    sc = ap.add_argument_group("scale-out (docs/scale-out.md)")
    sc.add_argument("--num-shards", type=shard_count, default=None,
                    help="split the input into N shards by a hash of each id; every shard writes its own manifest "
                         "part into --output-dir. 'auto': N and the index from a SLURM job array "
                         "(SLURM_ARRAY_TASK_COUNT/ID), else WORLD_SIZE/RANK. Not given: the whole input (the "
                         "environment is not read)")
    sc.add_argument("--shard-index", type=int, default=None, help="this process's shard, 0..N-1")
    sc.add_argument("--data-parallel-size", type=positive_int, default=1,
                    help="engines of --tp-size GPUs each, one shard each, side by side on this host "
                         "(or Ray actors with --ray); the data set is merged when all have finished")
    sc.add_argument("--engines-per-gpu", type=positive_int, default=1,
                    help="engines sharing each group of --tp-size GPUs (a model much smaller than a GPU); "
                         "give each its share with --gpu-memory-utilization (at most 1/N)")
    sc.add_argument("--ray", action="store_true",
                    help="run the --data-parallel-size engines as Ray actors on an existing cluster")
    sc.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                    help="the Ray cluster (host:port, auto, or local: a one-node cluster in this process)")


def default_writer_threads() -> int:
    """Writer threads when ``--writer-threads`` is not given: one per CPU this process may run on, at
    least 2 and at most 16. Each thread spends most of its time in ``write`` and ``fsync`` with the
    GIL released, so a disk with deep queues takes more files at once. On the 16-core H200 host,
    16 threads wrote 1.81 GB/s to its local disk against 1.68 GB/s with 8 (one run), and beside 16
    the driver's engine phase was 0.95-0.96 of plain prefill, as it was beside 8 in an earlier lease
    (benchmarks/NOTES.md, "Writer threads and the prepared input")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 4
    return max(2, min(16, cpus))


def model_path(text: str) -> str:
    """``--model-path``: a checkpoint directory or a Hugging Face id (``name`` or ``org/name``); a
    path that names no directory here is refused, naming it (rather than the hub's complaint about
    the id it is not)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give the model's checkpoint directory or hub id")
    path = Path(text).expanduser()
    if path.is_dir():
        return text
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} is not a directory (a checkpoint is a directory with config.json)")
    looks_local = text.startswith(("/", ".", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
    if looks_local:
        raise argparse.ArgumentTypeError(f"{text} does not exist (a local checkpoint directory; a hub id is "
                                         "name or org/name)")
    return text


def output_dir(text: str) -> Path:
    """``--output-dir``: a directory to make or resume; an empty value (which would be the current
    directory) is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name the data set's directory (it would be the current one)")
    return Path(text)


def shard_count(text: str) -> int | str:
    """``--num-shards``: a whole number >= 1, or ``auto`` (from a SLURM job array or WORLD_SIZE/RANK)."""
    return "auto" if text == "auto" else positive_int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


@dataclass(frozen=True)
class ExtractConfig:
    """One extraction job (the flags of ``speccompat extract``)."""

    model_path: str
    prepared_data: Path
    output_dir: Path
    layout: str = "safetensors"
    batch_size: int | None = None  # no longer used (the engine is fed continuously); kept for older callers
    max_seq_len: int = 2048
    tp_size: int = 1
    gpu_memory_utilization: float = 0.8
    layer_ids: list[int] | None = None
    limit: int | None = None
    overwrite: bool = False
    dtype: str = "bfloat16"
    fp8_scale: str | None = None  # --dtype fp8: None is "token"
    on_bad_line: str = "fail"
    on_long_line: str = "truncate"
    writer_threads: int = dataclasses.field(default_factory=default_writer_threads)
    max_in_flight_gb: float = 8.0
    token_freq_path: Path | None = None
    log_level: str = "INFO"
    num_shards: int | str | None = None  # 'auto': from the environment (docs/scale-out.md)
    shard_index: int | None = None
    data_parallel_size: int = 1
    engines_per_gpu: int = 1
    ray: bool = False
    ray_address: str = "auto"
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExtractConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def stored_spec(self, layer_ids: list[int], hidden_size: int) -> Any:
        """What this run stores (:class:`~speccompat.dataset.spec.StoredSpec`): ``--dtype`` and
        ``--fp8-scale`` for ``layer_ids`` of a model of ``hidden_size``. Built once, in
        :func:`extract`, and passed to the provenance, the directory and the writer."""
        from speccompat.dataset.spec import StoredSpec

        return StoredSpec.of_options(self.dtype, layer_ids, hidden_size, self.fp8_scale)

    def to_argv(self) -> list[str]:
        """The flags of ``speccompat extract`` for this job (those whose value is not the default):
        ``ExtractConfig.from_args(parse_args(cfg.to_argv())) == cfg``."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if value == default:  # a machine-dependent default is left for the machine that runs the job
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "progress":
                argv.append("--no-progress")
            elif isinstance(value, bool):
                argv.append(flag)
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        return argv

    def engine_configs(self, outer: Any) -> list[ExtractConfig]:
        """``--data-parallel-size D`` within shard ``outer`` (a ``ShardSpec``) K of N: one job per
        engine, shards K*D .. K*D+D-1 of N*D, each a single engine on its own."""
        D = self.data_parallel_size
        total = outer.num_shards * D
        return [dataclasses.replace(self, num_shards=total, shard_index=outer.index * D + d, data_parallel_size=1,
                                    engines_per_gpu=1, ray=False, ray_address=ExtractConfig.ray_address)
                for d in range(D)]

    @property
    def max_model_len(self) -> int:
        """What the engine gets: speculators keeps max_model_len - 1 tokens (one slot is reserved for
        the single sampled token), so +1 keeps sequences of exactly ``max_seq_len`` whole."""
        return self.max_seq_len + 1


def check_settings(cfg: ExtractConfig) -> Any:
    """:func:`~speccompat.dataset.preflight.preflight` on the model's config.json and
    :func:`~speccompat.dataset.preflight.machine_problems`, and the layer ids against its layers; raises
    ``Rejected`` naming every problem. Returns ``(ModelInfo, layer ids)``."""
    from speccompat.dataset import Rejected, read_model_info
    from speccompat.dataset.layouts import layout_named
    from speccompat.dataset.preflight import machine_problems, preflight, tokenizer_config
    from speccompat.layers import LayerIdsError, _config_dict, resolve_layer_ids

    info = read_model_info(cfg.model_path)
    problems = preflight(cfg, _config_dict(cfg.model_path), tokenizer_config(cfg.model_path))
    problems += machine_problems(cfg)
    from speccompat.dataset.directory import DatasetDir

    if (why := DatasetDir(cfg.output_dir).token_freq_problem(cfg.token_freq_path)) is not None:
        problems.append(why)
    try:
        layer_ids = resolve_layer_ids(cfg.layer_ids, info.num_layers)
    except LayerIdsError as exc:
        problems.append(f"--layer-ids: {exc}")
        layer_ids = []
    if layer_ids:
        try:  # a layout refuses a layer set it cannot store (speculators-arrow: also without datasets/pyarrow)
            layout_named(cfg.layout, layer_ids, info.num_layers)
        except Rejected as exc:
            problems.append(str(exc))
    from speccompat.dataset.fp8 import refuse

    if why := refuse(cfg.dtype, cfg.layout):  # a torch without float8_e4m3fn; the 0.3/0.4 layout
        problems.append(why)
    if cfg.fp8_scale is not None and cfg.dtype != "fp8":
        problems.append(f"--fp8-scale {cfg.fp8_scale} applies to --dtype fp8 only (this run stores {cfg.dtype}): "
                        "drop it, or pass --dtype fp8")
    if problems:
        raise Rejected("the settings do not fit the model (nothing was started or written):\n  "
                       + "\n  ".join(problems))
    return info, layer_ids


def start_generator(args: ExtractConfig, layer_ids: list[int]) -> Any:
    """speculators' generator (speccompat was applied before); this starts vLLM's workers."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    logger.info("starting the engine: %s, TP %d, layers %s, max_model_len %d", args.model_path, args.tp_size,
                layer_ids, args.max_model_len)
    return VllmHiddenStatesGenerator(
        args.model_path, layer_ids=layer_ids,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tp_size)


def stop_generator(gen: Any) -> None:
    executor = getattr(gen, "executor", None)
    if executor is not None:
        gen.executor = None
        with contextlib.suppress(Exception):
            executor.shutdown()


def in_flight_tokens(args: ExtractConfig, info: Any, layer_ids: list[int]) -> int:
    """Prompt tokens of samples admitted to the engine and not yet handed out: half of
    ``--max-in-flight-gb`` at the states' size per token (the other half is the writer's), at least
    one longest sample."""
    per_token = len(layer_ids) * info.hidden_size * 4  # the engine's states: at most 4 bytes a value
    return max(args.max_model_len, int(args.max_in_flight_gb * 1e9 / 2 / per_token))


def stream_results(gen: Any, todo: list[Any], budget_tokens: int) -> Any:
    """``(sample, states or the exception that failed it)`` for every sample of ``todo``, in the
    order the engine completes them, the engine fed continuously (:func:`speccompat.generator.stream`,
    views of the workers' staging memory, written from there).

    A sample the stream rejects (non-finite states, a token the capture cannot place) stops the
    stream; the samples it had read and not handed out are then run one at a time, so that only the
    bad one fails, and the stream goes on with the rest. So do the samples of a step whose token ids
    could not be verified against the prompts (``unverified_steps``). A KV cache too small for one
    sample alone (``KVCacheTooSmall``) is raised: it is a setting."""
    from speccompat.errors import HiddenStatesError, KVCacheTooSmall
    from speccompat.generator import stream

    start = 0
    while start < len(todo):
        part, read, handed = todo[start:], [0], set()

        def inputs(part: list[Any] = part, read: list[int] = read) -> Any:
            for sample in part:
                read[0] += 1
                yield list(sample.input_ids)

        unverified = 0
        try:
            for index, states, stats in stream(gen, inputs(), max_in_flight_sequences=None,
                                               max_in_flight_tokens=budget_tokens, copy=False):
                if stats.get("unverified_steps", 0) > unverified:
                    raise HiddenStatesError(f"{stats['unverified_steps'] - unverified} engine step(s) could not be "
                                            "verified against the prompts (unverified_steps): the states of the "
                                            "samples in flight may belong to other tokens")
                handed.add(index)
                yield part[index], states
            return
        except KVCacheTooSmall:
            raise
        except HiddenStatesError as exc:
            suspects = [i for i in range(read[0]) if i not in handed]
            logger.warning("%s; running the %d sample(s) in flight one at a time", exc, len(suspects))
            for i in suspects:
                yield part[i], generate_one(gen, part[i])
            start += read[0]


def kv_cache_tokens(gen: Any) -> int | None:
    """Tokens the started engine's KV cache holds (its blocks times the block size), where the
    scheduler says so plainly (one KV cache group); None where it cannot be told."""
    sched = getattr(gen, "scheduler", None)
    config = getattr(sched, "kv_cache_config", None)
    blocks = getattr(config, "num_blocks", None)
    groups = getattr(config, "kv_cache_groups", None)
    block = getattr(sched, "block_size", None) or getattr(getattr(sched, "cache_config", None), "block_size", None)
    if not (type(blocks) is int and type(block) is int and blocks > 0 and block > 0):
        return None
    try:
        if len(groups) != 1:  # several attention types share the blocks: no plain rule here
            return None
    except TypeError:
        return None
    return blocks * block


def kv_cache_problem(gen: Any, todo: list[Any]) -> str | None:
    """Why the started engine cannot run the longest sample of ``todo`` at all (its KV cache holds
    fewer tokens), before any sample runs; None when it can or when the cache cannot be told."""
    capacity = kv_cache_tokens(gen)
    longest = max((s.num_tokens for s in todo), default=0)
    if capacity is not None:
        logger.info("the engine's KV cache holds %d tokens; the longest sample to extract has %d", capacity, longest)
    if capacity is None or longest <= capacity:
        return None
    over = sum(s.num_tokens > capacity for s in todo)
    return (f"the engine's KV cache holds {capacity} tokens, fewer than the longest sample ({longest} tokens; "
            f"{over} of the {len(todo)} samples to extract are longer): the KV cache is too small for them")


def generate_one(gen: Any, sample: Any) -> Any:
    """One sample's states through ``generate()``, or the exception that failed it: a rejected
    sample, or a call with steps whose token ids could not be verified (``unverified_steps``). A KV
    cache too small for the sample alone (``KVCacheTooSmall``) is raised: it is a setting."""
    from speccompat.errors import HiddenStatesError, KVCacheTooSmall

    try:
        # copy=False (speccompat's generate): views of the worker's shared-memory buffer, written to
        # disk straight from there; the buffer is not reused while the writer still holds them
        (result,) = gen.generate([list(sample.input_ids)], copy=False)
    except KVCacheTooSmall:
        raise
    except HiddenStatesError as exc:
        return exc
    unverified = (getattr(gen, "_speccompat_stats", None) or {}).get("unverified_steps", 0)
    if unverified:
        return HiddenStatesError(f"{unverified} engine step(s) could not be verified against the prompts "
                                 "(unverified_steps): its hidden states may belong to other tokens")
    return result["hidden_states"]


def log_layer_stats(sample: Any, layer_ids: list[int], states: list[Any]) -> None:
    for i, h in zip(layer_ids, states, strict=True):
        x = h.float()
        logger.info("stats id %r layer %d: min %.4g max %.4g mean %.4g std %.4g", sample.id, i, x.min().item(),
                    x.max().item(), x.mean().item(), x.std().item())


def extract(args: ExtractConfig) -> int:
    import speccompat
    from speccompat.dataset import (
        Rejected,
        collect_provenance,
        open_dataset,
        report_scan,
        scan_jsonl,
    )
    from speccompat.dataset.shards import open_shard, resolve_shard

    started = time.monotonic()
    info, layer_ids = check_settings(args)
    if args.batch_size is not None:
        logger.warning("--batch-size %d is no longer used: samples are admitted to the engine as it frees slots "
                    "(the budget in flight is --max-in-flight-gb)", args.batch_size)
    shard = resolve_shard(args.num_shards, args.shard_index)
    if shard.num_shards > 1:
        logger.info("%s", shard)
    status = speccompat.apply()  # cheap: imports neither torch nor vLLM
    if status.state not in ("armed", "active"):
        raise Rejected(f"speccompat could not adapt this installation ({status.state}): "
                       + "; ".join(status.warnings + status.errors))
    scan = scan_jsonl(args.prepared_data, vocab_size=info.vocab_size, max_seq_len=args.max_seq_len,
                      on_bad=args.on_bad_line, on_long=args.on_long_line, limit=args.limit)
    report_scan(scan, args.max_seq_len)
    spec = args.stored_spec(layer_ids, info.hidden_size)
    prov = collect_provenance(model_path=args.model_path, info=info, spec=spec, max_seq_len=args.max_seq_len,
                              on_long_line=args.on_long_line, tensor_parallel_size=args.tp_size, layout=args.layout,
                              status=status)
    extra = {"train_data_path": str(args.prepared_data), "gpu_memory_utilization": args.gpu_memory_utilization,
             "max_samples": args.limit}
    if shard.num_shards > 1:
        ds = open_shard(args.output_dir, scan.samples, prov, shard, spec=spec, overwrite=args.overwrite,
                        speculators_version=status.speculators.get("raw"), extra=extra)
    else:
        ds = open_dataset(args.output_dir, scan.samples, prov, spec=spec, overwrite=args.overwrite,
                          speculators_version=status.speculators.get("raw"), extra=extra)
    with ds:  # the directory's lock, released whatever happens below
        return _extract_into(ds, args, shard, info, layer_ids, started)


def _extract_into(ds: Any, args: ExtractConfig, shard: Any, info: Any, layer_ids: list[int], started: float) -> int:
    from speccompat.dataset import EXIT_FAILED, EXIT_OK, WriterFailed
    from speccompat.dataset.fp8 import flushed_note
    from speccompat.dataset.fsutil import human
    from speccompat.errors import KVCacheTooSmall

    if not ds.todo:
        if shard.num_shards == 1:
            ds.finish(args.token_freq_path)
        logger.info("nothing to do: every sample%s has an intact file in %s",
                    f" of shard {shard.index} of {shard.num_shards}" if shard.num_shards > 1 else "", args.output_dir)
        print_result(closing_advice(args, layer_ids, info.num_layers))
        return EXIT_OK

    t0 = time.monotonic()
    try:
        gen = start_generator(args, layer_ids)
    except ImportError as exc:  # what speculators' generator or vLLM imports is missing: one line, no traceback
        logger.error("the engine did not start (nothing was written): %s: %s; install it into this environment",
                     type(exc).__name__, exc)
        return EXIT_FAILED
    except Exception:
        logger.exception("the engine did not start (nothing was written)")
        return EXIT_FAILED
    engine_s = time.monotonic() - t0
    logger.info("engine ready in %.1f s", engine_s)
    failed: list[str] = []
    tokens = written = done = 0
    code = EXIT_OK
    too_long = kv_cache_problem(gen, ds.todo)
    if too_long is not None:  # before any sample runs: a setting, not a failure of the samples
        stop_generator(gen)
        logger.error("%s. This is a setting, not a transient failure: re-running the same command fails the same "
                     "way. Raise --gpu-memory-utilization (now %s), or lower --max-seq-len (now %d); nothing was "
                     "extracted by this run, finished samples are kept", too_long, args.gpu_memory_utilization,
                     args.max_seq_len)
        logger.info("summary: 0 written, %d already done (skipped), %d failed (not extracted: the KV cache is too "
                    "small); engine start %.1f s", ds.done, len(ds.todo), engine_s)
        return EXIT_FAILED
    writer = ds.writer(threads=args.writer_threads, max_in_flight_bytes=int(args.max_in_flight_gb * 1e9))
    loop_start = last_log = time.monotonic()
    bar = _progress_bar(args, ds.todo)
    budget = in_flight_tokens(args, info, layer_ids)
    logger.info("feeding the engine continuously: up to %d tokens of samples in flight (half of "
                "--max-in-flight-gb %g)", budget, args.max_in_flight_gb)
    try:
        for sample, result in stream_results(gen, ds.todo, budget):
            done += 1
            if bar is not None:
                bar.update(sample.num_tokens)
            if isinstance(result, Exception):
                failed.append(f"line {sample.line} id {sample.id!r}: {result}")
                logger.error("line %d id %r failed: %s (not written)", sample.line, sample.id, result)
                continue
            if written < STATS_SAMPLES:
                log_layer_stats(sample, layer_ids, result)
            writer.submit([ds.job(sample, result)])  # at once, unless --max-in-flight-gb of results wait for the disk
            written += 1
            tokens += sample.num_tokens
            now = time.monotonic()
            if now - last_log >= PROGRESS_EVERY_S or done == len(ds.todo):
                last_log = now
                logger.info("progress: %d/%d samples, %.0f tokens/s", done, len(ds.todo), tokens / (now - loop_start))
        writer.close()
    except WriterFailed as exc:
        logger.error("%s", exc)
        code = EXIT_FAILED
    except KVCacheTooSmall as exc:
        logger.error("%s. This is a setting, not a transient failure: re-running the same command fails the "
                     "same way. Raise --gpu-memory-utilization (now %s), or lower --max-seq-len (now %d) or "
                     "--max-in-flight-gb (now %g); finished samples are kept", exc, args.gpu_memory_utilization,
                     args.max_seq_len, args.max_in_flight_gb)
        code = EXIT_FAILED
    except KeyboardInterrupt:
        logger.error("interrupted; finished samples are kept, re-run to resume")
        code = 130
    except Exception:
        logger.exception("the engine failed; finished samples are kept, re-run to resume")
        code = EXIT_FAILED
    finally:
        if bar is not None:
            bar.close()
        stats = writer.close(raise_error=False)
        loop_end = time.monotonic()  # the extraction ends with the last file written, before the shutdown
        if (note := flushed_note(stats.fp8_flushed, stats.fp8_values, args.fp8_scale or "token")) is not None:
            logger.warning("%s", note)
        stop_generator(gen)
        shutdown_s = time.monotonic() - loop_end
    loop_s = max(loop_end - loop_start, 1e-9)
    for sample, why in writer.failed:
        failed.append(f"line {sample.line} id {sample.id!r}: {why}")
    if code == EXIT_OK and shard.num_shards > 1:
        logger.info("shard %d of %d done; when every shard is: speccompat merge %s --inputs %s", shard.index,
                    shard.num_shards, args.output_dir, args.prepared_data)
    elif code == EXIT_OK:
        try:
            ds.finish(args.token_freq_path)
        except OSError as exc:
            logger.error("cannot write the data set's side files in %s: %s; re-run to finish", args.output_dir, exc)
            code = EXIT_FAILED
    # every sample of this run without its file now failed: those the engine or the writer rejected,
    # and those a stop (the writer, the engine, the KV cache, Ctrl-C) left unextracted
    unfinished = max(0, len(ds.todo) - stats.files)
    stopped = max(0, unfinished - len(failed))
    logger.info("summary: %d written, %d already done (skipped), %d failed (%d rejected by the engine or the writer, "
                "%d not extracted: the run stopped); %d tokens in %.1f s (engine start %.1f s, extraction %.1f s: "
                "%.0f tokens/s, engine shutdown %.1f s); %s written to %s (engine waited %.2f s for the writer)",
                stats.files, ds.done, unfinished, len(failed), stopped, tokens, time.monotonic() - started, engine_s,
                loop_s, tokens / loop_s, shutdown_s, human(stats.bytes), args.output_dir, stats.waited_s)
    if failed:
        for line in failed[:20]:
            logger.error("failed: %s", line)
        logger.error("%d sample(s) failed; the others are written. Re-run the same command to retry them (a sample "
                     "the writer could not store fails the same way: fix or drop its input line)", len(failed))
        return EXIT_FAILED if code == EXIT_OK else code
    if code == EXIT_OK:
        print_result(closing_advice(args, layer_ids, info.num_layers))
    return code


def closing_advice(args: ExtractConfig, layer_ids: list[int], num_layers: int) -> str:
    """What the run prints at its end for the trainer: :func:`speccompat.layers.describe_for_training`,
    for an fp8 set naming only the trainers that read fp8 (speculators >= 0.9's ``FP8Transfer``):
    speculators 0.3/0.4 cannot read it, nor can 0.5-0.8 (no fp8 backend)."""
    from speccompat.layers import describe_for_training

    text = describe_for_training(layer_ids, num_layers, str(args.output_dir))
    if args.dtype != "fp8":
        return text
    lines = []
    for line in text.splitlines():
        if line.startswith("speculators 0.3/0.4:"):
            continue  # nothing of 0.3/0.4 reads fp8: no draft of theirs is trained on this set
        if line.startswith("speculators >= 0.5: train with "):
            line = (f"speculators >= 0.9 (the trainers that read fp8): train with --hidden-states-backend fp8 "
                    f"{line.removeprefix('speculators >= 0.5: train with ')}; speculators 0.3-0.8 cannot read fp8 "
                    f"(`speccompat export {args.output_dir} --to speculators-arrow --dtype bfloat16 OUT` converts it)")
        lines.append(line)
    return "\n".join(lines)


def _progress_bar(args: ExtractConfig, todo: list[Any]) -> Any:
    """A tqdm bar over the tokens to extract (tokens/s and ETA), on a terminal when tqdm is installed."""
    if not args.progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=sum(s.num_tokens for s in todo), unit="tok", unit_scale=True, desc="extract",
                dynamic_ncols=True)


#: where the command's result (the trainer's flags) goes while :func:`logs_to_stderr` holds: the
#: process's stdout, whose file descriptor then leads to stderr for everything else
_result_stream: Any = None


def print_result(text: str) -> None:
    """The command's result, on stdout (the log, vLLM's and its workers' included, is on stderr)."""
    print(text, file=_result_stream or sys.stdout, flush=True)


@contextlib.contextmanager
def logs_to_stderr() -> Any:
    """Keep stdout for :func:`print_result`: vLLM logs to stdout (``VLLM_LOGGING_STREAM``, set to
    stderr here unless given) and its workers inherit the file descriptor, so descriptor 1 leads to
    stderr for the run and the result is written to the original stdout."""
    global _result_stream
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream of Python's own (captured): nothing to move
        fd = None
    if fd != 1 or _result_stream is not None:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _result_stream = os.fdopen(saved, "w", closefd=False)
    try:
        yield
    finally:
        sys.stdout.flush()
        _result_stream.close()
        _result_stream = None
        os.dup2(saved, 1)
        os.close(saved)


def use_spawn() -> None:
    """vLLM's GPU workers need ``spawn`` (a forked CUDA context is unusable); set before vLLM/torch load."""
    import multiprocessing

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    with contextlib.suppress(RuntimeError):
        multiprocessing.set_start_method("spawn")


def main(argv: list[str] | None = None, *, script: Path | None = None, prog: str | None = None) -> int:
    """The command. ``script``: the file ``--data-parallel-size``/``--ray`` start once per engine
    (default: this module's file)."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from speccompat.dataset import EXIT_REJECTED, Rejected

    cfg = ExtractConfig.from_args(args)
    if cfg.ray or cfg.data_parallel_size > 1:
        from speccompat.dataset.parallel import launch_engines

        try:
            check_settings(cfg)
            # the weights' digests once here, into the cache, rather than by every engine at once
            from speccompat.dataset.provenance import model_identity

            model_identity(cfg.model_path)
            return launch_engines(cfg, script or Path(__file__).resolve())
        except Rejected as exc:
            logger.error("%s", exc)
            return EXIT_REJECTED
    use_spawn()
    from speccompat.dataset import DatasetError

    try:
        with logs_to_stderr():
            return extract(cfg)
    except Rejected as exc:
        logger.error("%s", exc)
        return EXIT_REJECTED
    except DatasetError as exc:
        logger.error("%s", exc)
        return exc.exit_status
    except OSError as exc:  # outside the engine's run (which reports its own): one line, finished files kept
        logger.error("%s; finished samples are kept, re-run to resume", exc)
        return 1


if __name__ == "__main__":  # vLLM's spawned workers re-import this file: nothing may run then
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run as a file (one engine of --data-parallel-size): this folder's modules are no packages
    sys.exit(main())
