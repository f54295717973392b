"""Step 2 of the EAGLE-3 data pipeline: the hidden states of tokenized samples, one file each.

Arguments -> samples -> generator -> writer. speculators' ``VllmHiddenStatesGenerator`` (made to
work on this vLLM by ``speccompat.apply()``) runs batches of ``--batch-size`` samples; the
data-set machinery (``speccompat.dataset``) checks the input, the output directory and what
produced it before the engine starts, writes each sample in the background while the engine
computes the next batch, and resumes. Nothing here is specific to Kimi-K2.5: the same script
extracts Llama, Qwen, DeepseekV3 (see ../llama/). See README.md next to this file and docs/dataset.md.

    python extract_hidden_states.py --model-path /models/Kimi-K2.5 --prepared-data data.jsonl \
        --output-dir hs/ --tp-size 8 --layer-ids 2 30 58 60 --batch-size 2 --max-seq-len 2048

Exit status: 0 every sample has its file; 1 some samples failed, the engine failed or the disk
filled up (finished files are kept: re-run to resume); 2 refused before any engine started.

Only the standard library is imported at module level: vLLM's workers start with ``spawn`` and
re-import this file, which must stay cheap and side-effect free.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("extract_hidden_states")
#: Per-layer statistics are logged for this many samples at the start of a run.
STATS_SAMPLES = 3
#: A progress line at most this often (and after the last batch).
PROGRESS_EVERY_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Extract EAGLE-3 training hidden states (one file per sample).",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-path", required=True, help="checkpoint directory (or hub id) of the target model")
    ap.add_argument("--prepared-data", required=True, type=Path,
                    help='JSONL from prepare_data.py: {"id", "input_ids", "loss_mask"?} per line')
    ap.add_argument("--output-dir", required=True, type=Path, help="the data set; re-running resumes")
    ap.add_argument("--format", choices=("safetensors", "speculators", "speculators-arrow"), default="safetensors",
                    help="safetensors: <id>.safetensors per sample; speculators: data_<i>.pt and "
                         "data_config.json as speculators' own data_generation_offline.py writes them "
                         "(speculators 0.3/0.4); speculators-arrow: the Arrow dataset + hidden_states/hs_<row>"
                         ".safetensors speculators >= 0.5 trains on (layers ascending, the last the final "
                         "layer; needs speccompat[arrow])")
    ap.add_argument("--batch-size", type=_positive_int, default=2, help="sequences per generate() call")
    ap.add_argument("--max-seq-len", type=_positive_int, default=2048,
                    help="longest sequence kept whole (the engine gets max_model_len = this + 1)")
    ap.add_argument("--tp-size", type=_positive_int, default=1, help="tensor parallel size (GPUs)")
    ap.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8,
                    help="fraction of GPU memory vLLM may use (on CPU: use a small value, e.g. 0.1)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="decoder layers to capture; default: speculators' choice [2, L//2, L-3, L-1]")
    ap.add_argument("--limit", type=_positive_int, default=None, help="use only the first N valid samples")
    ap.add_argument("--overwrite", action="store_true",
                    help="start the data set anew: redo every sample, also when the model or settings changed")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="dtype of the saved hidden states (the model runs in its checkpoint dtype)")
    ap.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail",
                    help="corrupt input lines: skip them with a warning, or stop before the engine starts")
    ap.add_argument("--on-long-line", choices=("truncate", "skip", "fail"), default="truncate",
                    help="lines longer than --max-seq-len: keep the first max-seq-len tokens, skip, or stop")
    ap.add_argument("--writer-threads", type=_positive_int, default=4, help="threads writing files")
    ap.add_argument("--max-in-flight-gb", type=float, default=8.0,
                    help="results not yet written that may be held in memory before the engine waits")
    ap.add_argument("--token-freq-path", type=Path, default=None,
                    help="--format speculators: token-frequency file (default: <output-dir>.token_freq.pt)")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO")
    sc = ap.add_argument_group("scale-out (docs/scale-out.md)")
    sc.add_argument("--num-shards", type=_positive_int, default=None,
                    help="split the input into N shards by a hash of each id (when not given: SLURM_ARRAY_TASK_COUNT, "
                         "else WORLD_SIZE, else 1); every shard writes its own manifest part into --output-dir")
    sc.add_argument("--shard-index", type=int, default=None,
                    help="this process's shard, 0..N-1 (when not given: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, "
                         "else RANK)")
    sc.add_argument("--data-parallel-size", type=_positive_int, default=1,
                    help="engines of --tp-size GPUs each, one shard each, side by side on this host "
                         "(or Ray actors with --ray); the data set is merged when all have finished")
    sc.add_argument("--engines-per-gpu", type=_positive_int, default=1,
                    help="engines sharing each group of --tp-size GPUs (a model much smaller than a GPU); "
                         "give each its share with --gpu-memory-utilization (at most 1/N)")
    sc.add_argument("--ray", action="store_true",
                    help="run the --data-parallel-size engines as Ray actors on an existing cluster")
    sc.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                    help="the Ray cluster (host:port, auto, or local: a one-node cluster in this process)")
    return ap.parse_args(argv)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def start_generator(args: argparse.Namespace, layer_ids: list[int]) -> Any:
    """speculators' generator (speccompat was applied before); this starts vLLM's workers."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    logger.info("starting the engine: %s, TP %d, layers %s, max_model_len %d", args.model_path, args.tp_size,
                layer_ids, args.max_seq_len + 1)
    return VllmHiddenStatesGenerator(
        args.model_path, layer_ids=layer_ids,
        # speculators (and speccompat) keep max_model_len - 1 tokens: one slot is reserved for the
        # single sampled token. +1 keeps sequences of exactly --max-seq-len whole.
        max_model_len=args.max_seq_len + 1, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tp_size)


def stop_generator(gen: Any) -> None:
    executor = getattr(gen, "executor", None)
    if executor is not None:
        gen.executor = None
        with contextlib.suppress(Exception):
            executor.shutdown()


def generate(gen: Any, batch: list[Any]) -> list[Any]:
    """Results of one batch, in order. A batch rejected by speccompat's validation is retried one
    sample at a time, so one bad sample does not take its neighbours down."""
    from speccompat.errors import HiddenStatesError

    try:
        # copy=False (speccompat's generate): views of the worker's shared-memory buffer, written to
        # disk straight from there; the buffer is not reused while the writer still holds them
        return gen.generate([list(s.input_ids) for s in batch], copy=False)
    except HiddenStatesError as exc:
        if len(batch) == 1:
            return [exc]
        logger.warning("a batch of %d failed validation (%s); retrying one by one", len(batch), exc)
        return [generate(gen, [s])[0] for s in batch]


def log_layer_stats(sample: Any, layer_ids: list[int], states: list[Any]) -> None:
    for i, h in zip(layer_ids, states, strict=True):
        x = h.float()
        logger.info("stats id %r layer %d: min %.4g max %.4g mean %.4g std %.4g", sample.id, i, x.min().item(),
                    x.max().item(), x.mean().item(), x.std().item())


def extract(args: argparse.Namespace) -> int:
    import speccompat
    from speccompat.dataset import (
        EXIT_FAILED,
        EXIT_OK,
        Rejected,
        WriterFailed,
        collect_provenance,
        open_dataset,
        read_model_info,
        report_scan,
        scan_jsonl,
    )
    from speccompat.dataset.fsutil import human
    from speccompat.dataset.shards import open_shard, resolve_shard
    from speccompat.layers import LayerIdsError, resolve_layer_ids

    started = time.monotonic()
    shard = resolve_shard(args.num_shards, args.shard_index)
    if shard.num_shards > 1:
        logger.info("%s", shard)
    status = speccompat.apply()  # cheap: imports neither torch nor vLLM
    if status.state not in ("armed", "active"):
        raise Rejected(f"speccompat could not adapt this installation ({status.state}): "
                       + "; ".join(status.warnings + status.errors))
    info = read_model_info(args.model_path)
    try:
        layer_ids = resolve_layer_ids(args.layer_ids, info.num_layers)
    except LayerIdsError as exc:
        raise Rejected(f"--layer-ids: {exc}") from None
    scan = scan_jsonl(args.prepared_data, vocab_size=info.vocab_size, max_seq_len=args.max_seq_len,
                      on_bad=args.on_bad_line, on_long=args.on_long_line, limit=args.limit)
    report_scan(scan, args.max_seq_len)
    prov = collect_provenance(model_path=args.model_path, info=info, layer_ids=layer_ids, dtype=args.dtype,
                              max_seq_len=args.max_seq_len, on_long_line=args.on_long_line,
                              tensor_parallel_size=args.tp_size, layout=args.format, status=status)
    if shard.num_shards > 1:
        ds = open_shard(args.output_dir, scan.samples, prov, shard, overwrite=args.overwrite,
                        speculators_version=status.speculators.get("raw"))
    else:
        ds = open_dataset(args.output_dir, scan.samples, prov, overwrite=args.overwrite,
                          speculators_version=status.speculators.get("raw"))
    ds.extra.update(train_data_path=str(args.prepared_data), gpu_memory_utilization=args.gpu_memory_utilization,
                    max_samples=args.limit)
    if not ds.todo:
        if shard.num_shards == 1:
            ds.finish(args.token_freq_path)
        logger.info("nothing to do: every sample%s has an intact file in %s",
                    f" of shard {shard.index} of {shard.num_shards}" if shard.num_shards > 1 else "", args.output_dir)
        return EXIT_OK

    t0 = time.monotonic()
    try:
        gen = start_generator(args, layer_ids)
    except Exception:
        logger.exception("the engine did not start (nothing was written)")
        return EXIT_FAILED
    engine_s = time.monotonic() - t0
    logger.info("engine ready in %.1f s", engine_s)
    failed: list[str] = []
    tokens = written = 0
    code = EXIT_OK
    writer = ds.writer(threads=args.writer_threads, max_in_flight_bytes=int(args.max_in_flight_gb * 1e9))
    loop_start = last_log = time.monotonic()
    try:
        for first in range(0, len(ds.todo), args.batch_size):
            batch = ds.todo[first:first + args.batch_size]
            jobs = []
            for sample, result in zip(batch, generate(gen, batch), strict=True):
                if isinstance(result, Exception):
                    failed.append(f"line {sample.line} id {sample.id!r}: {result}")
                    logger.error("line %d id %r failed: %s (not written)", sample.line, sample.id, result)
                    continue
                if written + len(jobs) < STATS_SAMPLES:
                    log_layer_stats(sample, layer_ids, result["hidden_states"])
                jobs.append(ds.job(sample, result["hidden_states"]))
            writer.submit(jobs)  # returns at once unless --max-in-flight-gb of results wait for the disk
            written += len(jobs)
            tokens += sum(j.sample.num_tokens for j in jobs)
            now = time.monotonic()
            if now - last_log >= PROGRESS_EVERY_S or first + len(batch) == len(ds.todo):
                last_log = now
                logger.info("progress: %d/%d samples, %.0f tokens/s", first + len(batch), len(ds.todo),
                            tokens / (now - loop_start))
        writer.close()
    except WriterFailed as exc:
        logger.error("%s", exc)
        code = EXIT_FAILED
    except KeyboardInterrupt:
        logger.error("interrupted; finished samples are kept, re-run to resume")
        code = 130
    except Exception:
        logger.exception("the engine failed; finished samples are kept, re-run to resume")
        code = EXIT_FAILED
    finally:
        stats = writer.close(raise_error=False)
        stop_generator(gen)
    loop_s = max(time.monotonic() - loop_start, 1e-9)
    if code == EXIT_OK and shard.num_shards > 1:
        logger.info("shard %d of %d done; when every shard is: speccompat merge %s --inputs %s", shard.index,
                    shard.num_shards, args.output_dir, args.prepared_data)
    elif code == EXIT_OK:
        try:
            ds.finish(args.token_freq_path)
        except OSError as exc:
            logger.error("cannot write the data set's side files in %s: %s; re-run to finish", args.output_dir, exc)
            code = EXIT_FAILED
    logger.info("summary: %d written, %d already done (skipped), %d failed; %d tokens in %.1f s (engine start "
                "%.1f s, extraction %.1f s: %.0f tokens/s); %s written to %s (engine waited %.2f s for the writer)",
                stats.files, ds.done, len(failed), tokens, time.monotonic() - started, engine_s, loop_s,
                tokens / loop_s, human(stats.bytes), args.output_dir, stats.waited_s)
    if failed:
        logger.error("%d sample(s) failed; re-run the same command to retry them", len(failed))
        return EXIT_FAILED
    return code


def use_spawn() -> None:
    """vLLM's GPU workers need ``spawn`` (a forked CUDA context is unusable); set before vLLM/torch load."""
    import multiprocessing

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    with contextlib.suppress(RuntimeError):
        multiprocessing.set_start_method("spawn")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from speccompat.dataset import EXIT_REJECTED, Rejected

    if args.ray or args.data_parallel_size > 1:
        from speccompat.parallel import launch_engines

        try:
            return launch_engines(args, sys.argv[1:] if argv is None else argv, Path(__file__).resolve())
        except Rejected as exc:
            logger.error("%s", exc)
            return EXIT_REJECTED
    use_spawn()
    try:
        return extract(args)
    except Rejected as exc:
        logger.error("%s", exc)
        return EXIT_REJECTED


if __name__ == "__main__":
    sys.exit(main())
