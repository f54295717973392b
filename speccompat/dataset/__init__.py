"""Hidden-state data sets for EAGLE-3 training: the machinery behind ``examples/*/extract_hidden_states.py``.

A driver reads samples (:func:`scan_jsonl`), describes the run (:func:`collect_provenance`),
opens the output directory (:func:`open_dataset`: checks, lock, provenance comparison, resume
plan with checksums, disk estimate, all before any engine starts), then feeds
:meth:`OpenDataset.writer`'s background writer with each batch's results. ``speccompat verify DIR``
(:func:`verify_dataset`) checks a data set offline. :class:`DatasetDir` owns the directory (names,
locks, manifests, the file check and the resume plan). Layouts, manifest and provenance: docs/dataset.md.

Importing this package imports neither torch nor safetensors; the writer needs torch (and
``xxhash`` for the default checksum: ``pip install 'speccompat[dataset]'``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REJECTED", "DatasetDir", "DatasetError", "DatasetWriter", "InputScan", "Manifest",
    "ModelInfo", "NoSpace", "OpenDataset", "Rejected", "Sample", "WriterFailed", "collect_provenance",
    "id_for_name", "name_for_id", "open_dataset", "read_model_info", "report_scan", "scan_jsonl", "verify_dataset",
]

_LAZY = {
    "EXIT_FAILED": "errors", "EXIT_INTERRUPTED": "errors", "EXIT_OK": "errors", "EXIT_REJECTED": "errors",
    "DatasetError": "errors", "NoSpace": "errors", "Rejected": "errors", "WriterFailed": "errors",
    "DatasetDir": "directory", "DatasetWriter": "writer", "InputScan": "inputs", "Sample": "inputs", "scan_jsonl": "inputs",
    "report_scan": "inputs", "Manifest": "manifest", "ModelInfo": "provenance", "read_model_info": "provenance",
    "OpenDataset": "store", "open_dataset": "store", "id_for_name": "names", "name_for_id": "names",
    "verify_dataset": "verify",
}


def __getattr__(name: str) -> Any:
    if name == "collect_provenance":
        from .provenance import collect

        return collect
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'speccompat.dataset' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"speccompat.dataset.{mod}"), name)
    globals()[name] = value
    return value
