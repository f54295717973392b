"""Repeated timed passes of ``benchmarks/throughput.py``: which modes share an engine, the order of
their passes on it, and what a results file reports of them (every pass, the median, the spread,
and the growing workload's slowest call against its median one).

No engine here: ``throughput.py`` runs the passes and hands their records to these functions
(``tests/test_benchmark_passes.py`` checks them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

K = TypeVar("K")

#: A pass's fields that are the workload's, equal in every pass of it (the rest are the pass's own).
WORKLOAD_FIELDS = ("workload", "sequences", "tokens", "sequences_per_call", "driver_batch", "page_cache")

#: The workers' staging-file figures of a call (speccompat's capture stats): files made, seconds the
#: call waited for them, seconds they took on the workers' build thread beside the engine's steps.
STAGING_FIELDS = ("staging_made", "staging_made_s", "staging_built_s")


def engine_groups(modes: Sequence[str], shared: Iterable[str], *, per_mode: bool = False) -> list[list[str]]:
    """The child processes of a run, each a list of the modes it runs on one engine, in the order of
    ``modes``: the ``shared`` modes together (at the place of the first of them), every other mode
    alone; ``per_mode``: every mode alone."""
    shared = set(shared)
    groups: list[list[str]] = []
    together: list[str] | None = None
    for mode in dict.fromkeys(modes):
        if per_mode or mode not in shared:
            groups.append([mode])
        elif together is None:
            together = [mode]
            groups.append(together)
        else:
            together.append(mode)
    return groups


def interleave(runs: Sequence[K], passes: int) -> list[tuple[K, int]]:
    """The timed passes in round-robin order: every run's pass 0, then every run's pass 1, ..., so
    that a drift over the minutes of a run (clocks, the disk, the page cache) hits every run alike."""
    return [(run, p) for p in range(passes) for run in runs]


def summarize(passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One workload of one mode from its timed passes: the workload's fields, the median pass's
    figures (tokens/s, and the seconds and samples/s that rate gives), the spread (the slowest and
    fastest pass, and their difference relative to the median), and every pass in the order it ran.
    Passes that failed are kept under ``errors``; with none that ran, the first error is the result."""
    ok = [p for p in passes if "error" not in p]
    errors = [p["error"] for p in passes if "error" in p]
    if not ok:
        return {"workload": passes[0]["workload"], "error": errors[0], "errors": errors}
    first = ok[0]
    rates = [p["tokens_per_s"] for p in ok]
    median = statistics.median(rates)
    seconds = first["tokens"] / median
    out = {k: first[k] for k in WORKLOAD_FIELDS if k in first}
    out.update({"tokens_per_s": round(median, 1), "seconds": round(seconds, 3),
                "samples_per_s": round(first["sequences"] / seconds, 2),
                "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
                "spread": round((max(rates) - min(rates)) / median, 4), "passes_run": len(ok)})
    probes = [p["disk_parallel_after_gbps"] for p in ok if p.get("disk_parallel_after_gbps")]
    if probes:  # the disk's rate right after the passes that were followed by a probe
        out["disk_parallel_after_gbps"] = round(statistics.median(probes), 3)
    if errors:
        out["errors"] = errors
    out["passes"] = [{k: v for k, v in p.items() if k not in WORKLOAD_FIELDS} for p in passes]
    return out


def grow_calls(base: int, count: int, factor: float, sources: Sequence[Iterator[list[int]]]) -> list[list[list[int]]]:
    """The sequences of a growing workload's ``count`` calls, in the order they run, the ``sources``
    taking turns (call i's sequences come from ``sources[i % len(sources)]``): call i holds at least
    ``base`` x ``factor``^(i+1) tokens and more than the call before it (``base`` for the first),
    so that every call is larger than every call before it."""
    if factor <= 1:
        raise ValueError(f"the growth factor must be above 1, got {factor}")
    out, last = [], base
    for i in range(count):
        seqs = take_tokens(sources[i % len(sources)], max(math.ceil(base * factor ** (i + 1)), last + 1))
        out.append(seqs)
        last = sum(map(len, seqs))
    return out


def take_tokens(source: Iterator[list[int]], tokens: int) -> list[list[int]]:
    """Sequences from ``source`` until they hold at least ``tokens`` tokens."""
    out, n = [], 0
    while n < tokens:
        seq = next(source, None)
        if seq is None:
            raise ValueError(f"the source ran out at {n} of {tokens} tokens")
        out.append(seq)
        n += len(seq)
    return out


def grow_summary(calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A growing workload's calls and how even their rate is: the median call's tokens/s and the
    slowest's, relative to it (1.0: no call slower per token than the median one)."""
    rates = [c["tokens_per_s"] for c in calls]
    if not rates:
        return {"calls": []}
    median, slowest = statistics.median(rates), min(rates)
    return {"calls": list(calls), "median_tokens_per_s": round(median, 1), "slowest_tokens_per_s": slowest,
            "slowest_call": rates.index(slowest), "slowest_over_median": round(slowest / median, 4)}


def staging_sum(takes: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The staging figures of the worker's replies to one stream (one per take), summed."""
    takes = list(takes)
    return {"takes": len(takes), **{k: round(sum(t.get(k) or 0 for t in takes), 4) for k in STAGING_FIELDS}}


def mode_results(child: dict[str, Any], *, per_mode: bool = False) -> dict[str, dict[str, Any]]:
    """Each mode's entry of a results file from what its child process wrote (``throughput.Child``):
    its workloads (each summarized over its passes; ``per_mode``: the one pass of a
    --process-per-mode child, as results files had it before), the engine's start-up and the process tree's peak memory
    (shared by the modes of one engine, which are named), and its growing workload's calls."""
    out = {}
    for mode in child["modes"]:
        runs = [r for r in child["runs"].get(mode, []) if r]
        entry = {"mode": mode, "startup_s": child["startup_s"],
                 "workloads": [{k: v for k, v in r[0].items() if k != "at"} if per_mode else summarize(r)
                               for r in runs],
                 "peak_rss_mb": child["peak_rss_mb"], "peak_pss_mb": child["peak_pss_mb"]}
        if len(child["modes"]) > 1:
            entry["engine_shared_with"] = [m for m in child["modes"] if m != mode]
        if mode in child.get("grow", {}):
            entry["grow"] = grow_summary(child["grow"][mode])
        if not child.get("complete", True):
            entry["complete"] = False  # written before the child's last round (or it did not finish)
        out[mode] = entry
    return out


def repeated(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode timed in several fresh runs of its own (each a results entry of one pass per workload):
    one entry whose workloads are summarized over the runs, the first run's other fields."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[0])
    workloads = [summarize(list(ws)) for ws in zip(*(r["workloads"] for r in ok), strict=True)]
    return {**ok[0], "workloads": workloads, "runs": len(ok)}
