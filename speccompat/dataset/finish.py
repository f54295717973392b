"""The one finish path of a data set, for a whole run and for ``speccompat merge``: once every
sample is in place, the layout writes its side files (:meth:`Layout.finalize`) from every
finished entry of the manifest, in input order."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from .directory import DatasetDir
from .layouts import layout_of
from .manifest import Manifest

__all__ = ["finish_dataset"]

logger = logging.getLogger("speccompat.dataset")


def _token_freq(ddir: DatasetDir, layout: Any, entries: list[dict[str, Any]], samples: list[Any] | None):
    """``{token id: count}`` over the loss-masked tokens of ``entries``: from this run's samples
    where they are the entry's input, else from the file's own input_ids and loss_mask."""
    def count() -> Counter[int]:
        import torch

        by_id = {s.id: s for s in samples or ()}
        freq: Counter[int] = Counter()
        for e in entries:
            s = by_id.get(e["id"])
            if s is not None and s.digest == e["input_sha256"]:
                ids, mask = list(s.input_ids), s.loss_mask
            else:
                _meta, tensors, _keep = layout.read(ddir.path(e["file"]))
                ids = torch.frombuffer(bytearray(tensors["input_ids"][2]), dtype=torch.int64).tolist()
                mask = (torch.frombuffer(bytearray(tensors["loss_mask"][2]), dtype=torch.int64).tolist()
                        if "loss_mask" in tensors else None)
            freq.update(t for k, t in enumerate(ids) if mask is None or mask[k])
        return freq
    return count


def finish_dataset(ddir: DatasetDir, manifest: Manifest | None = None, *, samples: list[Any] | None = None,
                   token_freq_path: Path | None = None, extra: dict[str, Any] | None = None,
                   speculators_version: str | None = None, changed: bool = True) -> bool:
    """Call the layout's :meth:`~speccompat.dataset.formats.Layout.finalize` with the directory,
    its finished entries in input order and the token frequencies. ``changed`` False (this run
    wrote nothing) leaves side files that exist as they are. Returns whether it was called."""
    manifest = manifest if manifest is not None else ddir.manifest()
    header = manifest.header
    if header is None:
        return False
    layout = layout_of(header)
    freq_path = ddir.token_freq_path(token_freq_path)
    side = [ddir.path(n) for n in layout.side_files]
    if not side:
        return False
    if not changed and all(os.path.lexists(p) for p in side) \
            and (freq_path.exists() or not layout.token_freq_beside):
        logger.info("no sample was written: the side files of %s stay as they are", ddir)
        return False
    entries = sorted(manifest.entries.values(), key=lambda e: (e["line"], e["id"]))
    info = {"header": header, "provenance": header["provenance"], "extra": {**(header.get("run") or {}), **(extra or {})},
            "speculators_version": speculators_version}
    layout.finalize(ddir, entries, token_freq=_token_freq(ddir, layout, entries, samples), token_freq_path=freq_path,
                    info=info)
    return True
