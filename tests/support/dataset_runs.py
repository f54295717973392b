"""Data sets written the way the driver writes them, with fake results (no engine): the provenance
of a fake model, the scan of its input, a whole run and its manifest entries, hostile sample ids."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from .dataset_fakes import LAYERS, VOCAB, states

#: The writer and verify need torch; names, input checks and layer ids do not.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the writer needs torch")

HOSTILE = [
    "a/b", "a_b", "a%2fb", "a_b-3ec69c85a4", "a b", "A", "a", "Ab", "aB", "..", ".", ".hidden", "a\0b", "a\\b",
    "x" * 300, "x" * 299 + "y", "é", "e\u0301", "日本語", "%", "%25", "~", "a~b", "CON", "-", "_", "\ud800",
]


def provenance(model: Path, layout: str = "safetensors", *, layer_ids=LAYERS, dtype: str = "bfloat16",
               fp8_scale: str | None = None, **kw):
    """The provenance of a run of the fake model storing ``layer_ids`` as ``dtype`` (as the driver
    builds it: a StoredSpec of the options)."""
    from speccompat.dataset import collect_provenance, read_model_info
    from speccompat.dataset.spec import StoredSpec

    info = read_model_info(str(model))
    spec = StoredSpec.of_options(dtype, layer_ids, info.hidden_size, fp8_scale)
    args = dict(model_path=str(model), info=info, spec=spec, max_seq_len=64,
                on_long_line="truncate", tensor_parallel_size=1, layout=layout,
                status={"state": "armed", "adapter": "vllm_0_29_0", "vllm": {"raw": "0.32.0"},
                        "speculators": {"raw": "0.4.0.1"}, "patches": [{"id": "generator.generate", "state": "pending"}]})
    args.update(kw)
    return collect_provenance(**args)


def scan(path: Path, **kw):
    from speccompat.dataset import scan_jsonl

    return scan_jsonl(path, vocab_size=VOCAB, max_seq_len=64, **kw).samples


def run(out: Path, samples, prov, *, batch: int = 3, ops=None, seed: int = 0, **kw):
    """What the driver does after the engine started, with fake results."""
    from speccompat.dataset import open_dataset

    ds = open_dataset(out, samples, prov, **kw)
    writer = ds.writer(threads=3, ops=ops)
    try:
        for k in range(0, len(ds.todo), batch):
            writer.submit([ds.job(s, states(s, seed)) for s in ds.todo[k:k + batch]])
    finally:
        stats = writer.close(raise_error=False)
        ds.lock.close()
    err = writer.error
    if err is not None:
        raise err
    ds.finish(out.with_name(out.name + ".freq.pt"))
    return ds, stats


def manifest_entries(out: Path) -> list[dict]:
    lines = (out / "manifest.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[1:]]
