"""The train/serve run's target and samples (:mod:`speccompat.testing.train_serve`, step 1): a tiny
Llama trained on a synthetic language whose next word depends on a key at the start of the text, made
sensitive to which layers a draft is served (:func:`make_target`), the layer probe that shows it
(:func:`layer_probe`), and the prepared samples and held-out prompt sets (:func:`prepare`).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

#: The target's language. A text opens with one of LANGUAGE_KEYS; then each next word is, with
#: probability LANGUAGE_P, the successor of the current word in that key's table (a random cyclic
#: permutation of LANGUAGE_WORDS), else any word. The key appears once, at the start: the target
#: reads it back through attention, and (see :func:`make_target`) only from its fourth layer on.
LANGUAGE_WORDS = list(range(4, 68))  # 64 words of the tokenizer's 512 (0-3: pad, bos, eos, unk)
LANGUAGE_KEYS = list(range(68, 72))  # 4 keys, one table each
LANGUAGE_P = 0.8
TARGET_STEPS = 600
#: Decoder layers whose attention output is held at zero while the target trains (o_proj = 0): their
#: outputs are functions of the position's own token, so context (the key) first enters the residual
#: stream in layer ATTENTION_FROM. The data set's layers 1 2 3 (serving aux ids 2 3 4) include that
#: layer's output; shifted down by one (0 1 2) they do not.
ATTENTION_FROM = 3
#: Each decoder layer's output carries a fixed random vector of its own (RMS LAYER_OFFSET_RMS, larger
#: than the states' own, written by its MLP's down_proj bias, frozen while the target trains), so that
#: neighbouring layers' outputs are not near copies of each other.
LAYER_OFFSET_RMS = 16.0

Table = dict[int, dict[int, int]]


def language(seed: int = 0) -> Table:
    """The successor tables: key -> {word: its likely next word}, each a single cycle through every
    word (a greedy continuation runs len(LANGUAGE_WORDS) tokens before it repeats)."""
    rng = random.Random(seed)
    tables = {}
    for key in LANGUAGE_KEYS:
        order = LANGUAGE_WORDS[:]
        rng.shuffle(order)
        tables[key] = {a: b for a, b in zip(order, order[1:] + order[:1], strict=True)}
    return tables


def sample_language(rng: random.Random, tables: Table, n: int) -> list[int]:
    """``n`` tokens: a key, then words following that key's table with probability LANGUAGE_P."""
    key = rng.choice(LANGUAGE_KEYS)
    s = [key, rng.choice(LANGUAGE_WORDS)]
    while len(s) < n:
        s.append(tables[key][s[-1]] if rng.random() < LANGUAGE_P else rng.choice(LANGUAGE_WORDS))
    return s


def target_accuracy(model: Any, tables: Table, rows: list[list[int]]) -> float:
    """How often the target's top token is the successor of the current word in the row's table."""
    import torch

    with torch.no_grad():
        pred = model(torch.tensor(rows)).logits.argmax(-1)[:, 1:-1]
    want = torch.tensor([[tables[r[0]][r[i]] for i in range(1, len(r) - 1)] for r in rows])
    return float((pred == want).float().mean())


def make_target(path: Path, *, steps: int = TARGET_STEPS) -> tuple[Path, dict[str, Any]]:
    """The tiny Llama (:func:`~speccompat.testing.models.make_checkpoint` ``llama``: 6 layers, hidden
    256), trained with transformers (fp32, AdamW, ``steps`` batches of 16 sequences of 32 tokens) on
    :func:`language`, then saved in bf16 over the random weights (config and tokenizer are
    make_checkpoint's, with ``mlp_bias``). Two things make it sensitive to which layers a draft is
    served:

    - the attention of layers 0 to ATTENTION_FROM - 1 is held at zero (o_proj = 0, frozen), so the
      key first reaches a position's state in layer ATTENTION_FROM's output, which the data set's
      input layers hold and the layers shifted by one do not;
    - each layer's output carries a fixed random offset of its own (LAYER_OFFSET_RMS), so that
      neighbouring layers' outputs are not near copies of each other.

    What each did, measured on this run's CPU path (mean accepted length, trained draft vs the same draft
    served its layers shifted by one): a target trained on a second-order language, all layers
    attending, 3.72 vs 3.73; with the key entering at layer 3 only, 3.99 vs 3.73 (and the draft can
    recover the key from the text itself: two consecutive words of a greedy continuation name the
    table); with the offsets too, 3.82 vs
    2.24. Without the offsets, neighbouring layers' outputs had a cosine similarity of 0.85-0.97, so
    a draft served its layers' neighbours saw nearly what it was trained on."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from speccompat.testing.models import make_checkpoint

    path = Path(path)
    marker = path / "speccompat_trained_target.json"
    want = {"words": len(LANGUAGE_WORDS), "keys": len(LANGUAGE_KEYS), "p": LANGUAGE_P, "steps": steps,
            "attention_from": ATTENTION_FROM, "layer_offset_rms": LAYER_OFFSET_RMS}
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == want:
        return path, json.loads(marker.read_text())
    if path.exists():
        shutil.rmtree(path)
    make_checkpoint("llama", path)
    config = json.loads((path / "config.json").read_text())
    config["mlp_bias"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tables = language()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine more threads oversubscribe and run far slower
    torch.manual_seed(0)
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for layer in model.model.layers[:ATTENTION_FROM]:
            layer.self_attn.o_proj.weight.data.zero_()
            layer.self_attn.requires_grad_(False)
        before = torch.zeros(model.config.hidden_size)
        for layer in model.model.layers:  # layer i's output carries offset_i: its bias is offset_i - offset_(i-1)
            offset = torch.randn(model.config.hidden_size) * LAYER_OFFSET_RMS
            mlp = layer.mlp
            mlp.gate_proj.bias.data.zero_()
            mlp.up_proj.bias.data.zero_()
            mlp.down_proj.bias.data.copy_(offset - before)
            mlp.down_proj.bias.requires_grad_(False)
            before = offset
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 20) * (1 - k / steps))
        rng = random.Random(1)
        model.train()
        for _ in range(steps):
            batch = torch.tensor([sample_language(rng, tables, 32) for _ in range(16)])
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        model.eval()
        held = random.Random(99)
        rows = [sample_language(held, tables, 64) for _ in range(32)]
        acc32 = target_accuracy(model, tables, rows)
        weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        acc16 = target_accuracy(bf16, tables, rows)
    finally:
        torch.set_num_threads(threads)
    info = {"recipe": want, "train_s": round(time.monotonic() - t0, 1), "final_loss": round(float(loss.detach()), 4),
            "accuracy_fp32": round(acc32, 4), "accuracy_bf16": round(acc16, 4)}
    marker.write_text(json.dumps(info))
    return path, info


def layer_probe(target: Path, rows: list[list[int]]) -> dict[str, dict[str, float]]:
    """What each decoder layer's output holds (transformers, fp32, one forward pass over ``rows``):
    ``logit_lens_top1_agreement``, how often the final norm + lm_head applied to layer i's output
    picks the target's own next token (how much of the answer that layer holds); and
    ``cosine_to_previous_layer``, the mean cosine similarity of layer i's output to layer i-1's (how
    much a draft served its input layers' neighbours sees what it was trained on)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    with torch.no_grad():
        out = model(torch.tensor(rows), output_hidden_states=True)
        states = out.hidden_states  # entry i+1: output of layer i, before the norm (the last: after it)
        final = out.logits.argmax(-1)
        lens = {f"layer_{i}": round(float((model.lm_head(model.model.norm(states[i + 1])).argmax(-1) == final)
                                          .float().mean()), 4) for i in range(n - 1)}
    cos = torch.nn.functional.cosine_similarity
    neighbours = {f"layer_{i}": round(float(cos(states[i + 1], states[i], dim=-1).mean()), 4) for i in range(1, n - 1)}
    return {"logit_lens_top1_agreement": lens, "cosine_to_previous_layer": neighbours}


def prepare(work: Path, *, samples: int, prompt_len: int, response_len: int, sets: int, per_set: int,
            seed: int) -> dict[str, Any]:
    """The target checkpoint, ``samples.jsonl`` (prompt + the target's greedy continuation) and
    ``heldout.json`` (``sets`` prompt sets of ``per_set`` prompts, another seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # a shared 2-core machine: more threads oversubscribe and run far slower
    target, target_info = make_target(work / "target")
    tables = language()
    rng = random.Random(seed)
    prompts = [sample_language(rng, tables, prompt_len) for _ in range(samples)]
    path = work / "samples.jsonl"
    if not path.exists():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        rows = []
        for k in range(0, samples, 64):
            batch = torch.tensor(prompts[k:k + 64])
            with torch.no_grad():
                torch.manual_seed(seed + k)
                out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=response_len,
                                     min_new_tokens=response_len, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, pad_token_id=0)
            rows += out.tolist()
        tmp = path.with_suffix(".partial")
        tmp.write_text("".join(json.dumps({"id": f"s{k:04d}", "input_ids": ids,
                                           "loss_mask": [0] * prompt_len + [1] * (len(ids) - prompt_len)}) + "\n"
                               for k, ids in enumerate(rows)))
        tmp.replace(path)
    held = random.Random(seed + 1000)
    seen = {tuple(p) for p in prompts}
    heldout = []
    for _ in range(sets):
        group = []
        while len(group) < per_set:
            p = sample_language(held, tables, prompt_len)
            if tuple(p) not in seen:
                seen.add(tuple(p))
                group.append(p)
        heldout.append(group)
    (work / "heldout.json").write_text(json.dumps(heldout))
    texts = [json.loads(line)["input_ids"] for line in path.read_text().splitlines()]
    return {"target": str(target), "target_training": target_info, "language_words": len(LANGUAGE_WORDS),
            "language_keys": len(LANGUAGE_KEYS), "language_p": LANGUAGE_P, "attention_from_layer": ATTENTION_FROM,
            "layer_offset_rms": LAYER_OFFSET_RMS, **layer_probe(target, texts[:32]), "samples": samples,
            "tokens": sum(map(len, texts)), "prompt_len": prompt_len,
            "response_len": response_len, "heldout_sets": sets, "heldout_per_set": per_set}


