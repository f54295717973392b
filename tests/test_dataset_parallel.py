"""Placing several engines on one host's GPUs (speccompat.dataset.parallel): groups of --tp-size GPUs,
optionally shared by several engines, and the refusal of a memory split that cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from speccompat.dataset.errors import Rejected
from speccompat.dataset.extract import ExtractConfig
from speccompat.dataset.parallel import launch_engines, partition_devices

EIGHT = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_engines_sharing_gpus_get_the_same_group_in_turn():
    assert partition_devices(2, 1, {"CUDA_VISIBLE_DEVICES": "3"}, engines_per_gpu=2) == ["3", "3"]
    assert partition_devices(4, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, engines_per_gpu=2) == ["0,1", "0,1", "2,3", "2,3"]
    # an odd count: the last group has fewer engines
    assert partition_devices(3, 4, EIGHT, engines_per_gpu=2) == ["0,1,2,3", "0,1,2,3", "4,5,6,7"]
    assert partition_devices(8, 1, EIGHT) == [str(i) for i in range(8)]  # no sharing: one GPU each


def test_too_few_gpus_for_the_shared_groups_is_an_error_naming_the_count():
    with pytest.raises(ValueError, match=r"5 engines of 2 GPU\(s\), 2 per GPU, need 6 GPUs; this host has "
                                         r"CUDA_VISIBLE_DEVICES=0,1,2,3"):
        partition_devices(5, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, engines_per_gpu=2)


def test_a_memory_split_that_cannot_fit_is_refused_before_any_engine(monkeypatch):
    import speccompat.dataset.parallel as parallel

    started = []
    monkeypatch.setattr(parallel, "run_local", lambda runs, **kw: started.append(runs) or [0] * len(runs))
    cfg = ExtractConfig(model_path="m", prepared_data=Path("d.jsonl"), output_dir=Path("o"), num_shards=1,
                        shard_index=0, data_parallel_size=2, engines_per_gpu=2, gpu_memory_utilization=0.6)
    with pytest.raises(Rejected, match=r"--engines-per-gpu 2 with --gpu-memory-utilization 0.6: .* would ask for "
                                       r"1.20 of its memory; give each at most 0.50"):
        launch_engines(cfg, Path("driver.py"))
    assert started == []


def test_two_engines_on_one_gpu_are_started_on_it_as_two_shards(monkeypatch):
    import speccompat.dataset.parallel as parallel

    started = []

    def run_local(runs, **kw):
        started.extend(runs)
        for r in runs:
            r.code = 1
        return [1] * len(runs)  # both fail: the job ends before any merge

    monkeypatch.setattr(parallel, "run_local", run_local)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = ExtractConfig(model_path="m", prepared_data=Path("d.jsonl"), output_dir=Path("o"), num_shards=1,
                        shard_index=0, data_parallel_size=2, engines_per_gpu=2, gpu_memory_utilization=0.45)
    assert launch_engines(cfg, Path("driver.py")) == 1
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in started] == ["0", "0"]
    shards = [r.argv[r.argv.index("--shard-index") + 1] for r in started]
    assert shards == ["0", "1"] and all(r.argv[r.argv.index("--num-shards") + 1] == "2" for r in started)


def test_the_old_module_path_is_the_same_module():
    """``speccompat.parallel`` (its path before it moved under dataset/) is the module itself, so a
    patch through either name reaches the other's callers."""
    import importlib

    import speccompat.dataset.parallel as new

    old = importlib.import_module("speccompat.parallel")
    assert old is new
    from speccompat.parallel import launch_engines as old_launch

    assert old_launch is new.launch_engines is launch_engines
