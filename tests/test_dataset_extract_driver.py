"""The driver (``speccompat extract``) with a fake engine: an id the writer cannot store is refused or
skipped before the engine starts; a sample the writer cannot store fails alone and is counted; a KV
cache too small for the longest sample is found before any sample runs and counted."""

from __future__ import annotations

import json
import re
import types

import pytest
from support.dataset_fakes import HIDDEN, jsonl, model_dir, random_records

from speccompat.dataset import extract as ex

pytest.importorskip("torch", reason="the data set's writer")


class FakeGen:
    """A started engine: ``stream`` hands out float32 states of every sample (its first token id
    as their value, or ``huge`` for the first tokens in ``huge_for``)."""

    def __init__(self, huge_for=(), kv_blocks=None, block=16):
        self.huge_for = set(huge_for)
        self.started = True
        self.seen: list[int] = []
        if kv_blocks is not None:
            self.scheduler = types.SimpleNamespace(
                block_size=block, kv_cache_config=types.SimpleNamespace(num_blocks=kv_blocks, kv_cache_groups=[0]))

    def stream(self, inputs):
        import torch

        for i, seq in enumerate(inputs):
            self.seen.append(seq[0])
            value = 1e6 if seq[0] in self.huge_for else float(seq[0])
            yield i, [torch.full((len(seq), HIDDEN), value, dtype=torch.float32) for _ in range(4)], {}


@pytest.fixture
def engine(monkeypatch, tmp_path, caplog):
    import speccompat
    import speccompat.generator

    status = types.SimpleNamespace(state="armed", warnings=[], errors=[], speculators={"raw": "0.4.0.1"},
                                   as_dict=lambda: {"state": "armed", "vllm": {"raw": "0.32.0"}})
    monkeypatch.setattr(speccompat, "apply", lambda **kw: status)
    holder = {}

    def start(args, layer_ids):
        holder["starts"] = holder.get("starts", 0) + 1
        return holder["gen"]

    monkeypatch.setattr(ex, "start_generator", start)
    monkeypatch.setattr(speccompat.generator, "stream",
                        lambda gen, inputs, **kw: gen.stream(inputs))
    holder["model"] = model_dir(tmp_path)
    caplog.set_level("INFO")
    return holder


def extract(engine, tmp_path, data, *flags):
    return ex.main(["--model-path", str(engine["model"]), "--prepared-data", str(data), "--output-dir",
                    str(tmp_path / "out"), "--layer-ids", "1", "2", "4", "5", "--no-progress", "--max-seq-len", "64",
                    *flags])


def summary(text: str) -> tuple[int, int, int]:
    m = re.search(r"summary: (\d+) written, (\d+) already done \(skipped\), (\d+) failed", text)
    assert m, text
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def surrogate_input(tmp_path):
    records = random_records(6)
    lines = [json.dumps(r) for r in records]
    # valid JSON (a \\ud800 escape), an id with no UTF-8 form: the manifest cannot hold it
    lines.insert(3, '{"id": "bad\\ud800", "input_ids": [5, 6, 7]}')
    return jsonl(tmp_path / "d.jsonl", lines), [r["id"] for r in records]


def test_an_id_with_a_lone_surrogate_is_refused_before_the_engine(engine, tmp_path, caplog):
    data, _ids = surrogate_input(tmp_path)
    engine["gen"] = FakeGen()
    assert extract(engine, tmp_path, data) == 2
    assert "starts" not in engine and not (tmp_path / "out").exists()
    assert "line 4: \"id\" 'bad\\ud800' holds a lone UTF-16 surrogate" in caplog.text


def test_on_bad_line_skip_skips_an_id_with_a_lone_surrogate_and_writes_the_rest(engine, tmp_path, caplog):
    from speccompat.dataset import verify_dataset

    data, ids = surrogate_input(tmp_path)
    engine["gen"] = FakeGen()
    assert extract(engine, tmp_path, data, "--on-bad-line", "skip") == 0
    assert "lone UTF-16 surrogate" in caplog.text and "-> skipped" in caplog.text
    entries = [json.loads(x) for x in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[1:]]
    assert sorted(e["id"] for e in entries) == sorted(ids)
    assert verify_dataset(tmp_path / "out") == ([], len(ids))
    assert summary(caplog.text) == (len(ids), 0, 0)


def test_a_sample_the_writer_cannot_store_fails_alone_is_counted_and_blocks_no_rerun(engine, tmp_path, caplog):
    """float32 states of 1e6 do not fit --dtype float16: that sample fails in the writer; the others
    are written and committed; the summary counts the failure; a re-run retries only it."""
    records = random_records(8)
    bad = records[2]
    data = jsonl(tmp_path / "d.jsonl", records)
    engine["gen"] = FakeGen(huge_for={bad["input_ids"][0]})
    assert extract(engine, tmp_path, data, "--dtype", "float16", "--writer-threads", "2") == 1
    assert summary(caplog.text) == (7, 0, 1)
    assert f"id {bad['id']!r} cannot be stored" in caplog.text and "do not fit" in caplog.text
    entries = [json.loads(x) for x in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[1:]]
    assert sorted(e["id"] for e in entries) == sorted(r["id"] for r in records if r is not bad)
    assert not list((tmp_path / "out").glob("*.partial"))
    for _ in range(2):  # every re-run: the others stay done, only the bad one is tried (and fails) again
        caplog.clear()
        engine["gen"] = FakeGen(huge_for={bad["input_ids"][0]})
        assert extract(engine, tmp_path, data, "--dtype", "float16") == 1
        assert summary(caplog.text) == (0, 7, 1) and engine["gen"].seen == [bad["input_ids"][0]]


def test_a_kv_cache_too_small_for_the_longest_sample_is_found_before_any_sample_runs(engine, tmp_path, caplog):
    records = random_records(5, lo=30, hi=40)
    data = jsonl(tmp_path / "d.jsonl", records)
    engine["gen"] = FakeGen(kv_blocks=1, block=16)  # 16 tokens
    assert extract(engine, tmp_path, data) == 1
    assert engine["gen"].seen == []  # no sample ran
    assert "the engine's KV cache holds 16 tokens, fewer than the longest sample" in caplog.text
    assert "Raise --gpu-memory-utilization" in caplog.text
    assert summary(caplog.text) == (0, 0, 5)
    # a cache that holds them: the same command runs
    caplog.clear()
    engine["gen"] = FakeGen(kv_blocks=4, block=16)
    assert extract(engine, tmp_path, data) == 0 and summary(caplog.text) == (5, 0, 0)


def test_a_kv_cache_too_small_found_while_running_is_counted_in_the_summary(engine, tmp_path, caplog):
    from speccompat.errors import KVCacheTooSmall

    class Small(FakeGen):
        def stream(self, inputs):
            yield next(super().stream(inputs))  # one sample, then the scheduler cannot place the next
            raise KVCacheTooSmall("the KV cache is too small for them", longest=40)

    data = jsonl(tmp_path / "d.jsonl", random_records(5))
    engine["gen"] = Small()
    assert extract(engine, tmp_path, data) == 1
    assert summary(caplog.text) == (1, 0, 4)


def test_the_launcher_hashes_the_weights_once_before_its_engines_start(engine, tmp_path, monkeypatch):
    import speccompat.dataset.parallel

    monkeypatch.setenv("SPECCOMPAT_CACHE_DIR", str(tmp_path / "cache"))
    cached = []
    monkeypatch.setattr(speccompat.dataset.parallel, "launch_engines",
                        lambda cfg, script: cached.append(sorted(p.name for p in (tmp_path / "cache" / "file-digests")
                                                                 .iterdir())) or 0)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    assert extract(engine, tmp_path, data, "--data-parallel-size", "2") == 0
    assert len(cached) == 1 and len(cached[0]) == 1  # the one weight file's digest, before any engine


def test_an_os_error_outside_the_engine_run_is_one_line_not_a_traceback(engine, tmp_path, monkeypatch, caplog):
    def fails(cfg):
        raise PermissionError(13, "Permission denied", str(tmp_path / "out" / "manifest.jsonl"))

    monkeypatch.setattr(ex, "extract", fails)
    data = jsonl(tmp_path / "d.jsonl", random_records(2))
    assert extract(engine, tmp_path, data) == 1
    assert "Permission denied" in caplog.text and "re-run to resume" in caplog.text
