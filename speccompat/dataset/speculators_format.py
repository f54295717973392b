"""Side files of the ``speculators`` layout, as speculators' own
``scripts/data_generation_offline.py`` writes them at the end of a run:

- ``data_config.json``: ``DataGenerationConfig(...).to_dict()``, built with the installed
  speculators' own classes (0.3.0 has ``format.data_format_version``, 0.4 does not);
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
from collections import Counter
from pathlib import Path
from typing import Any

from packaging.version import Version

from .fsutil import write_atomic


def _write_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    write_atomic(path, data)

__all__ = ["default_token_freq_path", "write_side_files"]


def default_token_freq_path(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".token_freq.pt")


def _data_config(ds: Any) -> dict[str, Any]:
    from importlib.metadata import version

    from speculators.data_generation import config_generator as cg

    prov = ds.provenance
    versions = prov["versions"]
    cfg = cg.DataGenerationConfig(
        version=cg.DataGenerationConfig.VERSION,
        generated_at=prov["created"],
        speculators_version=versions.get("speculators") or version("speculators"),
        reproducibility=cg.ReproducibilityInfo(
            command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            package_versions=cg.PackageVersions(torch=versions.get("torch"), vllm=versions.get("vllm"),
                                                transformers=versions.get("transformers"),
                                                speculators=versions.get("speculators")),
        ),
        model=cg.ModelConfig(target_model_path=prov["model"]["path"],
                             tensor_parallel_size=prov["tensor_parallel_size"],
                             gpu_memory_utilization=ds.extra.get("gpu_memory_utilization", 0.0),
                             hidden_size=ds.hidden_size),
        data=cg.DataConfig(train_data_path=str(ds.extra.get("train_data_path", "")), seq_length=prov["max_seq_len"],
                           max_samples=ds.extra.get("max_samples"), num_samples=len(ds.manifest.entries),
                           seed=0, chat_template_note=ds.extra.get("chat_template_note",
                                                                   "Uses tokenizer's built-in chat template")),
        hidden_states=cg.HiddenStatesConfig(layer_ids=list(ds.layer_ids)),
        generation=cg.GenerationConfig(cache_dir=str(ds.extra.get("cache_dir", ""))),
        format=cg.FormatConfig.create_default(num_layers=len(ds.layer_ids), hidden_size=ds.hidden_size),
    )
    return cfg.to_dict()


def write_side_files(ds: Any, token_freq_path: Path | None = None) -> None:
    import torch

    entries = list(ds.manifest.entries.values())
    spec = ds.speculators_version or ds.provenance["versions"].get("speculators") or "0.4.0"
    if Version(spec) >= Version("0.4.0"):
        lengths = {e["file"].removeprefix("data_").removesuffix(".pt"): e["num_tokens"] for e in entries}
        lengths = dict(sorted(lengths.items(), key=lambda kv: int(kv[0])))
        _write_if_changed(ds.out_dir / "sample_lengths.json", json.dumps(lengths, indent=2).encode())
    _write_if_changed(ds.out_dir / "data_config.json", json.dumps(_data_config(ds), indent=2).encode())
    freq: Counter[int] = Counter()
    for s in ds.samples:
        mask = s.loss_mask if s.loss_mask is not None else None
        freq.update(t for k, t in enumerate(s.input_ids) if mask is None or mask[k])
    buf = io.BytesIO()
    torch.save(dict(freq), buf)
    path = Path(token_freq_path) if token_freq_path is not None else default_token_freq_path(ds.out_dir)
    _write_if_changed(path, buf.getvalue())
