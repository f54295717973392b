"""How ``benchmarks/throughput.py`` repeats its timed passes and what its results file says of them:
which modes share an engine, the round-robin order the passes run in (checked on the child's own
loop, with stand-in extractors instead of an engine), the median and spread of each workload, the
ratios taken from the medians, and the growing workload (each call larger than all before it, the
slowest call against the median one, the workers' staging figures)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _passes  # noqa: E402  (benchmarks/_passes.py)
import throughput  # noqa: E402  (benchmarks/throughput.py)


def test_modes_on_speculators_generator_share_one_engine_and_the_others_get_their_own():
    modes = ["plain", "generator", "native", "driver-stream-disk", "generator-views", "driver", "plain"]
    assert _passes.engine_groups(modes, throughput.SHARED_MODES) == [
        ["plain"], ["generator", "driver-stream-disk", "generator-views", "driver"], ["native"]]
    assert _passes.engine_groups(modes, throughput.SHARED_MODES, per_mode=True) == [
        ["plain"], ["generator"], ["native"], ["driver-stream-disk"], ["generator-views"], ["driver"]]
    # the modes that change how the generator is built keep an engine of their own
    for mode in ("original", "generator-views-sync", "generator-views-async", "generator-on-call", "driver-dp"):
        assert mode not in throughput.SHARED_MODES


def test_passes_run_round_robin():
    assert _passes.interleave(["a", "b", "c"], 3) == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1),
                                                      ("a", 2), ("b", 2), ("c", 2)]
    assert _passes.interleave(["a"], 2) == [("a", 0), ("a", 1)]


def one_pass(tps: float, tokens: int = 1000, sequences: int = 10, **extra) -> dict:
    return {"workload": "main", "seconds": round(tokens / tps, 3), "sequences": sequences, "tokens": tokens,
            "tokens_per_s": tps, "samples_per_s": round(sequences * tps / tokens, 2), "sequences_per_call": 10,
            **extra}


def test_a_workload_is_its_median_pass_with_the_spread_and_every_pass():
    passes = [one_pass(100.0, at=0), one_pass(125.0, at=3), one_pass(90.0, at=6)]
    got = _passes.summarize(passes)
    assert got["tokens_per_s"] == 100.0 and got["seconds"] == 10.0 and got["samples_per_s"] == 1.0
    assert (got["tokens_per_s_min"], got["tokens_per_s_max"], got["spread"]) == (90.0, 125.0, 0.35)
    assert [p["tokens_per_s"] for p in got["passes"]] == [100.0, 125.0, 90.0]  # in the order they ran
    assert [p["at"] for p in got["passes"]] == [0, 3, 6]
    assert "workload" not in got["passes"][0] and got["workload"] == "main" and got["tokens"] == 1000
    even = _passes.summarize([one_pass(100.0), one_pass(110.0)])
    assert even["tokens_per_s"] == 105.0 and even["seconds"] == round(1000 / 105, 3)


def test_a_failed_pass_is_kept_and_does_not_count():
    failed = {"workload": "main", "error": "RuntimeError: boom"}
    got = _passes.summarize([one_pass(100.0), failed, one_pass(80.0)])
    assert got["tokens_per_s"] == 90.0 and got["errors"] == ["RuntimeError: boom"] and len(got["passes"]) == 3
    assert _passes.summarize([failed])["error"] == "RuntimeError: boom"


def test_the_disk_probe_of_a_workload_is_the_median_of_the_probes_after_its_passes():
    got = _passes.summarize([one_pass(100.0, disk_parallel_after_gbps=1.5), one_pass(90.0),
                             one_pass(95.0, disk_parallel_after_gbps=1.2)])
    assert got["disk_parallel_after_gbps"] == 1.35
    assert "disk_parallel_after_gbps" not in _passes.summarize([one_pass(100.0)])


def child_doc(modes: list[str], runs: dict[str, list[list[dict]]], **extra) -> dict:
    return {"modes": modes, "startup_s": 12.5, "passes": 3, "order": [], "runs": runs, "grow": {},
            "complete": True, "peak_rss_mb": 100.0, "peak_pss_mb": 80.0, **extra}


def test_ratios_are_taken_from_the_medians_not_the_best_passes():
    args = argparse.Namespace(model_path="/nonexistent", model="llama", set=[], min_len=1, max_len=2, warm_up="first",
                              fp8_scale="token", driver_format="safetensors", repeat=3, process_per_mode=False,
                              warm_up_sequences=0, probe_after="each", grow=0)
    results = {}
    results.update(_passes.mode_results(child_doc(["plain"], {"plain": [[one_pass(100.0), one_pass(104.0),
                                                                          one_pass(96.0)]]})))
    shared = child_doc(["driver-stream", "driver-stream-fp8"], {
        "driver-stream": [[one_pass(90.0), one_pass(99.0), one_pass(80.0)]],
        "driver-stream-fp8": [[one_pass(85.0), one_pass(70.0), one_pass(88.0)]]})
    results.update(_passes.mode_results(shared))
    doc = throughput.document(args, [[1, 2]] * 4, [{"name": "main"}], results, [{"modes": ["plain"]}])
    ratios = doc["ratios"]["main"]
    assert ratios["driver-stream/plain"] == 0.9  # 90 / 100, the medians (the best passes: 99 / 104)
    assert ratios["driver-stream-fp8/plain"] == 0.85
    assert ratios["driver-stream-fp8/driver-stream"] == round(85 / 90, 3)  # fp8 against bf16 of the same place
    assert doc["passes"] == 3 and doc["order"] == "round-robin"
    entry = doc["results"]["driver-stream"]
    assert entry["engine_shared_with"] == ["driver-stream-fp8"] and entry["startup_s"] == 12.5
    assert entry["workloads"][0]["tokens_per_s_max"] == 99.0
    assert "engine_shared_with" not in doc["results"]["plain"]


def test_a_process_per_mode_child_gives_the_entry_results_files_had_before():
    single = one_pass(100.0, last_call={"files": 10})
    got = _passes.mode_results(child_doc(["driver"], {"driver": [[{**single, "at": 0}], [one_pass(90.0, at=1)]]}),
                               per_mode=True)
    assert got == {"driver": {"mode": "driver", "startup_s": 12.5, "workloads": [single, one_pass(90.0)],
                              "peak_rss_mb": 100.0, "peak_pss_mb": 80.0}}
    assert list(got["driver"]) == ["mode", "startup_s", "workloads", "peak_rss_mb", "peak_pss_mb"]


def test_fresh_runs_of_a_mode_are_summarized_over_the_runs():
    runs = [{"mode": "driver-dp", "engines": 2, "workloads": [one_pass(tps)]} for tps in (100.0, 80.0, 90.0)]
    got = _passes.repeated([*runs, {"mode": "driver-dp", "error": "engine 1: boom"}])
    assert got["workloads"][0]["tokens_per_s"] == 90.0 and got["runs"] == 3 and got["engines"] == 2


def test_the_growing_workload_grows_by_the_factor_and_every_call_is_larger():
    calls = _passes.grow_calls(1000, 4, 1.15, [iter([[1] * 10] * 1000)])
    assert [sum(map(len, c)) for c in calls] == [1150, 1330, 1530, 1750]  # 1000 x 1.15^k, in whole sequences
    # sequences longer than the growth: each call still one sequence more than the one before
    calls = _passes.grow_calls(1000, 3, 1.01, [iter([[1] * 400] * 100)])
    assert [sum(map(len, c)) for c in calls] == [1200, 1600, 2000]
    # two modes taking turns: their calls alternate, each larger than the other's before it
    a, b = iter([[1] * 10] * 1000), iter([[2] * 10] * 1000)
    calls = _passes.grow_calls(1000, 4, 1.15 ** 0.5, [a, b])
    assert [c[0][0] for c in calls] == [1, 2, 1, 2]
    sizes = [sum(map(len, c)) for c in calls]
    assert sizes == sorted(set(sizes)) and sizes[2] / sizes[0] == pytest.approx(1.15, abs=0.01)
    with pytest.raises(ValueError, match="above 1"):
        _passes.grow_calls(1000, 2, 1.0, [a])
    with pytest.raises(ValueError, match="ran out"):
        _passes.take_tokens(iter([[1] * 400]), 1150)


def test_the_slowest_call_is_reported_against_the_median_call():
    calls = [{"call": k, "tokens_per_s": t} for k, t in enumerate([100.0, 96.0, 101.0, 90.0, 99.0])]
    got = _passes.grow_summary(calls)
    assert (got["median_tokens_per_s"], got["slowest_tokens_per_s"], got["slowest_call"]) == (99.0, 90.0, 3)
    assert got["slowest_over_median"] == round(90 / 99, 4) and got["calls"] == calls


def test_a_streams_staging_figures_are_summed_over_its_takes():
    takes = [{"staging_made": 1, "staging_made_s": 0.25, "staging_built_s": 1.5},
             {"staging_made": 0, "staging_made_s": 0.0, "staging_built_s": 0.0},
             {"staging_made": 2, "staging_made_s": 0.5, "staging_built_s": 2.25}]
    assert _passes.staging_sum(takes) == {"takes": 3, "staging_made": 3, "staging_made_s": 0.75,
                                          "staging_built_s": 3.75}


def test_each_take_of_a_stream_is_recorded_once(monkeypatch):
    import speccompat.generator as generator

    first, second = {"staging_made": 1}, {"staging_made": 0}
    closed = []

    def fake_stream(gen, token_ids, **kw):
        try:
            yield 0, ["h"], first
            yield 2, ["h"], first  # the same take
            yield 1, ["h"], second
        finally:
            closed.append(True)

    monkeypatch.setattr(generator, "stream", fake_stream)
    takes = throughput.record_takes()
    assert throughput.record_takes() is takes  # installed once
    assert [i for i, _, _ in generator.stream(None, [])] == [0, 2, 1]
    assert takes == [first, second] and closed == [True]
    items = generator.stream(None, [])
    next(items)
    items.close()  # the consumer stops early: the real stream is closed (its requests aborted)
    assert closed == [True, True]


# ------------------------------------------------------------------ the child's loop, no engine


class FakeExtract:
    """An extractor as the child uses it: ``extract(batch)`` records what it was asked, and as a driver
    its input is prepared first and what it wrote is cleaned up after."""

    def __init__(self, mode: str, log: list) -> None:
        self.mode, self.log = mode, log
        self.cleanup, self.calls, self.prepared = [], [], set()
        if mode in throughput.DRIVER_MODES:
            self.prepare = lambda batch: self.prepared.add(id(batch))

    def __call__(self, batch):
        tokens = sum(map(len, batch))
        time.sleep(1e-4 * (1 + tokens / 1000))
        self.log.append((self.mode, tokens, len(batch), getattr(self, "batch", None), id(batch) in self.prepared))
        self.stats = {"staging_made": 1, "staging_made_s": 0.0, "staging_built_s": 0.5}
        if self.mode in throughput.DRIVER_MODES:
            self.cleanup.append(lambda: None)


def child_args(tmp_path: Path, modes: list[str], **kw) -> argparse.Namespace:
    workloads = [{"name": "main", "seqs": throughput.sequences(12, 20, 60), "per_call": 4}]
    (tmp_path / "inputs.json").write_text(json.dumps(workloads))
    base = dict(child=",".join(modes), inputs=str(tmp_path / "inputs.json"), child_out=str(tmp_path / "out.json"),
                passes=3, warm_up="first", warm_up_sequences=0, probe_after="each", grow=0, grow_factor=1.15,
                grow_modes=["generator-views", "driver-stream"], min_len=20, max_len=60, driver_batch=2,
                driver_batches=[8], page_cache=["drop"], process_per_mode=False, dp_size=None, barrier=None,
                driver_torch_threads=None, switch_interval=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def fake_engine(monkeypatch):
    log: list = []
    monkeypatch.setattr(throughput, "open_modes", lambda args, modes: {m: FakeExtract(m, log) for m in modes})
    monkeypatch.setattr(throughput, "settle", lambda: 0.0)
    return log


def test_the_child_warms_up_then_times_every_run_round_robin(tmp_path, fake_engine):
    args = child_args(tmp_path, ["generator-views", "driver-stream", "driver"])
    doc = throughput.Child(args).run()
    runs = [["generator-views", "main"], ["driver-stream", "main"], ["driver", "main"], ["driver", "main, batch=8"]]
    assert doc["order"] == [[*r, p] for p in range(3) for r in runs]
    # warm-up: each mode's first run, untimed, before any timed pass; generate() calls of 4 sequences
    # for the views, one job for each driver mode (the batched driver's calls: --driver-batch, then 8)
    warm, timed = fake_engine[:5], fake_engine[5:]
    assert [(m, n) for m, _, n, _, _ in warm] == [("generator-views", 4)] * 3 + [("driver-stream", 12), ("driver", 12)]
    assert [e[3] for e in timed if e[0] == "driver"] == [2, 8] * 3
    assert all(prepared for m, *_, prepared in timed if m != "generator-views")  # input written before the clock
    assert len(timed) == 3 * (3 + 1 + 1 + 1)
    stream = doc["runs"]["driver-stream"]
    assert len(stream) == 1 and [p["at"] for p in stream[0]] == [1, 5, 9]
    assert [len(r) for r in doc["runs"]["driver"]] == [3, 3] and doc["complete"] is True
    assert json.loads(Path(args.child_out).read_text())["complete"] is False  # the last round's is the caller's


def test_the_childs_growing_calls_are_each_larger_than_every_call_of_their_kind_before(tmp_path, fake_engine):
    args = child_args(tmp_path, ["generator-views", "driver-stream", "generator"], grow=4,
                      grow_modes=["generator-views", "generator", "driver-stream"])
    doc = throughput.Child(args).run()
    warm = fake_engine[:7]  # views and generator: 3 calls each; the driver: one stream
    grown = fake_engine[7:7 + 12]
    assert [m for m, *_ in grown] == ["generator-views", "driver-stream", "generator"] * 4  # turns taken
    def of(kind: str, entries: list) -> list[int]:
        return [t for m, t, *_ in entries if (m in throughput.STREAM_MODES) == (kind == "stream")]

    for kind in ("generate", "stream"):
        before = max(of(kind, warm))
        for t in of(kind, grown):
            assert t > before
            before = t
    views = doc["grow"]["generator-views"]
    assert [c["call"] for c in views] == [0, 1, 2, 3] and all(c["staging_built_s"] == 0.5 for c in views)
    # the first call at least the factor's share (two generate() modes take turns) above the warm-up's largest
    assert views[0]["tokens"] >= max(of("generate", warm)) * 1.15 ** 0.5
    assert doc["grow"]["driver-stream"][0]["tokens"] >= max(of("stream", warm)) * 1.15
    assert [o[1] for o in doc["order"][:3]] == ["grow=0"] * 3  # before the timed passes
    summary = _passes.mode_results(doc)["generator-views"]["grow"]
    assert 0 < summary["slowest_over_median"] <= 1 and len(summary["calls"]) == 4
