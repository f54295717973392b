"""A shard of a sharded extraction as the driver runs it, with fake results (no engine)."""

from __future__ import annotations

from pathlib import Path

from speccompat.dataset.shards import ShardSpec, open_shard

from .dataset_fakes import states


def run_shard(out: Path, samples, prov, k: int, n: int, *, batches: int | None = None, batch: int = 2, seed: int = 0,
              command: str | None = None):
    """One shard as the driver runs it, with fake results; ``batches``: stop after that many;
    ``command``: the command its header records (default: this process's)."""
    ds = open_shard(out, samples, prov, ShardSpec(n, k, "test"), extra={"command": command} if command else None)
    writer = ds.writer(threads=2)
    todo = ds.todo[: None if batches is None else batches * batch]
    try:
        for first in range(0, len(todo), batch):
            writer.submit([ds.job(s, states(s, seed)) for s in todo[first:first + batch]])
    finally:
        writer.close(raise_error=False)
        for h in ds.lock:
            h.close()
    assert writer.error is None
    return ds
