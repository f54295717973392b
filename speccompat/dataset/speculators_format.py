"""Side files of the ``speculators`` layout, as speculators' own
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
import sys
from pathlib import Path
from typing import Any

from packaging.version import Version

from .fsutil import write_atomic

__all__ = ["default_token_freq_path", "write_side_files"]


def default_token_freq_path(out_dir: Path) -> Path:
    from .directory import DatasetDir

    return DatasetDir(out_dir).token_freq_path()


def _data_config(entries: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import version

    import speccompat

    # `speccompat export`/`merge` run without the driver: speculators' import needs apply()'s fixes
    # (its pydantic models name `torch` in annotations they cannot resolve otherwise); idempotent.
    speccompat.apply()
    from speculators.data_generation import config_generator as cg

    prov, extra = info["provenance"], info.get("extra") or {}
    versions = prov["versions"]
    hidden = int(prov["model"]["hidden_size"])
    layer_ids = list(prov["hidden_states"]["layer_ids"])
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
