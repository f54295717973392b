"""From extraction to a served draft, end to end on a tiny target: does vLLM accept the tokens of an
EAGLE-3 draft trained on a speccompat data set?

One run (``python -m speccompat.testing.train_serve run --work DIR``):

1. a tiny Llama target (:func:`speccompat.testing.models.make_checkpoint`, 6 layers, hidden 256)
   trained for two minutes with transformers on a synthetic language whose next word depends on a key
   at the start of the text, made sensitive to which layers a draft is served (:func:`speccompat.testing.tiny_target.make_target`:
   context enters at layer 3 only, and each layer's output carries an offset of its own), and
   prepared samples: prompts of that language (loss mask
   0) followed by the target's own sampled continuation (loss mask 1), computed with transformers;
   held-out prompt sets of the language from another seed;
2. ``speccompat extract`` of the samples twice, ``--layout speculators-arrow`` and ``--layout
   speculators`` (the speculators 0.3/0.4 layout), on a real vLLM engine;
3. training:

   - speculators 0.9.0 on the Arrow data set: speculators' own ``speculators.train`` command line
     (``TrainConfig.resolve``, ``cli.main``: vocabulary mapping, ``build_draft_model``,
     ``create_train_val_loaders`` with its ``ArrowDataset``, the model's own forward and loss, its
     ``SingleGPUCheckpointer``), with only its ``Trainer`` replaced by :class:`CpuTrainer`, a short
     loop of the same steps on CPU: 0.9.0's ``Trainer`` takes ``cuda`` when no accelerator is present
     (``speculators/train/trainer.py:227-228``) and its step timer calls ``torch.accelerator.synchronize()``,
     which raises without one;
   - speculators 0.4.0.1 on its own layout: its ``Eagle3SampleFileDataset``, ``split_files``,
     ``create_collate_fn``, ``MultipackDistributedBatchSamplerV2``, ``Eagle3DraftModel.from_training_args``
     and its own ``Trainer`` (run with ``TrainerConfig(local_rank="cpu")``: 0.4.0.1's trainer moves
     the model and the batches to ``local_rank`` and does nothing else device-specific). The wheel
     ships this library but not the launcher script (``scripts/train.py`` is in the repository
     only), so the pieces are put together here as that script does;

   then ``speccompat check-draft`` on each draft (``--fix`` on 0.4.0.1's, whose trainer writes no
   ``eagle_aux_hidden_state_layer_ids``);
4. serving: vLLM speculative decoding (``method: eagle3``, 3 speculative tokens, greedy) of the
   held-out prompt sets, reading vLLM's own counters (``LLM.get_metrics()``:
   ``vllm:spec_decode_num_drafts``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``)
   for each set, for the trained drafts, the same 0.9.0 draft served with its aux layer ids shifted
   down by one (what ``check-draft`` calls a mismatch), and an untrained draft of the same shape
   (speculators' own ``--dry-run``).

``--mislabel`` makes the Arrow data set's records claim other layers than it holds (each input
layer recorded one higher than captured, as an extractor that numbers layers off by one would): the
trainer, the draft's config and ``check-draft`` all believe the records, so only serving shows it.

Each engine (extraction, serving) runs in its own process; with ``--engine-lock PATH`` (or
``SPECCOMPAT_ENGINE_LOCK``) each holds an ``flock`` on PATH while it runs, and only then.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .tiny_target import prepare

REPO = Path(__file__).resolve().parents[2]
#: speccompat layers stored (0-based decoder-layer outputs; the last is the final layer, L-1).
LAYER_IDS = [1, 2, 3, 5]
#: What ``--mislabel`` captures while recording LAYER_IDS: every input layer one lower.
MISLABELED_CAPTURE = [0, 1, 2, 5]
NUM_SPECULATIVE_TOKENS = 3
TRAINERS_09 = ("speculators==0.9.0", "hs-connectors==0.9.0")


def log(msg: str) -> None:
    print(f"[train-serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# engines: one process each, under the engine lock when one is named


@contextlib.contextmanager
def engine_lock(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    with open(path, "a") as fh:
        t = time.monotonic()
        fcntl.flock(fh, fcntl.LOCK_EX)
        waited = time.monotonic() - t
        if waited > 1:
            log(f"waited {waited:.0f} s for the engine lock {path}")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_logged(cmd: list[str], log_path: Path, *, env: dict[str, str] | None = None, timeout: int = 1800,
               lock: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with engine_lock(lock), open(log_path, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO)
    log(f"{' '.join(Path(c).name if '/' in c else c for c in cmd[:4])} ... exit {proc.returncode} "
        f"({time.monotonic() - t:.0f} s, log {log_path})")
    if check and proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[:4]} failed with exit {proc.returncode}; end of {log_path}:\n{tail}")
    return proc


def _env(*paths: str) -> dict[str, str]:
    have = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO), *have]),
            "TOKENIZERS_PARALLELISM": "false"}


def speculators_04_path() -> list[str]:
    """speculators 0.4.0.1 on the path: a scripts/mkenv.py environment's folder, else the installed one."""
    desc = Path(sys.prefix) / "speccompat-env.json"
    if desc.exists():
        folders = json.loads(desc.read_text())["speculators"]
        if "0.4.0.1" in folders:
            return [folders["0.4.0.1"]]
    return []


#: speculators 0.4.0.1 pins transformers <= 4.57.6 (its config classes cannot be built under
#: transformers 5: ``Eagle3SpeculatorConfig(...)`` raises "AttributeError: 'Eagle3SpeculatorConfig'
#: object has no attribute '__pydantic_fields_set__'" from ``transformers/configuration_utils.py:159``).
TRAINER_04_DEPS = ("transformers==4.57.6", "tokenizers>=0.22,<0.23", "huggingface_hub>=0.34,<1.0")


def transformers_4_path(cache: Path) -> list[str]:
    """transformers 4.57.6 (speculators 0.4.0.1's pin) in a folder of its own, put first on the path of
    0.4.0.1's training process only (``pip install --no-deps --target``; torch stays the environment's)."""
    target = cache / "transformers-4.57.6"
    if not (target / ".installed").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        *TRAINER_04_DEPS], check=True, timeout=900)
        (target / ".installed").write_text(" ".join(TRAINER_04_DEPS))
    return [str(target)]


def speculators_09_path(cache: Path) -> list[str]:
    """speculators 0.9.0 and hs-connectors 0.9.0 from their wheels (``.envs/trainer-wheels/`` where
    scripts/mkenv.py keeps them, else ``pip download``), unpacked once under ``cache``."""
    import zipfile

    out = []
    wheels = REPO / ".envs" / "trainer-wheels"
    for req in TRAINERS_09:
        name, version = req.split("==")
        target = cache / f"{name}-{version}"
        if not (target / ".unpacked").is_file():
            found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            if not found:
                wheels.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), req],
                               check=True, timeout=600)
                found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            with zipfile.ZipFile(found[-1]) as z:
                z.extractall(target)
            (target / ".unpacked").write_text(found[-1].name)
        out.append(str(target))
    return out


# ---------------------------------------------------------------------------------------------
# 2. extraction


def extract(work: Path, fmt: str, out: Path, layer_ids: list[int], lock: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "speccompat", "extract", "--model-path", str(work / "target"),
           "--prepared-data", str(work / "samples.jsonl"), "--output-dir", str(out), "--layout", fmt,
           "--layer-ids", *map(str, layer_ids), "--max-seq-len", "255", "--batch-size", "16",
           "--tp-size", "1", "--gpu-memory-utilization", "0.3", "--no-progress"]
    run_logged(cmd, work / "logs" / f"extract-{out.name}.log", env=_env(*speculators_04_path()), lock=lock)
    return cmd


def relabel_layers(ds: Path, recorded: list[int]) -> None:
    """Make ``ds``'s records (manifest header provenance, ``speccompat_arrow.json``, ``data_config.json``)
    claim ``recorded`` as its layers; the stored tensors stay what they are. Only for ``--mislabel``."""
    from speccompat.dataset.arrow_format import INFO_NAME, layer_semantics
    from speccompat.dataset.provenance import digest
    from speccompat.layers import layer_records

    lines = (ds / "manifest.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    hs = head["provenance"]["hidden_states"]
    hs["layer_ids"], hs["layers"] = list(recorded), layer_records(recorded)
    head["provenance_sha256"] = digest(head["provenance"])
    (ds / "manifest.jsonl").write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    if (ds / INFO_NAME).exists():
        info = json.loads((ds / INFO_NAME).read_text())
        info.update(layer_semantics(recorded))
        (ds / INFO_NAME).write_text(json.dumps(info, indent=1))
    if (ds / "data_config.json").exists():
        cfg = json.loads((ds / "data_config.json").read_text())
        cfg["hidden_states"]["layer_ids"] = list(recorded)
        (ds / "data_config.json").write_text(json.dumps(cfg, indent=2))


def recorded_aux_ids(ds: Path) -> list[int]:
    """The ``--target-layer-ids`` a user reads off the data set (what check-draft compares with)."""
    from speccompat.dataset.check_draft import dataset_layers
    from speccompat.layers import training_layers

    found = dataset_layers(ds)
    return list(training_layers(found.layer_ids, found.num_hidden_layers).aux_ids)


# ---------------------------------------------------------------------------------------------
# 3. training


def train_09_args(work: Path, data: Path, save: Path, aux_ids: list[int], *, steps: int, lr: float,
                  total_seq_len: int, dry_run: bool = False, vllm_endpoint: str | None = None) -> list[str]:
    """speculators 0.9.0's own ``speculators.train`` flags (``vllm_endpoint``: train online, every
    row's hidden states generated by that server: ``--on-missing generate``)."""
    missing = ["--on-missing", "generate", "--vllm-endpoint", vllm_endpoint] if vllm_endpoint else ["--on-missing", "raise"]
    args = ["--verifier-name-or-path", str(work / "target"), "--data-path", str(data), "--save-path", str(save),
            "--target-layer-ids", *map(str, aux_ids), "--ttt-steps", str(NUM_SPECULATIVE_TOKENS),
            "--num-layers", "1", "--draft-attn-impl", "sdpa", *missing, "--num-workers", "0", "--total-seq-len",
            str(total_seq_len), "--hidden-states-dtype", "float32", "--loss-implementation", "eager",
            "--optimizer", "adamw", "--lr", str(lr), "--max-steps", str(steps), "--epochs", "1000", "--scheduler-type", "linear",
            "--scheduler-warmup-steps", str(max(1, steps // 20)), "--seed", "0", "--no-resume-from-checkpoint"]
    return [*args, "--dry-run"] if dry_run else args


def train_09(work: Path, data: Path, save: Path, aux_ids: list[int], **kw: Any) -> tuple[Path, list[str]]:
    args = train_09_args(work, data, save, aux_ids, **kw)
    cmd = [sys.executable, "-m", "speccompat.testing.train_serve", "_train09", *args]
    run_logged(cmd, work / "logs" / f"train09-{save.name}.log", env=_env(*speculators_09_path(work / "wheels")))
    return (save if kw.get("dry_run") else save / "final"), args


class CpuTrainer:
    """speculators 0.9.0's ``Trainer`` steps on CPU (``train_epoch``: batch to the device, autocast to
    ``hidden_states_dtype``, the model's forward with ``train_call_kwargs`` returning the loss, zero
    grad, backward, gradient clipping at 1.0, its ``build_optimizers`` and linear schedule), then one
    pass over the validation loader and speculators' ``SingleGPUCheckpointer.save_checkpoint`` to
    ``save_path/final``."""

    def __init__(self, model: Any, config: Any, train_loader: Any, val_loader: Any = None) -> None:
        self.model, self.config, self.train_loader, self.val_loader = model, config, train_loader, val_loader

    def _forward(self, batch: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        import torch

        batch = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast("cpu", dtype=self.config.hidden_states_dtype,
                            enabled=self.config.hidden_states_dtype != torch.float32):
            return self.model(**batch, **(kwargs or {}))

    def run_training(self) -> None:
        import torch
        from speculators.train.checkpointer import SingleGPUCheckpointer
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import _resolve_scheduler_steps
        from transformers import get_linear_schedule_with_warmup

        cfg, model = self.config, self.model.to("cpu")
        optimizers = build_optimizers(model, cfg)
        warmup, total = _resolve_scheduler_steps(cfg, len(self.train_loader))
        schedulers = [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=total)
                      for o in optimizers]
        step, t0, history = 0, time.monotonic(), []
        model.train()
        while step < cfg.max_steps:
            for batch in self.train_loader:
                _tokens, loss, metrics = self._forward(batch, cfg.train_call_kwargs)
                for o in optimizers:
                    o.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for o in optimizers:
                    o.step()
                for s in schedulers:
                    s.step()
                step += 1
                if step % 25 == 0 or step == 1:
                    history.append({"step": step, "loss": float(loss), "s": round(time.monotonic() - t0, 1),
                                    **{k: round(float(v), 4) for k, v in metrics.items() if k.startswith("full_acc")}})
                    print(json.dumps({"train": history[-1]}), flush=True)
                if step >= cfg.max_steps:
                    break
        val: dict[str, float] = {}
        if self.val_loader is not None:
            model.eval()
            n = 0
            with torch.no_grad():
                for batch in self.val_loader:
                    _tokens, _loss, metrics = self._forward(batch, cfg.val_call_kwargs)
                    for k, v in metrics.items():
                        val[k] = val.get(k, 0.0) + float(v)
                    n += 1
            val = {k: round(v / max(n, 1), 4) for k, v in val.items()}
        SingleGPUCheckpointer(cfg.save_path).save_checkpoint(model, optimizers, "final")
        summary = {"steps": step, "train_s": round(time.monotonic() - t0, 1), "history": history, "val": val}
        (Path(cfg.save_path) / "final" / "speccompat_training.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({"done": summary}), flush=True)


def _threads() -> None:
    """Training threads: ``SPECCOMPAT_TRAIN_SERVE_THREADS``, default 1 (on a loaded 2-core machine two
    threads oversubscribe and a step runs several times slower than with one)."""
    import torch

    torch.set_num_threads(int(os.environ.get("SPECCOMPAT_TRAIN_SERVE_THREADS", "1")))


def _child_train09(argv: list[str]) -> None:
    _threads()
    import speculators.train.cli as cli
    from speculators.train.config import TrainConfig

    cli.Trainer = CpuTrainer  # the only part of speculators' command line replaced (see CpuTrainer)
    cli.main(TrainConfig.resolve(argv))


def train_04(work: Path, data: Path, save: Path, *, epochs: int, lr: float, total_seq_len: int) -> tuple[Path, dict]:
    spec = {"data": str(data), "save": str(save), "verifier": str(work / "target"), "epochs": epochs, "lr": lr,
            "total_seq_len": total_seq_len, "ttt_steps": NUM_SPECULATIVE_TOKENS}
    cmd = [sys.executable, "-m", "speccompat.testing.train_serve", "_train04", json.dumps(spec)]
    run_logged(cmd, work / "logs" / "train04.log", env=_env(*transformers_4_path(work / "wheels"), *speculators_04_path()))
    return save / str(epochs - 1), spec


#: The attention function 0.4.0.1's draft trains with here (registered in its ``ALL_ATTENTION_FUNCTIONS``).
CPU_ATTENTION = "speccompat_block_mask_sdpa"


def block_mask_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                    **_kwargs: Any) -> tuple[Any, None]:
    """speculators 0.4.0.1's ``flex_attention_forward`` (``models/eagle3/attention.py:141``) on CPU:
    the same attention, with the BlockMask's ``mask_mod`` (0.4.0.1's ``create_combined_mask_mod``:
    causal within a document, plus the diagonal for the draft tokens of each TTT step) made dense and
    given to SDPA. Needed because torch's FlexAttention has no backward on CPU ("FlexAttention does not
    support backward on CPU", ``torch/nn/attention/flex_attention.py``, ``_validate_device``)."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    dense = create_mask(attention_mask.mask_mod, None, None, query.shape[2], key.shape[2], device=query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), attn_mask=dense, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _child_train04(spec: dict[str, Any]) -> None:
    import speccompat

    _threads()
    speccompat.apply()  # speculators 0.3/0.4's import fixes (pydantic >= 2.13); nothing else is used here
    import torch
    from speculators.models.eagle3.attention import ALL_ATTENTION_FUNCTIONS
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn, split_files
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.trainer import Trainer, TrainerConfig
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, LlamaConfig

    torch.manual_seed(0)
    ALL_ATTENTION_FUNCTIONS.register(CPU_ATTENTION, block_mask_sdpa)
    verifier = AutoConfig.from_pretrained(spec["verifier"])
    layer_config = LlamaConfig(
        vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size, intermediate_size=verifier.intermediate_size,
        num_hidden_layers=1, num_attention_heads=verifier.num_attention_heads,
        num_key_value_heads=verifier.num_key_value_heads, head_dim=verifier.head_dim, hidden_act=verifier.hidden_act,
        max_position_embeddings=verifier.max_position_embeddings, rms_norm_eps=verifier.rms_norm_eps,
        tie_word_embeddings=False)
    layer_config._attn_implementation = CPU_ATTENTION  # 0.4.0.1's own: "simple_flex_attention" (see block_mask_sdpa)
    model = Eagle3DraftModel.from_training_args(
        layer_config, draft_vocab_size=verifier.vocab_size, norm_before_residual=True, ttt_steps=spec["ttt_steps"],
        verifier_name_or_path=spec["verifier"], t2d=None, d2t=None)
    train_files, val_files = split_files(spec["data"], ratio=0.9, seed=0)

    def loader(files: list) -> DataLoader:
        ds = Eagle3SampleFileDataset(max_len=spec["total_seq_len"], file_list=[str(f) for f in files])
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=spec["total_seq_len"], lengths=ds.approx_lengths,
                                                     num_replicas=1, rank=0)
        return DataLoader(ds, batch_sampler=sampler, num_workers=0, collate_fn=create_collate_fn(spec["total_seq_len"]))

    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        use_off_policy_tokens=False, ttt_steps=spec["ttt_steps"], ttt_step_loss_decay=1.0)
    config = TrainerConfig(lr=spec["lr"], num_epochs=spec["epochs"], save_path=spec["save"], local_rank="cpu",
                           train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, scheduler_type="linear")
    t0 = time.monotonic()
    Trainer(model, config, loader(train_files), loader(val_files)).run_training()
    print(json.dumps({"done": {"train_s": round(time.monotonic() - t0, 1), "train_files": len(train_files),
                               "val_files": len(val_files)}}), flush=True)


def check_draft(work: Path, draft: Path, data: Path, *, fix: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "speccompat", "check-draft", str(draft), str(data), *(["--fix"] if fix else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    return {"command": cmd[1:], "exit": proc.returncode, "output": proc.stdout.strip()}


def with_aux_ids(src: Path, dst: Path, aux_ids: list[int]) -> Path:
    """A copy of the draft ``src`` whose config sets ``eagle_aux_hidden_state_layer_ids`` to ``aux_ids``."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("optimizer*", "scheduler*", "*.bak*"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# ---------------------------------------------------------------------------------------------
# 4. serving


def serve(work: Path, name: str, draft: Path, *, max_tokens: int, lock: str | None) -> dict[str, Any]:
    out = work / f"serve-{name}.json"
    cmd = [sys.executable, "-m", "speccompat.testing.train_serve", "_serve", str(work / "target"), str(draft),
           str(work / "heldout.json"), str(max_tokens), str(out)]
    run_logged(cmd, work / "logs" / f"serve-{name}.log", env=_env(), lock=lock)
    return json.loads(out.read_text())


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters (``LLM.get_metrics()``), summed over engines."""
    got: dict[str, Any] = {c: 0 for c in SPEC_COUNTERS}
    got[PER_POS] = [0] * NUM_SPECULATIVE_TOKENS
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            got[m.name] += int(m.value)
        elif m.name == PER_POS:
            got[PER_POS] = [a + int(b) for a, b in zip(got[PER_POS], m.values, strict=True)]
    return got


def _child_serve(target: str, draft: str, heldout: str, max_tokens: str, out: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.monotonic()
    llm = LLM(model=target, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8,
              enable_prefix_caching=False, disable_log_stats=False, seed=0,
              speculative_config={"method": "eagle3", "model": draft,
                                  "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True)
    sets = []
    before = read_counters(llm)
    for group in json.loads(Path(heldout).read_text()):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params, use_tqdm=False)
        after = read_counters(llm)
        delta = {k: [a - b for a, b in zip(after[k], before[k], strict=True)] if k == PER_POS else after[k] - before[k]
                 for k in after}
        sets.append({"drafts": delta[SPEC_COUNTERS[0]], "draft_tokens": delta[SPEC_COUNTERS[1]],
                     "accepted": delta[SPEC_COUNTERS[2]], "accepted_per_pos": delta[PER_POS],
                     "outputs": [list(o.outputs[0].token_ids) for o in outs]})
        before = after
    import vllm

    doc = {"vllm": vllm.__version__, "engine_start_s": round(start_s, 1), "sets": sets,
           "speculative_config": {"method": "eagle3", "model": draft, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
           "sampling": {"temperature": 0, "max_tokens": int(max_tokens)}}
    Path(out).write_text(json.dumps(doc))


def acceptance(sets: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean accepted length (1 + accepted / drafts, vLLM's "mean acceptance length": the target's own
    token included) and per-position acceptance (accepted at position k / drafts), over all sets and
    per set."""

    def one(drafts: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
        return {"drafts": drafts, "accepted": accepted, "mean_accepted_length": round(1 + accepted / drafts, 4),
                "per_position": [round(a / drafts, 4) for a in per_pos]}

    total = one(sum(s["drafts"] for s in sets), sum(s["accepted"] for s in sets),
                [sum(col) for col in zip(*(s["accepted_per_pos"] for s in sets), strict=True)])
    total["per_set"] = [one(s["drafts"], s["accepted"], s["accepted_per_pos"])["mean_accepted_length"] for s in sets]
    return total


def compare(good: dict[str, Any], control: dict[str, Any]) -> dict[str, Any]:
    """Is ``good`` clearly better than ``control``? The margin comes from the noise between prompt
    sets: three times the standard deviation of the per-set differences (so at least six standard
    errors of their mean with four sets; never below 0.02 token), and ``good`` must win on every set."""
    diffs = [g - c for g, c in zip(good["per_set"], control["per_set"], strict=True)]
    noise = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    margin = max(3 * noise, 0.02)
    gap = good["mean_accepted_length"] - control["mean_accepted_length"]
    return {"gap": round(gap, 4), "per_set_gaps": [round(d, 4) for d in diffs], "noise_sd": round(noise, 4),
            "margin": round(margin, 4), "clearly_better": gap > margin and min(diffs) > 0}


# ---------------------------------------------------------------------------------------------
# the run


def run(work: Path, *, lock: str | None, mislabel: bool = False, with_04: bool = True, samples: int = 128,
        steps: int = 150, epochs_04: int = 5, lr: float = 3e-3, sets: int = 4, per_set: int = 8,
        max_tokens: int = 64, total_seq_len: int = 512) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str, t: float) -> None:
        timings[name] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    data_info = prepare(work, samples=samples, prompt_len=16, response_len=48, sets=sets, per_set=per_set, seed=0)
    lap("prepare", t)
    doc: dict[str, Any] = {"data": data_info, "layer_ids": LAYER_IDS, "mislabel": mislabel, "commands": {}}
    arrow = work / "data-arrow"
    t = time.monotonic()
    doc["commands"]["extract_arrow"] = extract(work, "speculators-arrow", arrow,
                                               MISLABELED_CAPTURE if mislabel else LAYER_IDS, lock)
    lap("extract_arrow", t)
    if mislabel:
        relabel_layers(arrow, LAYER_IDS)
        doc["mislabel_note"] = (f"captured layers {MISLABELED_CAPTURE}, recorded as {LAYER_IDS} (manifest header, "
                                "speccompat_arrow.json): the trainer and check-draft see the records")
    aux = recorded_aux_ids(arrow)
    shifted = [a - 1 for a in aux]
    doc["aux_ids"], doc["shifted_aux_ids"] = aux, shifted

    t = time.monotonic()
    draft09, args09 = train_09(work, arrow, work / "train09", aux, steps=steps, lr=lr, total_seq_len=total_seq_len)
    lap("train_09", t)
    untrained, args_dry = train_09(work, arrow, work / "untrained", aux, steps=steps, lr=lr,
                                   total_seq_len=total_seq_len, dry_run=True)
    doc["commands"]["train_09"] = ["speculators.train", *args09]
    doc["commands"]["untrained"] = ["speculators.train", *args_dry]
    doc["training_09"] = json.loads((draft09 / "speccompat_training.json").read_text())
    doc["check_draft"] = {"trained_09": check_draft(work, draft09, arrow)}
    shifted_dir = with_aux_ids(draft09, work / "drafts" / "trained09-shifted", shifted)
    doc["check_draft"]["trained_09_shifted"] = check_draft(work, shifted_dir, arrow)
    drafts = {"trained_09": draft09, "trained_09_shifted": shifted_dir, "untrained": untrained}

    if with_04 and not mislabel:
        data04 = work / "data-04"
        t = time.monotonic()
        doc["commands"]["extract_04"] = extract(work, "speculators", data04, LAYER_IDS, lock)
        lap("extract_04", t)
        t = time.monotonic()
        draft04, spec04 = train_04(work, data04, work / "train04", epochs=epochs_04, lr=lr, total_seq_len=total_seq_len)
        lap("train_04", t)
        doc["training_04"] = spec04
        fixed = work / "drafts" / "trained04"
        if fixed.exists():
            shutil.rmtree(fixed)
        shutil.copytree(draft04, fixed, ignore=shutil.ignore_patterns("optimizer*", "scheduler*"))
        doc["check_draft"]["trained_04_before_fix"] = check_draft(work, fixed, data04)
        doc["check_draft"]["trained_04_fix"] = check_draft(work, fixed, data04, fix=True)
        doc["check_draft"]["trained_04"] = check_draft(work, fixed, data04)
        drafts["trained_04"] = fixed

    doc["served"] = {}
    for name, path in drafts.items():
        t = time.monotonic()
        got = serve(work, name, path, max_tokens=max_tokens, lock=lock)
        lap(f"serve_{name}", t)
        doc["vllm"] = got["vllm"]
        doc["served"][name] = {"draft": str(path), "engine_start_s": got["engine_start_s"],
                               "aux_ids": json.loads((path / "config.json").read_text()).get(
                                   "eagle_aux_hidden_state_layer_ids"),
                               **acceptance(got["sets"])}
        doc["served"][name]["_outputs"] = [o for s in got["sets"] for o in s["outputs"]]
    base = doc["served"]["trained_09"]["_outputs"]
    for v in doc["served"].values():
        v["same_tokens_as_trained_09"] = sum(a == b for a, b in zip(v["_outputs"], base, strict=True))
        v["prompts"] = len(v.pop("_outputs"))
    doc["comparisons"] = {
        "trained_09_vs_shifted": compare(doc["served"]["trained_09"], doc["served"]["trained_09_shifted"]),
        "trained_09_vs_untrained": compare(doc["served"]["trained_09"], doc["served"]["untrained"]),
    }
    if "trained_04" in doc["served"]:
        doc["comparisons"]["trained_04_vs_untrained"] = compare(doc["served"]["trained_04"], doc["served"]["untrained"])
    doc["timings_s"] = {**timings, "total": round(time.monotonic() - t0, 1)}
    doc["machine"] = machine()
    (work / "results.json").write_text(json.dumps(doc, indent=1))
    return doc


def online(work: Path, *, lock: str | None, samples: int = 128, steps: int = 60, lr: float = 3e-3,
           total_seq_len: int = 512) -> dict[str, Any]:
    """The same speculators 0.9.0 training twice on the same samples: offline on the ``speccompat
    extract`` Arrow set (``--on-missing raise``), and online from rows alone against ``speccompat
    serve`` (file backend; ``--on-missing generate --vllm-endpoint``: speculators' ``ArrowDataset``
    asks the server for every row and deletes each file after reading it). Both runs are seeded
    alike, so equal hidden states give equal losses step by step and equal draft weights."""
    from speccompat.testing.online import ServerProcess, rows_only

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    data_info = prepare(work, samples=samples, prompt_len=16, response_len=48, sets=1, per_set=1, seed=0)
    arrow = work / "data-arrow"
    if not (arrow / "state.json").exists():
        extract(work, "speculators-arrow", arrow, LAYER_IDS, lock)
    aux = recorded_aux_ids(arrow)
    kw = {"steps": steps, "lr": lr, "total_seq_len": total_seq_len}
    for d in ("train09-offline", "train09-online", "data-online", "hs-online"):
        shutil.rmtree(work / d, ignore_errors=True)
    t = time.monotonic()
    offline_draft, args_off = train_09(work, arrow, work / "train09-offline", aux, **kw)
    offline_s = time.monotonic() - t
    rows = rows_only(arrow, work / "data-online")
    hs = work / "hs-online"
    server_args = ["--model-path", str(work / "target"), "--layer-ids", *map(str, LAYER_IDS), "--backend", "file",
                   "--hidden-states-dir", str(hs), "--max-model-len", "256", "--gpu-memory-utilization", "0.3"]
    with engine_lock(lock), ServerProcess(server_args, work / "logs" / "serve-online.log",
                                          env=_env(*speculators_04_path())) as server:
        t = time.monotonic()
        online_draft, args_on = train_09(work, rows, work / "train09-online", aux, vllm_endpoint=server.url + "/v1", **kw)
        online_s = time.monotonic() - t
    runs = {name: json.loads((d / "speccompat_training.json").read_text())
            for name, d in (("offline", offline_draft), ("online", online_draft))}
    pairs = list(zip(runs["offline"]["history"], runs["online"]["history"], strict=True))
    weights = _same_weights(offline_draft, online_draft)
    doc = {"data": {k: data_info[k] for k in ("samples", "tokens", "prompt_len", "response_len")},
           "layer_ids": LAYER_IDS, "aux_ids": aux, "steps": steps,
           "commands": {"offline": ["speculators.train", *args_off], "online": ["speculators.train", *args_on],
                        "serve": ["speccompat", "serve", *server_args]},
           "losses": [{"step": a["step"], "offline": a["loss"], "online": b["loss"]} for a, b in pairs],
           "max_abs_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in pairs),
           "val": {"offline": runs["offline"]["val"], "online": runs["online"]["val"]},
           "same_draft_weights": weights, "server_exit": server.returncode, "server_start_s": round(server.started_s, 1),
           "left_in_hs_dir": sorted(p.name for p in hs.glob("speccompat-*")),
           "timings_s": {"train_offline": round(offline_s, 1), "train_online": round(online_s, 1),
                         "total": round(time.monotonic() - t0, 1)},
           "machine": machine()}
    (work / "online-results.json").write_text(json.dumps(doc, indent=1))
    return doc


def _same_weights(a: Path, b: Path) -> dict[str, Any]:
    """Whether two saved drafts hold equal tensors (every safetensors file of their folders)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    if not files or files != sorted(p.name for p in b.glob("*.safetensors")):
        return {"files": files, "equal": False}
    tensors = differ = 0
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        tensors += len(x)
        differ += sum(k not in y or not torch.equal(x[k], y[k]) for k in x) + len(set(y) - set(x))
    return {"files": files, "tensors": tensors, "differing": differ, "equal": differ == 0}


def machine() -> dict[str, Any]:
    import platform

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit}


def summary(doc: dict[str, Any]) -> str:
    lines = [f"{'draft':<22} {'aux ids':<10} {'mean acc. len':>13}  {'per position':<24} per set"]
    for name, v in doc["served"].items():
        lines.append(f"{name:<22} {str(v['aux_ids']):<10} {v['mean_accepted_length']:>13.3f}  "
                     f"{str(v['per_position']):<24} {v['per_set']}")
    for name, c in doc["comparisons"].items():
        lines.append(f"{name}: gap {c['gap']:+.3f} (margin {c['margin']:.3f}, per-set gaps {c['per_set_gaps']}) "
                     f"-> {'clearly better' if c['clearly_better'] else 'NOT clearly better'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_train09":
        _child_train09(argv[1:])
        return 0
    if argv and argv[0] == "_train04":
        _child_train04(json.loads(argv[1]))
        return 0
    if argv and argv[0] == "_serve":
        _child_serve(*argv[1:6])
        return 0
    ap = argparse.ArgumentParser(prog="python -m speccompat.testing.train_serve", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the whole run; writes WORK/results.json")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--engine-lock", default=os.environ.get("SPECCOMPAT_ENGINE_LOCK"),
                   help="flock this file while each engine runs (default: $SPECCOMPAT_ENGINE_LOCK)")
    r.add_argument("--mislabel", action="store_true", help="the Arrow data set records layers one above those captured")
    r.add_argument("--no-04", dest="with_04", action="store_false", help="skip the speculators 0.4.0.1 path")
    r.add_argument("--steps", type=int, default=150, help="speculators 0.9.0 training steps")
    r.add_argument("--epochs-04", type=int, default=5, help="speculators 0.4.0.1 training epochs")
    r.add_argument("--samples", type=int, default=128, help="prepared samples (16 + 48 tokens each)")
    o = sub.add_parser("online", help="speculators 0.9.0 trained offline and online (speccompat serve) on the same "
                       "samples; writes WORK/online-results.json")
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--engine-lock", default=os.environ.get("SPECCOMPAT_ENGINE_LOCK"))
    o.add_argument("--steps", type=int, default=60)
    a = ap.parse_args(argv)
    if a.cmd == "online":
        doc = online(a.work, lock=a.engine_lock, steps=a.steps)
        print(json.dumps({k: doc[k] for k in ("losses", "max_abs_loss_diff", "same_draft_weights")}, indent=1))
        return 0
    doc = run(a.work, lock=a.engine_lock, mislabel=a.mislabel, with_04=a.with_04, steps=a.steps,
              epochs_04=a.epochs_04, samples=a.samples)
    print(summary(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
