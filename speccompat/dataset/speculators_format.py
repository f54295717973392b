"""The ``speculators`` layout (speculators 0.3/0.4): ``data_<i>.pt``, exactly what speculators 0.3/0.4's
``scripts/data_generation_offline.py`` writes with ``torch.save``: ``{"input_ids": LongTensor[n],
"hidden_states": [Tensor[n, hidden], ...], "loss_mask": LongTensor[n]}`` (all ones when the input
has no mask), read by ``speculators.train.data.Eagle3SampleFileDataset`` unchanged.

Its side files, as speculators' own
``scripts/data_generation_offline.py`` writes them at the end of a run:

- ``data_config.json``: ``DataGenerationConfig(...).to_dict()``, built with the installed
  speculators' own classes (0.3.0 has ``format.data_format_version``, 0.4 does not); after a merge
  ``reproducibility.command`` is the job's command and ``reproducibility.merged_from`` names the
  shards' commands and their number (speculators 0.3/0.4 write this file but read no key of it:
  their loader takes the ``*pt`` files and ``sample_lengths.json``);
- ``sample_lengths.json`` (speculators >= 0.4): ``{"<i>": num_tokens}`` for ``data_<i>.pt``, which
  0.4's ``Eagle3SampleFileDataset`` reads instead of estimating lengths from file sizes;
- the token-frequency file (``{token_id: count}`` over loss-masked tokens, ``torch.save``), which
  speculators' preprocessing writes to ``./token_freq.pt`` and ``build_vocab_mapping.py`` reads. It
  is written beside the output directory (default ``<output-dir>.token_freq.pt``), never inside it:
  speculators' loader takes every file ending in ``pt`` under the directory for a sample.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from packaging.version import Version

from .formats import Encoded, Layout, owned, st_dtype, tensor_buffer
from .fsutil import write_atomic
from .names import SPECULATORS_SIDE_FILES, token_freq_beside
from .spec import FP8_SPECULATORS_04, SPECULATORS, SUFFIXES, StoredSpec

__all__ = ["FP8_SPECULATORS_04", "SpeculatorsLayout", "default_token_freq_path", "write_side_files"]


def default_token_freq_path(out_dir: Path) -> Path:
    return token_freq_beside(out_dir)


def _data_config(entries: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import version

    import speccompat

    # `speccompat export`/`merge` run without the driver: speculators' import needs apply()'s fixes
    # (its pydantic models name `torch` in annotations they cannot resolve otherwise); idempotent.
    speccompat.apply()
    from speculators.data_generation import config_generator as cg

    prov, extra = info["provenance"], info.get("extra") or {}
    versions = prov["versions"]
    spec = StoredSpec.of_provenance(prov)
    hidden, layer_ids = spec.hidden_size, list(spec.layer_ids)
    cfg = cg.DataGenerationConfig(
        version=cg.DataGenerationConfig.VERSION,
        generated_at=prov["created"],
        speculators_version=versions.get("speculators") or version("speculators"),
        reproducibility=cg.ReproducibilityInfo(
            command=extra.get("command") or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            package_versions=cg.PackageVersions(torch=versions.get("torch"), vllm=versions.get("vllm"),
                                                transformers=versions.get("transformers"),
                                                speculators=versions.get("speculators")),
        ),
        model=cg.ModelConfig(target_model_path=prov["model"]["path"],
                             tensor_parallel_size=prov["tensor_parallel_size"],
                             gpu_memory_utilization=extra.get("gpu_memory_utilization", 0.0),
                             hidden_size=hidden),
        data=cg.DataConfig(train_data_path=str(extra.get("train_data_path", "")), seq_length=prov["max_seq_len"],
                           max_samples=extra.get("max_samples"), num_samples=len(entries),
                           seed=0, chat_template_note=extra.get("chat_template_note",
                                                                "Uses tokenizer's built-in chat template")),
        hidden_states=cg.HiddenStatesConfig(layer_ids=layer_ids),
        generation=cg.GenerationConfig(cache_dir=str(extra.get("cache_dir", ""))),
        format=cg.FormatConfig.create_default(num_layers=len(layer_ids), hidden_size=hidden),
    )
    out = cfg.to_dict()
    if isinstance(extra.get("merged_from"), dict):  # the shards a merged set was made by (no loader reads it)
        out["reproducibility"]["merged_from"] = extra["merged_from"]
    return out


def write_side_files(ddir: Any, entries: list[dict[str, Any]], *, token_freq: Any, token_freq_path: Path,
                     info: dict[str, Any]) -> None:
    """data_config.json, sample_lengths.json (speculators >= 0.4) and the token-frequency file, from
    the data set's finished ``entries`` (all of them, whatever this run's input or --limit was)."""
    import torch

    prov = info["provenance"]
    spec = info.get("speculators_version") or prov["versions"].get("speculators") or "0.4.0"
    if Version(spec) >= Version("0.4.0"):
        lengths = {e["file"].removeprefix("data_").removesuffix(".pt"): e["num_tokens"] for e in entries}
        lengths = dict(sorted(lengths.items(), key=lambda kv: int(kv[0])))
        ddir.write_side_file("sample_lengths.json", json.dumps(lengths, indent=2).encode())
    ddir.write_side_file("data_config.json", json.dumps(_data_config(entries, info), indent=2).encode())
    buf = io.BytesIO()
    torch.save(dict(token_freq()), buf)
    data = buf.getvalue()
    path = Path(token_freq_path)
    try:
        if path.read_bytes() == data:
            return
    except (FileNotFoundError, IsADirectoryError):
        pass
    write_atomic(path, data)


class SpeculatorsLayout(Layout):
    name = SPECULATORS
    suffix = SUFFIXES[SPECULATORS]
    side_files = SPECULATORS_SIDE_FILES
    token_freq_beside = True

    def file_name(self, sample_id: str, index: int) -> str:
        return f"data_{index}.pt"

    def is_sample_file(self, name: str) -> bool:
        return name.startswith("data_") and name.endswith(".pt")

    def tensors(self, sample: Any, hidden_states: list[Any], spec: StoredSpec) -> list[tuple[str, Any]]:
        import torch

        if spec.is_fp8:  # refused before anything starts (fp8.refuse_layout); never written
            raise ValueError(FP8_SPECULATORS_04)
        layer_ids, dtype = spec.layer_ids, getattr(torch, spec.torch_dtype_name)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.num_tokens
        named = [("input_ids", torch.tensor(sample.input_ids, dtype=torch.long)),
                 ("loss_mask", torch.tensor(mask, dtype=torch.long))]
        named += [(f"hidden_states_{i}", owned(h if h.dtype == dtype else h.to(dtype)))
                  for i, h in zip(layer_ids, hidden_states, strict=True)]
        return named

    def encode(self, named: list[tuple[str, Any]], metadata: dict[str, str]) -> Encoded:
        d = dict(named)
        obj = {"input_ids": d["input_ids"],
               "hidden_states": [t for n, t in named if n.startswith("hidden_states_")],
               "loss_mask": d["loss_mask"]}
        return Encoded(b"", [(n, st_dtype(t), list(t.shape), tensor_buffer(t)) for n, t in named], trailer=obj)

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        import torch

        try:
            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"torch.load failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(obj, dict) or not {"input_ids", "hidden_states", "loss_mask"} <= set(obj):
            raise ValueError("not a speculators sample dict (input_ids, hidden_states, loss_mask)")
        out = {"input_ids": obj["input_ids"], "loss_mask": obj["loss_mask"]}
        layer_ids = getattr(self, "layer_ids", None) or list(range(len(obj["hidden_states"])))
        if not isinstance(obj["hidden_states"], (list, tuple)) or not all(
                isinstance(t, torch.Tensor) for t in [obj["input_ids"], obj["loss_mask"], *obj["hidden_states"]]):
            raise ValueError("input_ids, loss_mask and hidden_states are not tensors")
        if len(obj["hidden_states"]) != len(layer_ids):
            raise ValueError(f"{len(obj['hidden_states'])} hidden-state tensors, expected {len(layer_ids)}")
        out.update({f"hidden_states_{i}": h for i, h in zip(layer_ids, obj["hidden_states"], strict=True)})
        return {}, {n: (st_dtype(t), list(t.shape), tensor_buffer(t)) for n, t in out.items()}, obj

    def read(self, path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], memoryview]], Any]:
        if os.path.islink(path):
            raise ValueError("a symbolic link (refused)")
        return self._read(path)

    def finalize(self, ddir: Any, entries: list[dict[str, Any]], *, token_freq: Any, token_freq_path: Path,
                 info: dict[str, Any]) -> None:
        write_side_files(ddir, entries, token_freq=token_freq, token_freq_path=token_freq_path, info=info)
