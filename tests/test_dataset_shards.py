"""Sharded extraction with fake generator results (no vLLM): the shard function, where a shard's
index comes from, manifest parts and their locks, resume across a re-shard, merge and its checks,
and the launcher of several engines (with tiny child processes in place of engines)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records, states

from speccompat.dataset import Rejected
from speccompat.dataset.shards import (
    HEADER_NAME,
    ShardSpec,
    check_inputs,
    find_parts,
    merge_dataset,
    open_shard,
    part_name,
    resolve_shard,
    shard_of,
)

torch = pytest.importorskip("torch", reason="the writer needs torch")

from support.dataset_runs import HOSTILE, provenance, scan  # noqa: E402
from support.shard_runs import run_shard  # noqa: E402

# ---------------------------------------------------------------------------------------------
# the shard function
# ---------------------------------------------------------------------------------------------


def test_shard_of_is_a_function_of_the_id_bytes_and_adding_ids_moves_none():
    ids = [f"s{i}" for i in range(2000)] + HOSTILE
    for n in (2, 3, 8):
        before = {i: shard_of(i, n) for i in ids}
        # an independent computation: SHA-256 of the exact UTF-8 bytes, first 8 bytes big-endian, mod N
        for i in ids:
            raw = i.encode("utf-8", "surrogatepass")
            assert before[i] == int(hashlib.sha256(raw).hexdigest()[:16], 16) % n
        # the split of a list depends on nothing but each id: more ids, in another order, move none
        grown = list(reversed(ids)) + [f"new-{i}" for i in range(3000)]
        split = {i: k for k in range(n) for i in grown if shard_of(i, n) == k}
        assert all(split[i] == before[i] for i in ids)
    assert shard_of("e\u0301", 7) == shard_of("e\u0301", 7)
    assert len({shard_of(x, 1) for x in ids}) == 1


def test_shards_are_roughly_even():
    for n in (2, 3, 8, 64):
        counts = Counter(shard_of(f"conv-{i:06d}", n) for i in range(20000))
        assert sorted(counts) == list(range(n))
        mean = 20000 / n
        # binomial spread: 5 standard deviations
        sd = (20000 * (1 / n) * (1 - 1 / n)) ** 0.5
        assert all(abs(c - mean) < 5 * sd for c in counts.values()), counts


# ---------------------------------------------------------------------------------------------
# where the shard comes from
# ---------------------------------------------------------------------------------------------


def test_shards_from_slurm_arrays_rank_world_size_with_auto_and_from_flags():
    assert resolve_shard(None, None, {}) == ShardSpec(1, 0, "default: one shard")
    # an array 1-4 (SLURM_ARRAY_TASK_MIN 1): task 1 is shard 0, task 4 shard 3
    env = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1",
           "RANK": "0", "WORLD_SIZE": "2"}
    assert resolve_shard(None, None, env) == ShardSpec(1, 0, "default: one shard")  # only when asked
    s = resolve_shard("auto", None, env)
    assert (s.num_shards, s.index) == (4, 3) and "SLURM_ARRAY_TASK_MIN" in s.source
    assert resolve_shard("auto", None, {**env, "SLURM_ARRAY_TASK_ID": "1"}).index == 0
    # 0-14:2 (step 2, 8 tasks): task 6 is the fourth
    s = resolve_shard("auto", None, {"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_COUNT": "8",
                                     "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "2"})
    assert (s.num_shards, s.index) == (8, 3)
    s = resolve_shard("auto", None, {"RANK": "1", "WORLD_SIZE": "2"})
    assert (s.num_shards, s.index, s.source) == (2, 1, "RANK/WORLD_SIZE")
    s = resolve_shard(5, 2, env)  # flags: the environment is not read
    assert (s.num_shards, s.index, s.source) == (5, 2, "--num-shards and --shard-index")
    for bad, phrase in [
        (("auto", None, {"SLURM_ARRAY_TASK_ID": "3"}), "SLURM_ARRAY_TASK_COUNT is not"),
        (("auto", None, {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}),
         "cannot derive a shard index"),
        (("auto", None, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_STEP": "2"}),
         "evenly spaced"),
        (("auto", None, {"RANK": "1"}), "only one of RANK and WORLD_SIZE"),
        (("auto", None, {"RANK": "x", "WORLD_SIZE": "2"}), "RANK='x' is not an integer"),
        (("auto", None, {"RANK": "5", "WORLD_SIZE": "3"}), "outside 0..2"),
        (("auto", 1, {"RANK": "0", "WORLD_SIZE": "3"}), "drop --shard-index"),
        ((4, None, {}), "without --shard-index"),
        ((4, None, {"RANK": "1", "WORLD_SIZE": "4"}), "without --shard-index"),
        ((None, 1, {"RANK": "0", "WORLD_SIZE": "3"}), "--shard-index without --num-shards"),
        ((2, 2, {}), "outside 0..1"),
    ]:
        with pytest.raises(Rejected, match=phrase):
            resolve_shard(*bad)


# ---------------------------------------------------------------------------------------------
# parts, resume across shards, merge
# ---------------------------------------------------------------------------------------------


def run_single(out: Path, samples, prov):
    from speccompat.dataset import open_dataset

    ds = open_dataset(out, samples, prov)
    with ds.writer(threads=2) as w:
        for first in range(0, len(ds.todo), 2):
            w.submit([ds.job(s, states(s)) for s in ds.todo[first:first + 2]])
    ds.lock.close()
    return ds


def same_as_one_run(out: Path, single: Path, shards: int) -> None:
    """The merged manifest equals one run's, byte for byte, but for the header's record of what made
    it: the same command, merged from ``shards`` shards."""
    merged, one = [(d / "manifest.jsonl").read_bytes().splitlines() for d in (out, single)]
    assert merged[1:] == one[1:]
    head, ref = json.loads(merged[0]), json.loads(one[0])
    assert head["run"] == {**ref["run"], "merged_from": {"shards": shards, "commands": [ref["run"]["command"]]}}
    assert {**head, "run": None} == {**ref, "run": None}


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".safetensors"}


@pytest.fixture
def world(tmp_path):
    model = model_dir(tmp_path)
    records = random_records(30) + [{"id": i, "input_ids": [5, 6, 7, k + 4]} for k, i in enumerate(HOSTILE[:8])]
    data = jsonl(tmp_path / "data.jsonl", records)
    return tmp_path, model, data, scan(data)


def test_two_shards_write_parts_and_their_merge_equals_one_run(world):
    from speccompat.dataset import open_dataset, verify_dataset
    from speccompat.dataset.verify import main as verify_main

    root, model, data, samples = world
    prov = provenance(model)
    single = root / "single"
    run_single(single, samples, prov)
    out = root / "sharded"
    written = [run_shard(out, samples, prov, k, 2) for k in range(2)]
    assert sorted(len(d.todo) for d in written) != [0, len(samples)]  # both shards had work
    assert sum(len(d.todo) for d in written) == len(samples)
    assert {s.id for d in written for s in d.todo} == {s.id for s in samples}
    assert [p.name for p in find_parts(out)] == [part_name(0, 2), part_name(1, 2)]
    assert not (out / "manifest.jsonl").exists() and (out / HEADER_NAME).exists()
    for k in range(2):  # each part holds exactly its own shard's samples
        lines = (out / part_name(k, 2)).read_text().splitlines()
        assert {json.loads(x)["id"] for x in lines[1:]} == {s.id for s in written[k].todo}
    # an unsharded run and verify point at merge
    with pytest.raises(Rejected, match="speccompat merge"):
        open_dataset(out, samples, prov)

    class A:
        dir, threads = out, 2

    assert verify_main(A) == 2

    res = merge_dataset(out)
    assert res.problems == [] and res.entries == len(samples) and len(res.parts) == 2
    assert find_parts(out) == [] and not (out / HEADER_NAME).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".speccompat-shard-")]
    # the same bytes as one run: every sample file and the manifest (entries in input order)
    assert files_of(out) == files_of(single)
    same_as_one_run(out, single, 2)
    problems, n = verify_dataset(out)
    assert problems == [] and n == len(samples)
    assert check_inputs(out, data) == ([], len(samples))


def test_merge_finds_missing_duplicate_and_mismatched_parts(world):
    root, model, data, samples = world
    prov = provenance(model)
    out = root / "out"
    run_shard(out, samples, prov, 0, 3)
    run_shard(out, samples, prov, 1, 3)
    mine2 = [s for s in samples if shard_of(s.id, 3) == 2]
    # a part whose provenance differs: nothing is merged, nothing removed
    part1 = out / part_name(1, 3)
    saved = part1.read_bytes()
    lines = part1.read_text().splitlines()
    head = json.loads(lines[0])
    head["provenance"]["hidden_states"]["dtype"] = "float16"
    head["provenance_sha256"] = "0" * 64
    part1.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    res = merge_dataset(out)
    assert len(res.problems) == 1 and part_name(1, 3) in res.problems[0]
    assert "hidden_states.dtype" in res.problems[0] and "float16" in res.problems[0]
    assert not (out / "manifest.jsonl").exists() and len(find_parts(out)) == 2
    part1.write_bytes(saved)
    # a duplicate: one sample of shard 0 listed again in shard 1's part under another file
    e0 = json.loads((out / part_name(0, 3)).read_text().splitlines()[1])
    dup = {**e0, "file": "copy-" + e0["file"]}
    (out / dup["file"]).write_bytes((out / e0["file"]).read_bytes())
    with open(part1, "a") as f:
        f.write(json.dumps(dup) + "\n")
    res = merge_dataset(out)
    assert res.problems == []
    problems, _n = check_inputs(out, data)
    missing = [p for p in problems if "missing from the data set" in p]
    assert sorted(missing) == sorted(f"id {s.id!r} (line {s.line} of {data}): missing from the data set" for s in mine2)
    twice = [p for p in problems if "present 2 times" in p]
    assert len(twice) == 1 and repr(e0["id"]) in twice[0]
    assert len(problems) == len(mine2) + 1
    from speccompat.dataset import verify_dataset

    vp, _ = verify_dataset(out)
    assert f"manifest.jsonl: id {e0['id']!r} has 2 entries" in vp
    # a sample not in the input
    extra = jsonl(root / "fewer.jsonl", [json.loads(x) for x in data.read_text().splitlines()[1:]])
    problems, _n = check_inputs(out, extra)
    first = samples[0]
    if shard_of(first.id, 3) != 2:
        assert any(f"id {first.id!r}" in p and "not in" in p for p in problems)


def test_resharding_two_to_three_skips_every_finished_sample_and_redoes_a_corrupt_one(world):
    root, model, data, samples = world
    prov = provenance(model)
    single = root / "single"
    run_single(single, samples, prov)
    out = root / "out"
    run_shard(out, samples, prov, 0, 2)
    run_shard(out, samples, prov, 1, 2, batches=2)  # killed after two batches
    finished = {json.loads(x)["id"] for p in find_parts(out) for x in p.read_text().splitlines()[1:]}
    n1 = len([s for s in samples if shard_of(s.id, 2) == 1])
    assert len(finished) == len(samples) - n1 + 4
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir() if p.suffix == ".safetensors"}
    # one finished file is corrupted in place (same size): the new split must notice and redo it
    victim = next(s for s in samples if s.id in finished and isinstance(s.id, str) and s.id.startswith("s0"))
    from speccompat.dataset.names import name_for_id

    vpath = out / name_for_id(victim.id, ".safetensors")
    raw = bytearray(vpath.read_bytes())
    raw[-3] ^= 0xFF
    vpath.write_bytes(bytes(raw))
    redo = [run_shard(out, samples, prov, k, 3) for k in range(3)]
    todo = [s.id for d in redo for s in d.todo]
    assert sorted(todo) == sorted({s.id for s in samples} - finished | {victim.id})
    assert len(todo) == len(set(todo))
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir() if p.suffix == ".safetensors"}
    for name, st in before.items():
        assert (after[name] == st) == (name != vpath.name), name  # nothing else rewritten
    assert len(find_parts(out)) == 5
    res = merge_dataset(out)  # the old part's entry of the victim is stale: the file decides
    assert res.problems == [] and res.entries == len(samples)
    assert files_of(out) == files_of(single)
    same_as_one_run(out, single, 5)
    assert check_inputs(out, data) == ([], len(samples))
    # and a sharded run on the merged data set has nothing to do
    assert [len(run_shard(out, samples, prov, k, 4).todo) for k in range(4)] == [0, 0, 0, 0]


def test_locks_header_and_leftovers_of_concurrent_shards(world):
    from speccompat.dataset import open_dataset

    root, model, _data, samples = world
    out = root / "out"
    prov = provenance(model, extra={"created": "2026-01-01T00:00:00Z"})
    a = open_shard(out, samples, prov, ShardSpec(2, 0, "t"))
    with pytest.raises(Rejected, match="shard 0 of 2 is already running"):
        open_shard(out, samples, prov, ShardSpec(2, 0, "t"))
    with pytest.raises(Rejected, match="another extraction is writing"):
        open_dataset(out, samples, prov)
    with pytest.raises(Rejected, match="merge when every shard has ended"):
        merge_dataset(out)
    with pytest.raises(Rejected, match="--overwrite cannot be combined with shards"):
        open_shard(out, samples, prov, ShardSpec(2, 1, "t"), overwrite=True)
    # a later shard (another time of day) takes the first shard's header: one `created`, one checksum
    b = open_shard(out, samples, provenance(model, extra={"created": "2026-06-06T00:00:00Z"}), ShardSpec(2, 1, "t"))
    assert b.provenance["created"] == a.provenance["created"] == "2026-01-01T00:00:00Z"
    assert b.manifest.header["checksum"] == a.manifest.header["checksum"]
    # a shard made differently is refused before anything, naming the difference
    with pytest.raises(Rejected, match=r"hidden_states.dtype: \"bfloat16\" -> \"float16\""):
        open_shard(out, samples, provenance(model, dtype="float16"), ShardSpec(3, 2, "t"))
    for h in (*a.lock, *b.lock):
        h.close()
    # each shard removes only its own interrupted files: another shard may be writing its own
    s0 = next(s for s in samples if shard_of(s.id, 2) == 0)
    s1 = next(s for s in samples if shard_of(s.id, 2) == 1)
    from speccompat.dataset.names import name_for_id

    mine = out / f"{name_for_id(s0.id, '.safetensors')}.123.partial"
    theirs = out / f"{name_for_id(s1.id, '.safetensors')}.456.partial"
    mine.write_bytes(b"x")
    theirs.write_bytes(b"y")
    c = open_shard(out, samples, prov, ShardSpec(2, 0, "t"))
    assert not mine.exists() and theirs.exists()
    for h in c.lock:
        h.close()


def test_a_changed_input_is_refused_by_every_shard(world):
    root, model, data, samples = world
    prov = provenance(model)
    out = root / "out"
    run_shard(out, samples, prov, 0, 2)
    records = [json.loads(x) for x in data.read_text().splitlines()]
    victim = next(r for r in records if shard_of(str(r["id"]), 2) == 0)
    victim["input_ids"], victim["loss_mask"] = [9, 9, 9], [1, 1, 1]
    changed = scan(jsonl(root / "changed.jsonl", records))
    with pytest.raises(Rejected, match=f"id {victim['id']!r}.*differ"):  # shard 1 refuses too: one data set
        open_shard(out, changed, prov, ShardSpec(2, 1, "t"))


def test_a_header_without_samples_takes_the_corrected_command_in_every_shard(world):
    """Shards whose engines did not start leave only the header (manifest.header.json, parts without
    entries): the corrected command is taken, also with another number of shards, and the parts merge.
    Once one sample exists, a differing setting is refused, naming it."""
    from speccompat.dataset import verify_dataset

    root, model, data, samples = world
    out = root / "out"
    failed = provenance(model, dtype="float16", max_seq_len=48)
    for k in range(3):  # three engines that did not start: headers, no sample
        open_shard(out, samples, failed, ShardSpec(3, k, "t")).close()
    assert json.loads((out / HEADER_NAME).read_text())["provenance"]["max_seq_len"] == 48
    prov = provenance(model)
    first = run_shard(out, samples, prov, 0, 2, batches=1)
    assert first.done == 0 and len(first.todo) == sum(shard_of(s.id, 2) == 0 for s in samples)
    head = json.loads((out / HEADER_NAME).read_text())
    assert head["provenance"]["hidden_states"]["dtype"] == "bfloat16" and head["provenance"]["max_seq_len"] == 64
    # a sample exists now: the failed run's settings are refused by every shard, each difference named
    for k, n in ((1, 2), (2, 3)):
        with pytest.raises(Rejected, match=r'(?s)hidden_states.dtype: "bfloat16" -> "float16".*max_seq_len: 64 -> 48'):
            open_shard(out, samples, failed, ShardSpec(n, k, "t"))
    run_shard(out, samples, prov, 0, 2)
    run_shard(out, samples, prov, 1, 2)
    res = merge_dataset(out)
    assert res.problems == [] and res.entries == len(samples) and len(res.parts) == 5
    assert verify_dataset(out) == ([], len(samples))
    assert check_inputs(out, data) == ([], len(samples))


def test_shards_starting_together_after_a_failed_start_take_the_corrected_settings_one_at_a_time(world, monkeypatch):
    """A shard that would replace the header waits for the header lock and holds no part lock while
    it waits, so shards of the corrected command starting together all start; a shard that read the
    old header just before it was replaced is refused; one running with the old settings keeps them."""
    import threading
    import time

    from speccompat.dataset.directory import HEADER_LOCK_NAME, DatasetDir, part_lock_name

    root, model, _data, samples = world
    out = root / "out"
    failed, prov = provenance(model, max_seq_len=48), provenance(model)
    for k in range(2):
        open_shard(out, samples, failed, ShardSpec(2, k, "t")).close()
    ddir = DatasetDir(out)
    opened, errors = {}, []

    def start(k):
        try:
            opened[k] = open_shard(out, samples, prov, ShardSpec(2, k, "t"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with ddir.lock(HEADER_LOCK_NAME):  # another shard is deciding
        threads = [threading.Thread(target=start, args=(k,)) for k in range(2)]
        for t in threads:  # (one after the other: in one process both would probe the directory with one name)
            t.start()
            time.sleep(0.3)
        assert opened == {} and not [k for k in range(2) if ddir.held(part_lock_name(k, 2))]
    for t in threads:
        t.join(30)
    assert errors == [] and sorted(opened) == [0, 1]
    assert all(d.manifest.header["provenance"]["max_seq_len"] == 64 for d in opened.values())
    for d in opened.values():
        d.close()
    # shard 0 runs with these settings: the failed ones cannot take the set back
    a = open_shard(out, samples, prov, ShardSpec(2, 0, "t"))
    with pytest.raises(Rejected, match=r"max_seq_len: 64 -> 48.*\n.*1 shard\(s\) are running with the stored"):
        open_shard(out, samples, failed, ShardSpec(2, 1, "t"))
    a.close()
    # a shard that read the header just before another shard replaced it is refused, not run with it
    real = DatasetDir.lock

    def lock(self, name, **kw):
        if name == part_lock_name(1, 2) and not replaced:
            replaced.append(None)
            replaced[0] = open_shard(out, samples, failed, ShardSpec(2, 0, "t"))  # replaces it now
        return real(self, name, **kw)

    replaced: list = []
    monkeypatch.setattr(DatasetDir, "lock", lock)
    with pytest.raises(Rejected, match="was replaced by another shard while this one started"):
        open_shard(out, samples, prov, ShardSpec(2, 1, "t"))
    assert replaced[0].manifest.header["provenance"]["max_seq_len"] == 48
    replaced[0].close()
    assert not ddir.held(part_lock_name(1, 2))  # the refused shard let its locks go


def test_the_merged_set_records_the_job_command_and_its_shards(world, capsys):
    """After a merge the header's ``run`` is no longer one shard's: it names the job's command (the
    shards' without --shard-index, or the one the job gives), the shards' commands and their number;
    a second merge (more shards later) keeps the first one's."""
    from speccompat.cli import main
    from speccompat.dataset import verify_dataset

    root, model, data, samples = world
    prov = provenance(model)
    out = root / "out"
    job = "extract_hidden_states.py --model-path m --output-dir out --num-shards 3"
    for k in range(3):
        flag = f"--shard-index {k}" if k != 1 else f"--shard-index={k}"
        run_shard(out, samples, prov, k, 3, command=f"extract_hidden_states.py --model-path m {flag} --output-dir out"
                                                     " --num-shards 3")
    heads = [json.loads(p.read_text().splitlines()[0])["run"]["command"] for p in find_parts(out)]
    assert len(set(heads)) == 3  # each shard recorded its own command
    assert main(["merge", str(out), "--inputs", str(data)]) == 0
    head = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert head["run"]["command"] == job
    assert head["run"]["merged_from"] == {"shards": 3, "commands": [job]}
    assert verify_dataset(out) == ([], len(samples))
    # more samples, a second job of 2 shards (another command), merged again: both jobs are named
    added = [{"id": f"new{i}", "input_ids": [5, 6, i + 4]} for i in range(6)]
    grown = scan(jsonl(root / "grown.jsonl", [json.loads(x) for x in data.read_text().splitlines()] + added))
    other = "extract_hidden_states.py --model-path m --output-dir out --num-shards 2 --batch-size 4"
    for k in range(2):
        run_shard(out, grown, prov, k, 2, command=f"{other} --shard-index {k}")
    res = merge_dataset(out)
    assert res.problems == [] and res.entries == len(grown)
    head = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert head["run"]["merged_from"] == {"shards": 5, "commands": [job, other]}
    assert head["run"]["command"] == f"{job}; {other}"
    assert verify_dataset(out) == ([], len(grown))
    capsys.readouterr()


def test_speculators_layout_shards_keep_global_file_indices(world):
    root, model, data, samples = world
    prov = provenance(model, layout="speculators")
    out = root / "out"
    ds = [run_shard(out, samples, prov, k, 2) for k in range(2)]
    names = [d.files[s.id] for d in ds for s in d.todo]
    assert len(set(names)) == len(samples)
    index = {s.id: k for k, s in enumerate(samples)}
    assert all(d.files[s.id] == f"data_{index[s.id]}.pt" for d in ds for s in d.todo)
    res = merge_dataset(out)
    assert res.problems == [] and res.entries == len(samples)
    assert check_inputs(out, data) == ([], len(samples))


# ---------------------------------------------------------------------------------------------
# several engines: the launcher (children here are tiny Python programs)
# ---------------------------------------------------------------------------------------------


def test_device_and_core_partitions():
    from speccompat.dataset.parallel import partition_cpus, partition_devices, worst

    assert partition_devices(2, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) == ["0,1,2,3", "4,5,6,7"]
    assert partition_devices(3, 1, {"CUDA_VISIBLE_DEVICES": "5,6,7"}) == ["5", "6", "7"]
    with pytest.raises(ValueError, match="need 8 GPUs; this host has CUDA_VISIBLE_DEVICES=0,1,2"):
        partition_devices(2, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    cores = sorted(os.sched_getaffinity(0))
    got = partition_cpus(len(cores), 1)
    assert got == [str(c) for c in cores]
    assert partition_cpus(len(cores) + 1, 1) is None
    assert worst([0, 0]) == 0 and worst([0, 1, 2]) == 2 and worst([1, -9]) == 137


def test_run_local_reports_every_child_and_the_worst_status(capfd):
    from speccompat.dataset.parallel import EngineRun, run_local

    prog = ("import os, sys, time; print('x: 3 to extract', flush=True); time.sleep(0.2); "
            "print('progress: 3/3 samples', os.environ['TAG'], flush=True); sys.exit(int(os.environ['CODE']))")
    runs = [EngineRun(f"engine {k}", [sys.executable, "-c", prog], {"TAG": f"t{k}", "CODE": str(c)})
            for k, c in enumerate([0, 1, 0])]
    codes = run_local(runs)
    assert codes == [0, 1, 0]
    err = capfd.readouterr().err
    for k in range(3):
        assert f"[engine {k}] progress: 3/3 samples t{k}" in err
    # progress comes from the data set, never from what an engine prints: these have no shard
    assert [(r.done, r.samples) for r in runs] == [(0, None)] * 3


def test_the_jobs_progress_is_read_from_the_manifest_parts(world):
    """Each shard's part says how many samples it owns and how many were done when it opened; each
    entry appended after is one more. Read as the part grows: a torn last line is not yet, a part
    rewritten by a shard that reopens is read anew, a re-shard counts what the earlier split did."""
    from speccompat.dataset.parallel import DataSetProgress, EngineRun

    root, model, _data, samples = world
    prov = provenance(model)
    out = root / "out"
    mine = {k: [s for s in samples if shard_of(s.id, 2) == k] for k in range(2)}
    runs = [EngineRun(f"engine {k}", [], shard=(k, 2)) for k in range(2)]
    progress = DataSetProgress(out)
    progress.update(runs)  # nothing opened yet: nothing known
    assert [(r.done, r.samples) for r in runs] == [(0, None), (0, None)]
    run_shard(out, samples, prov, 0, 2, batches=2)  # 4 samples, then the engine stops
    progress.update(runs)
    assert [(r.done, r.samples) for r in runs] == [(4, len(mine[0])), (0, None)]
    part = out / part_name(0, 2)
    line = part.read_text().splitlines()[-1]
    entry = json.loads(line)
    extra = json.dumps({**entry, "id": "another", "file": "another.safetensors"}) + "\n"
    with open(part, "a") as f:  # a line being appended: half of it is there
        f.write(extra[:40])
    progress.update(runs)
    assert runs[0].done == 4
    with open(part, "a") as f:
        f.write(extra[40:])
    progress.update(runs)
    assert runs[0].done == 5
    # shard 0 opens again: its part is compacted (the entry without a file dropped) and read anew
    held = open_shard(out, samples, prov, ShardSpec(2, 0, "t"))
    progress.update(runs)
    assert (runs[0].done, runs[0].samples) == (4, len(mine[0])) and len(held.todo) == len(mine[0]) - 4
    held.close()
    run_shard(out, samples, prov, 0, 2)
    run_shard(out, samples, prov, 1, 2, batches=1)
    progress.update(runs)
    assert [(r.done, r.samples) for r in runs] == [(len(mine[0]), len(mine[0])), (2, len(mine[1]))]
    # a re-shard into 3: each new shard starts with what the 2-split finished of its samples
    finished = {json.loads(x)["id"] for k in range(2) for x in (out / part_name(k, 2)).read_text().splitlines()[1:]}
    three = [EngineRun(f"engine {k}", [], shard=(k, 3)) for k in range(3)]
    for k in range(3):
        open_shard(out, samples, prov, ShardSpec(3, k, "t")).close()
    DataSetProgress(out).update(three)
    want = [sum(shard_of(s.id, 3) == k and s.id in finished for s in samples) for k in range(3)]
    assert [r.done for r in three] == want and sum(want) == len(finished)
    assert [r.samples for r in three] == [sum(shard_of(s.id, 3) == k for s in samples) for k in range(3)]
    # the merged set's header keeps no shard's progress facts
    for k in range(3):
        run_shard(out, samples, prov, k, 3)
    assert merge_dataset(out).problems == []
    assert "shard" not in json.loads((out / "manifest.jsonl").read_text().splitlines()[0])


def test_launcher_gives_each_engine_its_shard_and_gpus(monkeypatch, tmp_path):
    """One job (ExtractConfig) -> one config per engine -> its command: the flags parse back to that
    engine's config (shard k of N*D, a single engine), and progress is read from the data set."""
    from speccompat.dataset import parallel
    from speccompat.dataset.extract import ExtractConfig, parse_args

    seen = []

    def run_local(runs, progress=None):
        seen.extend(runs)
        progress(runs)  # the data set's progress: no part yet, nothing known
        return [0] * len(runs)

    monkeypatch.setattr(parallel, "run_local", run_local)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    for k in ("SLURM_ARRAY_TASK_ID", "RANK", "WORLD_SIZE", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    cfg = ExtractConfig(model_path="m", prepared_data=tmp_path / "d.jsonl", output_dir=tmp_path / "o", tp_size=2,
                        data_parallel_size=4, num_shards=3, shard_index=1, layer_ids=[1, 3], progress=False)
    assert parallel.launch_engines(cfg, Path("/x/drv.py")) == 0
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in seen] == ["0,1", "2,3", "4,5", "6,7"]
    for d, r in enumerate(seen):
        assert r.argv[:2] == [sys.executable, "/x/drv.py"] and r.shard == (4 + d, 12)
        got = ExtractConfig.from_args(parse_args(r.argv[2:]))
        assert got == ExtractConfig(model_path="m", prepared_data=tmp_path / "d.jsonl", output_dir=tmp_path / "o",
                                    tp_size=2, num_shards=12, shard_index=4 + d, layer_ids=[1, 3], progress=False)
        assert "--data-parallel-size" not in r.argv and "--shard-index" in r.argv  # a single engine, its shard
        assert (r.done, r.samples) == (0, None)


def test_a_config_and_its_flags_are_one_another(monkeypatch, tmp_path):
    """ExtractConfig.to_argv gives the flags that parse back to the same config, every field set."""
    import dataclasses

    from speccompat.dataset.extract import ExtractConfig, parse_args

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    changed = dict(layout="speculators", batch_size=5, max_seq_len=77, tp_size=4, gpu_memory_utilization=0.25,
                   layer_ids=[2, 5, 9], limit=11, overwrite=True, dtype="float16", fp8_scale="token-layer",
                   on_bad_line="skip",
                   on_long_line="skip", writer_threads=3, max_in_flight_gb=2.5, token_freq_path=tmp_path / "f.pt",
                   log_level="DEBUG", num_shards="auto", data_parallel_size=2, engines_per_gpu=2, ray=True,
                   ray_address="h:6379", progress=False)
    base = ExtractConfig(model_path="org/model", prepared_data=tmp_path / "d.jsonl", output_dir=tmp_path / "o")
    assert {f.name for f in dataclasses.fields(ExtractConfig)} - set(changed) == \
        {"model_path", "prepared_data", "output_dir", "shard_index"}  # every other field is changed here
    cfg = dataclasses.replace(base, **changed)
    assert ExtractConfig.from_args(parse_args(cfg.to_argv())) == cfg
    assert ExtractConfig.from_args(parse_args(base.to_argv())) == base
    assert base.to_argv() == ["--model-path", "org/model", "--prepared-data", str(tmp_path / "d.jsonl"),
                              "--output-dir", str(tmp_path / "o")]  # the defaults are not repeated
    one = dataclasses.replace(base, num_shards=3, shard_index=2)
    assert ExtractConfig.from_args(parse_args(one.to_argv())) == one


def test_speccompat_merge_command_exit_statuses(world, capsys):
    from speccompat.cli import main

    root, model, data, samples = world
    prov = provenance(model)
    out = root / "out"
    run_shard(out, samples, prov, 0, 2)
    held = open_shard(out, samples, prov, ShardSpec(2, 1, "t"))  # shard 1 still running
    assert main(["merge", str(out)]) == 2
    assert "merge when every shard has ended" in capsys.readouterr().err
    for h in held.lock:
        h.close()
    assert main(["merge", str(out), "--inputs", str(data)]) == 1  # shard 1 never wrote anything
    printed = capsys.readouterr()
    n1 = sum(shard_of(s.id, 2) == 1 for s in samples)
    assert printed.out.count("missing from the data set") == n1 and f"{n1} problem(s)" in printed.err
    run_shard(out, samples, prov, 1, 2)
    assert main(["merge", str(out), "--inputs", str(data)]) == 0
    printed = capsys.readouterr()
    assert f"{len(samples)} entries, 0 problem(s)" in printed.err and printed.out == ""
    assert main(["merge", str(root / "nothing-here")]) == 2


def test_ray_is_optional_and_says_what_to_install(monkeypatch):
    from speccompat.dataset.parallel import EngineRun, run_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'speccompat\[ray\]'"):
        run_ray([EngineRun("e", ["x"])], address="local", gpus_per_engine=1)
    import subprocess

    code = "import speccompat, speccompat.dataset.parallel, speccompat.dataset.shards, sys; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("how", ["merge --inputs", "finish_job"])
def test_finishing_a_sharded_set_reads_its_input_once(world, monkeypatch, how):
    """The input (millions of lines in a real job) is scanned once: checked against the merged manifest,
    and counted into the side files; a missing sample is still found."""
    import types

    from speccompat.dataset import shards

    root, model, data, samples = world
    out = root / "sharded"
    for k in range(2):
        run_shard(out, samples, provenance(model), k, 2)
    scans = []
    real = shards._scan_as_run
    monkeypatch.setattr(shards, "_scan_as_run", lambda *a, **kw: scans.append(a[1]) or real(*a, **kw))

    def finish(inputs):
        if how == "finish_job":
            return shards.finish_job(out, inputs)
        return shards.main(types.SimpleNamespace(dir=out, inputs=inputs, limit=None, threads=2, token_freq_path=None,
                                                 no_verify=False))

    short = jsonl(root / "short.jsonl", [json.loads(x) for x in data.read_text().splitlines()[:-1]])
    assert finish(short) == 1  # one sample of the set is not in this input: named, nothing finished
    assert scans == [short]
    scans.clear()
    assert finish(data) == 0
    assert scans == [data]
    assert check_inputs(out, data) == ([], len(samples))
