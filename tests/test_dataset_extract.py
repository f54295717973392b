"""``speccompat extract``: settings config.json decides are refused before anything starts or is
written; a KV cache too small is a setting; unverified steps fail their samples (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records

from speccompat.dataset import extract as ex
from speccompat.errors import HiddenStatesError, KVCacheTooSmall


def cfg(**kw):
    return ex.ExtractConfig(model_path="m", prepared_data="d.jsonl", output_dir="out", **kw)


def test_a_refused_command_exits_2_before_any_engine_and_writes_nothing(tmp_path, monkeypatch, caplog):
    model = model_dir(tmp_path, max_position_embeddings=2048, num_attention_heads=4, num_key_value_heads=4)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                    "--tp-size", "8", "--layer-ids", "1", "9"])
    assert code == 2 and not out.exists()
    assert "--max-seq-len 2048" in caplog.text and "--tp-size 8" in caplog.text
    assert "--layer-ids:" in caplog.text and "nothing was started or written" in caplog.text


@pytest.mark.parametrize(("layer_ids", "missing", "needle"), [
    (["1", "3"], None, "the last layer is 3, not the final decoder layer 5"),
    (["3", "1", "5"], None, "layer 1 follows layer 3; layers must be strictly ascending"),
    (["1", "5"], "pyarrow", "needs pyarrow: pip install 'speccompat[arrow]'"),
])
def test_speculators_arrow_refuses_before_any_engine(tmp_path, monkeypatch, caplog, layer_ids, missing, needle):
    """--format speculators-arrow: a layer set the trainer would misread, or no datasets/pyarrow, is
    refused by the settings check (exit 2), before an engine starts or anything is written, also for
    the launcher of several engines."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    import speccompat.dataset.parallel

    monkeypatch.setattr(speccompat.dataset.parallel, "launch_engines", lambda *a: pytest.fail("no engine may be launched"))
    for extra in ([], ["--data-parallel-size", "2"]):
        caplog.clear()
        code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                        "--format", "speculators-arrow", "--max-seq-len", "64", "--layer-ids", *layer_ids, *extra])
        assert code == 2 and not out.exists(), extra
        assert needle in caplog.text and "nothing was started or written" in caplog.text


@pytest.mark.parametrize(("fmt", "layer_ids", "needle"), [
    ("speculators", ["3", "1", "2"], "--layout speculators: the last layer is 2, not the largest of [3, 1, 2]"),
    ("speculators", ["1", "3", "2"], "not the largest of [1, 3, 2]"),
    ("speculators-arrow", ["5"], "--layout speculators-arrow: one layer ([5]) is the verifier's final state only"),
])
def test_a_layer_set_its_trainer_misreads_is_refused_before_any_engine(tmp_path, monkeypatch, caplog, fmt,
                                                                       layer_ids, needle):
    """speculators 0.3/0.4 take data["hidden_states"][-1] as the verifier's state: the last id must be
    the largest; speculators >= 0.5 take every layer but the last as the draft's input: one layer gives
    states of width 0. Both are refused (exit 2) before an engine starts or anything is written."""
    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                    "--format", fmt, "--max-seq-len", "64", "--layer-ids", *layer_ids])
    assert code == 2 and not out.exists()
    assert needle in caplog.text and "nothing was started or written" in caplog.text


def test_an_ordered_speculators_layer_set_passes_the_settings_check(tmp_path):
    """The refusal above is of the order only: the same ids with the largest last pass."""
    cfg = ex.ExtractConfig.from_args(ex.parse_args([
        "--model-path", str(model_dir(tmp_path)), "--prepared-data", str(tmp_path / "d.jsonl"),
        "--output-dir", str(tmp_path / "o"), "--format", "speculators", "--max-seq-len", "64",
        "--layer-ids", "1", "2", "3"]))
    _info, layer_ids = ex.check_settings(cfg)
    assert layer_ids == [1, 2, 3]


class Gen:
    """A generator fed continuously, as speccompat.generator.stream drives one (installed by the
    ``fake_stream`` fixture): it reads ``ahead`` inputs before handing states out, hands them out in
    pairs, last read first (completion order is not input order), and rejects a sequence whose first
    token is in ``bad`` once it is read. ``unverified_at``: the stream's unverified-steps count
    rises when that sequence is handed out. ``kv_small``: the stream and every generate() call raise
    KVCacheTooSmall. Each state is the sequence's first token (its identity)."""

    def __init__(self, bad=(), unverified_at=None, kv_small=False, ahead=3):
        self.bad, self.unverified_at, self.kv_small, self.ahead = set(bad), unverified_at, kv_small, ahead
        self.calls, self.streams = [], 0

    def stream(self, inputs, max_in_flight_tokens):
        self.streams += 1
        if self.kv_small:
            raise KVCacheTooSmall("the KV cache is too small for them", longest=3)
        read, unverified = [], 0
        for i, seq in enumerate(inputs):
            if seq[0] in self.bad:
                raise HiddenStatesError(f"sequence {i}, layer 2: non-finite values")
            read.append((i, seq))
            if len(read) >= self.ahead or i == 0:
                continue
            for j, s in reversed(read[:2]):
                unverified += s[0] == self.unverified_at
                yield j, [s[0]], {"unverified_steps": unverified}
            del read[:2]
        for j, s in reversed(read):
            unverified += s[0] == self.unverified_at
            yield j, [s[0]], {"unverified_steps": unverified}

    def generate(self, ids, copy=True):
        self.calls.append(ids[0][0])
        if self.kv_small:
            raise KVCacheTooSmall("the KV cache is too small for them", longest=3)
        if ids[0][0] in self.bad:
            raise HiddenStatesError("non-finite values")
        self._speccompat_stats = {"unverified_steps": 0}
        return [{"hidden_states": [ids[0][0]]}]


@pytest.fixture
def fake_stream(monkeypatch):
    import speccompat.generator

    def stream(gen, inputs, *, max_in_flight_sequences, max_in_flight_tokens, copy):
        assert max_in_flight_sequences is None and not copy and max_in_flight_tokens >= 1
        return gen.stream(inputs, max_in_flight_tokens)

    monkeypatch.setattr(speccompat.generator, "stream", stream)


def samples(n):
    return [types.SimpleNamespace(input_ids=[100 + i, 2, 3], num_tokens=3, id=f"s{i}") for i in range(n)]


def outcome(results):
    """{sample id: its states' identity, or the exception's class name}."""
    return {s.id: type(r).__name__ if isinstance(r, Exception) else r[0] for s, r in results}


def test_every_sample_comes_back_once_whatever_the_completion_order(fake_stream):
    todo = samples(9)
    results = list(ex.stream_results(Gen(), todo, 64))
    assert [s.id for s, _ in results] != [s.id for s in todo]  # delivered in completion order
    assert outcome(results) == {s.id: s.input_ids[0] for s in todo} and len(results) == 9


def test_a_rejected_sample_fails_alone_and_the_stream_goes_on(fake_stream):
    todo, gen = samples(9), Gen(bad={104})
    results = list(ex.stream_results(gen, todo, 64))
    want = {s.id: s.input_ids[0] for s in todo} | {"s4": "HiddenStatesError"}
    assert outcome(results) == want and len(results) == 9
    # the samples read and not handed out when the stream stopped ran one at a time; then a new stream
    assert 104 in gen.calls and len(gen.calls) <= gen.ahead + 1 and gen.streams == 2


def test_samples_of_an_unverified_step_are_run_again_one_at_a_time(fake_stream):
    todo, gen = samples(6), Gen(unverified_at=102)
    results = list(ex.stream_results(gen, todo, 64))
    assert outcome(results) == {s.id: s.input_ids[0] for s in todo} and len(results) == 6
    assert 102 in gen.calls  # not taken from the stream, whose step could not be verified


def test_a_kv_cache_too_small_is_raised_not_failed_per_sample(fake_stream):
    with pytest.raises(KVCacheTooSmall):
        list(ex.stream_results(Gen(kv_small=True), samples(2), 64))
    with pytest.raises(KVCacheTooSmall):
        ex.generate_one(Gen(kv_small=True), samples(1)[0])
    assert isinstance(ex.generate_one(Gen(bad={100}), samples(1)[0]), HiddenStatesError)


def test_the_in_flight_budget_is_half_the_memory_budget_and_at_least_one_sample():
    info = types.SimpleNamespace(hidden_size=4096)
    cfg = ex.ExtractConfig(model_path="m", prepared_data="d", output_dir="o", max_in_flight_gb=8.0, max_seq_len=2048)
    assert ex.in_flight_tokens(cfg, info, [2, 30, 58, 60]) == int(4e9 / (4 * 4096 * 4))
    tiny = dataclasses.replace(cfg, max_in_flight_gb=0.001)
    assert ex.in_flight_tokens(tiny, info, [2, 30, 58, 60]) == cfg.max_model_len


def test_the_run_stops_on_a_kv_cache_too_small_and_names_the_settings(tmp_path, monkeypatch, caplog, fake_stream):
    pytest.importorskip("torch", reason="the data set's writer")
    import speccompat

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(6))
    status = types.SimpleNamespace(state="armed", warnings=[], errors=[], speculators={"raw": "0.4.0.1"},
                                   as_dict=lambda: {"state": "armed", "vllm": {"raw": "0.32.0"}})
    monkeypatch.setattr(speccompat, "apply", lambda **kw: status)
    gen = Gen(kv_small=True)
    monkeypatch.setattr(ex, "start_generator", lambda *a: gen)
    code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(tmp_path / "o"),
                    "--layer-ids", "1", "2", "4", "5", "--gpu-memory-utilization", "0.0001", "--no-progress",
                    "--batch-size", "2"])
    assert code == 1 and gen.streams == 1 and gen.calls == []  # stopped at once: no per-sample retries
    assert "re-running the same command fails the same way" in caplog.text
    assert "Raise --gpu-memory-utilization (now 0.0001)" in caplog.text
    assert "--batch-size 2 is no longer used" in caplog.text
    assert "re-run the same command to retry" not in caplog.text
    assert json.loads((tmp_path / "o" / "manifest.jsonl").read_text().splitlines()[0])["speccompat_dataset"] == 1


def run_command(tmp_path, command, *flags, env=None, path=()):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    model = model_dir(tmp_path, max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=4)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    head = ([str(repo / "examples" / "kimi_k25" / "extract_hidden_states.py")] if command == "example"
            else ["-m", "speccompat", "extract"])
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPECCOMPAT_")}
    return subprocess.run([sys.executable, *head, "--model-path", str(model), "--prepared-data", str(data),
                           "--output-dir", str(tmp_path / "out"), *flags], capture_output=True, text=True,
                          env={**environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(repo)]), **(env or {})}, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("command", ["example", "cli"])
def test_the_example_driver_and_the_cli_are_the_command(tmp_path, command):
    """examples/kimi_k25/extract_hidden_states.py and ``speccompat extract`` run the same command:
    a refusal there is exit 2 before speccompat.apply() or any engine, and nothing is written."""
    proc = run_command(tmp_path, command, "--tp-size", "3")
    assert proc.returncode == 2, proc.stderr
    assert "--max-seq-len 2048: the engine gets max_model_len = max_seq_len + 1 = 2049" in proc.stderr
    assert "--tp-size 3: the model's 4 attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_bad_vllm_version_override_is_refused_naming_the_variable(tmp_path):
    from support.fakes import write_fake_speculators

    site = tmp_path / "site"
    write_fake_speculators(site, "0.4.0.1")
    proc = run_command(tmp_path, "cli", "--max-seq-len", "64", "--layer-ids", "1", "2",
                       env={"SPECCOMPAT_VLLM_VERSION": "garbage"}, path=[site])
    assert proc.returncode == 2, proc.stderr
    assert "SPECCOMPAT_VLLM_VERSION='garbage' is not a version: set it to a vLLM release version" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_the_progress_bar_counts_tokens_on_a_terminal_only(monkeypatch):
    import sys

    made = []
    fake = types.ModuleType("tqdm")
    fake.tqdm = lambda **kw: made.append(kw) or kw
    monkeypatch.setitem(sys.modules, "tqdm", fake)
    todo = samples(4)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = ex._progress_bar(cfg(), todo)
    assert bar["total"] == 12 and bar["unit"] == "tok" and bar["unit_scale"] is True  # tokens/s and ETA
    assert ex._progress_bar(cfg(progress=False), todo) is None
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: log lines only
    assert ex._progress_bar(cfg(), todo) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert ex._progress_bar(cfg(), todo) is None and len(made) == 1


@pytest.mark.parametrize(("cpus", "threads"), [(1, 2), (2, 2), (3, 3), (8, 8), (16, 16), (17, 16), (224, 16)])
def test_default_writer_threads_is_one_per_cpu_within_bounds(monkeypatch, cpus, threads):
    monkeypatch.setattr(ex.os, "sched_getaffinity", lambda _pid: set(range(cpus)), raising=False)
    assert ex.default_writer_threads() == threads
    assert ex.parse_args(["--model-path", "m", "--prepared-data", "d", "--output-dir", "o"]).writer_threads == threads
    cfg = ex.ExtractConfig(model_path="m", prepared_data=ex.Path("d"), output_dir=ex.Path("o"))
    assert cfg.writer_threads == threads
    assert "--writer-threads" not in cfg.to_argv()  # left for the machine that runs the job
    assert dataclasses.replace(cfg, writer_threads=threads + 1).to_argv()[-2:] == ["--writer-threads", str(threads + 1)]


def test_the_summary_times_the_extraction_without_the_engine_shutdown(tmp_path, monkeypatch, caplog, capfd):
    """The engine's shutdown (seconds of vLLM stopping its workers) is reported on its own, not as
    extraction time; the trainer's flags are the only thing on stdout."""
    pytest.importorskip("torch", reason="the data set's writer")
    import logging
    import re
    import time

    from support.dataset_fakes import states

    import speccompat

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(4))
    status = types.SimpleNamespace(state="armed", warnings=[], errors=[], speculators={"raw": "0.4.0.1"},
                                   as_dict=lambda: {"state": "armed", "vllm": {"raw": "0.32.0"}})
    monkeypatch.setattr(speccompat, "apply", lambda **kw: status)
    monkeypatch.setattr(ex, "use_spawn", lambda: None)
    monkeypatch.setattr(ex, "start_generator", lambda *a: object())
    monkeypatch.setattr(ex, "kv_cache_problem", lambda *a: None)
    monkeypatch.setattr(ex, "stream_results", lambda gen, todo, budget: ((s, states(s)) for s in todo))
    monkeypatch.setattr(ex, "stop_generator", lambda gen: time.sleep(1.5))
    caplog.set_level(logging.INFO, logger="speccompat.extract")
    code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(tmp_path / "o"),
                    "--layer-ids", "1", "2", "4", "5", "--no-progress"])
    assert code == 0
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("summary:"))
    found = re.search(r"extraction ([0-9.]+) s: [0-9]+ tokens/s, engine shutdown ([0-9.]+) s", summary)
    assert found, summary
    assert float(found.group(1)) < 1.0 and float(found.group(2)) >= 1.5, summary
    out = capfd.readouterr().out
    assert out.startswith("layers stored: 1 2 4 5 of 6") and "summary:" not in out, out
