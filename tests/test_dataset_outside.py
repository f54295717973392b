"""Nothing outside the output directory is touched, and no half data set is left to pass a check:
``export`` builds in a staging folder beside its output and renames it into place only once it
verifies; every folder speccompat creates in a data set is made anew and a link there is refused
(exit 2) before anything is deleted or moved."""

from __future__ import annotations

import json
import os

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records
from support.dataset_runs import provenance, run, scan
from support.speculators_child import needs_speculators

from speccompat.cli import main

pytest.importorskip("torch", reason="the data set's writer")


def snapshot(d):
    """Every name under ``d`` (links not followed) with its bytes (files) or its target (links); a
    lock file's content (the pid of its last holder) is left out."""
    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            if n.endswith(".lock"):
                out[n] = "lock"
                continue
            p = os.path.join(root, n)
            rel = os.path.relpath(p, d)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = f.read()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture
def outside(tmp_path):
    """A folder outside every data set, with a sentinel file."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "rows.arrow").write_bytes(b"sentinel: not a file of any data set")
    (d / "keep.txt").write_text("sentinel")
    return d


def finished(root, layout="safetensors", n=6, seed=3):
    model = model_dir(root)
    samples = scan(jsonl(root / "d.jsonl", random_records(n, seed=seed)))
    run(root / "src", samples, provenance(model, layout=layout), batch=2)
    return root / "src", samples


def corrupt_one(src):
    entries = [json.loads(x) for x in (src / "manifest.jsonl").read_text().splitlines()[1:]]
    victim = src / entries[len(entries) // 2]["file"]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF  # a hidden-state byte: the checksum no longer matches
    victim.write_bytes(bytes(raw))


@pytest.mark.parametrize("to", ["safetensors", "speculators-arrow"])
def test_an_export_from_a_source_with_one_corrupt_file_leaves_no_data_set(tmp_path, capsys, to):
    src, _ = finished(tmp_path)
    corrupt_one(src)
    out = tmp_path / "new"
    assert main(["export", str(src), "--to", to, str(out)]) == 2
    assert "does not match the manifest" in capsys.readouterr().err
    assert not out.exists()  # the directory it made is gone again: no half data set
    out.mkdir()  # an empty directory given: left empty
    assert main(["export", str(src), "--to", to, str(out)]) == 2
    assert sorted(os.listdir(out)) == [] and not list(tmp_path.glob("new.*"))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2 and main(["merge", str(out)]) == 2


def test_an_interrupted_export_leaves_nothing_in_its_output_and_the_next_export_recovers(tmp_path, monkeypatch,
                                                                                         caplog):
    from speccompat.dataset import export as ex_mod
    from speccompat.dataset import verify_dataset

    src, samples = finished(tmp_path)
    out = tmp_path / "new"
    stage = tmp_path / "new.speccompat-export-staging"
    real = ex_mod._read_source
    calls = []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ex_mod, "_read_source", dies)
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 130
    assert not out.exists() and not stage.exists()
    # a process killed outright leaves its staging folder beside out, never anything in out
    stage.mkdir()
    (stage / "manifest.jsonl").write_text("{}\n")
    (stage / "data_0.pt").write_bytes(b"half")
    monkeypatch.setattr(ex_mod, "_read_source", real)
    caplog.set_level("WARNING", "speccompat.dataset")
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 0
    assert "found the staging folder of an interrupted export (2 file(s)" in caplog.text
    assert not stage.exists()
    assert verify_dataset(out) == ([], len(samples))


def test_export_into_a_file_or_a_non_empty_directory_or_over_the_source_is_refused(tmp_path, capsys):
    src, _ = finished(tmp_path)
    target = tmp_path / "a-file"
    target.write_bytes(b"keep me")
    assert main(["export", str(src), "--to", "safetensors", str(target)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and "Traceback" not in err
    assert target.read_bytes() == b"keep me"
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert main(["export", str(src), "--to", "safetensors", str(full)]) == 2
    assert sorted(os.listdir(full)) == ["x"]
    before = snapshot(src)
    assert main(["export", str(src), "--to", "safetensors", str(src / "inner")]) == 2
    assert "overlap" in capsys.readouterr().err and snapshot(src) == before


def test_a_staging_link_pointing_outside_is_refused_and_the_outside_untouched(tmp_path, outside, capsys):
    src, _ = finished(tmp_path)
    out = tmp_path / "new"
    out.mkdir()
    os.symlink(outside, tmp_path / "new.speccompat-export-staging")
    before = snapshot(outside)
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert snapshot(outside) == before and os.path.islink(tmp_path / "new.speccompat-export-staging")
    assert os.listdir(out) == []


def test_export_to_speculators_04_keeps_its_token_frequencies_beside_and_never_replaces_one(tmp_path, capsys,
                                                                                           monkeypatch):
    from speccompat.dataset import export, speculators_format

    # data_config.json is made by speculators' own code (tested with speculators in test_dataset_speculators)
    monkeypatch.setattr(speculators_format, "_data_config", lambda entries, info: {"samples": len(entries)})
    monkeypatch.setattr(export, "speculators_missing", lambda layout: None)  # speculators' own code is faked
    src, samples = finished(tmp_path)
    out = tmp_path / "pt"
    beside = tmp_path / "pt.token_freq.pt"
    beside.write_bytes(b"someone's file")
    assert main(["export", str(src), "--to", "speculators-0.4", str(out)]) == 2
    assert "export does not replace it" in capsys.readouterr().err and beside.read_bytes() == b"someone's file"
    assert not out.exists()
    beside.unlink()
    assert main(["export", str(src), "--to", "speculators-0.4", str(out)]) == 0
    import torch

    freq = torch.load(beside, weights_only=True)
    want = {}
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask, strict=True):
            if m:
                want[t] = want.get(t, 0) + 1
    assert freq == want
    assert not [n for n in os.listdir(out) if n.startswith(".speccompat-export")]


# ---------------------------------------------------------------------------------------------
# build folders: never followed
# ---------------------------------------------------------------------------------------------

def sharded_arrow(root):
    from support.shard_runs import run_shard

    model = model_dir(root)
    samples = scan(jsonl(root / "d.jsonl", random_records(8, seed=4)))
    prov = provenance(model, layout="speculators-arrow")
    for k in (0, 1):
        run_shard(root / "out", samples, prov, k, 2)
    return root / "out", samples, prov


@pytest.mark.parametrize("name", [".speccompat-arrow-build", "hidden_states"])
def test_a_linked_build_or_view_folder_makes_merge_refuse_before_anything_moves(tmp_path, outside, capsys, name):
    pytest.importorskip("datasets", reason="the speculators-arrow layout")
    out, _samples, _prov = sharded_arrow(tmp_path)
    os.symlink(outside, out / name)
    before, inside = snapshot(outside), snapshot(out)
    assert main(["merge", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / name} is a symbolic link: refused" in err and "Traceback" not in err
    assert snapshot(outside) == before  # nothing written, moved or deleted outside
    assert snapshot(out) == inside  # nor inside: the parts are not joined yet
    os.unlink(out / name)
    assert main(["merge", str(out)]) == 0


@pytest.mark.parametrize("name", [".speccompat-arrow-build", "hidden_states"])
def test_a_linked_folder_in_a_finished_arrow_set_is_refused_by_the_finish_and_by_a_resume(tmp_path, outside, name):
    pytest.importorskip("datasets", reason="the speculators-arrow layout")
    from speccompat.dataset import Rejected, open_dataset, verify_dataset
    from speccompat.dataset.directory import DatasetDir
    from speccompat.dataset.finish import finish_dataset

    src, samples = finished(tmp_path, layout="speculators-arrow")
    assert verify_dataset(src) == ([], len(samples))
    if name == "hidden_states":
        import shutil

        shutil.rmtree(src / name)
    os.symlink(outside, src / name)
    before, inside = snapshot(outside), snapshot(src)
    with pytest.raises(Rejected, match="is a symbolic link: refused"):
        finish_dataset(DatasetDir(src))
    with pytest.raises(Rejected, match="is a symbolic link: refused"):
        open_dataset(src, samples, provenance(model_dir(tmp_path), layout="speculators-arrow"))
    assert snapshot(outside) == before and snapshot(src) == inside
    problems, _n = verify_dataset(src)
    assert any(p.startswith(f"{name} is a symbolic link") for p in problems), problems


def test_a_folder_named_like_a_temporary_file_does_not_stop_a_run(tmp_path, caplog):
    from speccompat.dataset import open_dataset

    src, samples = finished(tmp_path)
    (src / "x.safetensors.123.partial").mkdir()
    ds = open_dataset(src, samples, provenance(model_dir(tmp_path)))
    ds.close()
    assert ds.todo == [] and "is a folder named like a temporary file" in caplog.text
    assert (src / "x.safetensors.123.partial").is_dir()


KILLED_EXPORT = '''
import os, signal, sys, time
from speccompat.dataset import export as ex_mod
from speccompat.cli import main
real, calls = ex_mod._read_source, []
stage = sys.argv[2] + ".speccompat-export-staging"
def dies(*a, **k):
    calls.append(1)
    if len(calls) == 8:  # 7 samples handed to the writer: once some are written, SIGKILL, no cleanup
        for _ in range(200):
            if len([n for n in os.listdir(stage) if n.endswith(".pt")]) >= 3:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
ex_mod._read_source = dies
main(["export", sys.argv[1], "--to", "speculators-0.4", sys.argv[2]])
'''

LOAD_AND_RERUN = '''
import json, os, sys
import speccompat
speccompat.apply()
import torch
from speculators.train.data import Eagle3SampleFileDataset, list_files
from speccompat.cli import main
out = sys.argv[2]
before = len(list_files(out))  # the loader's own walk
try:
    Eagle3SampleFileDataset(max_len=64, datapath=out, hidden_states_dtype=torch.bfloat16)
    loaded = True
except IndexError:  # no file to read: it fails, never trains on a part
    loaded = False
rc = main(["export", sys.argv[1], "--to", "speculators-0.4", out])
after = Eagle3SampleFileDataset(max_len=64, datapath=out, hidden_states_dtype=torch.bfloat16)
print(json.dumps({"before": before, "loaded": loaded, "rc": rc, "after": len(after), "first": after[0]["lengths"].tolist()}))
'''


@needs_speculators
def test_a_killed_export_leaves_nothing_speculators_loader_reads_and_a_rerun_recovers(tmp_path):
    """SIGKILL mid-export to speculators-0.4: speculators 0.3.0's Eagle3SampleFileDataset (every file
    ending in pt under the directory, recursively) finds no sample in OUT; the rerun exports all 20."""
    from support.speculators_child import ENGINE_ENV, run_child

    path = ENGINE_ENV["speculators"].get("0.3.0")
    if path is None:
        pytest.skip("speculators 0.3.0 is not in this environment")
    src, samples = finished(tmp_path, n=20)
    out = tmp_path / "pt"
    stage = tmp_path / "pt.speccompat-export-staging"
    proc = run_child(KILLED_EXPORT, [str(src), str(out)], path)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert stage.is_dir() and [n for n in os.listdir(stage) if n.endswith(".pt")]  # killed mid-way
    inside = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs]
    assert inside == [] and not (tmp_path / "pt.token_freq.pt").exists()
    proc = run_child(LOAD_AND_RERUN, [str(src), str(out)], path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["before"], got["loaded"], got["rc"], got["after"]) == (0, False, 0, 20)
    assert "found the staging folder of an interrupted export" in proc.stderr
    assert not stage.exists() and (tmp_path / "pt.token_freq.pt").is_file()
    assert not [n for n in os.listdir(out) if n.endswith("token_freq.pt")]


def test_export_refuses_a_source_an_extraction_is_still_writing(tmp_path, capsys):
    """7 of 20 samples written, the extraction still holding the source's lock: export refuses (exit 2)
    as merge does, writing nothing; once the extraction has ended it exports all of them."""
    from speccompat.dataset import open_dataset, verify_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(20, seed=5)))
    prov = provenance(model)
    src, out = tmp_path / "src", tmp_path / "new"
    run(src, samples[:7], prov, batch=2)
    ds = open_dataset(src, samples, prov)  # the extraction of the other 13 is under way
    assert len(ds.todo) == 13
    try:
        assert main(["export", str(src), "--to", "safetensors", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{src} is being written by an extraction (pid {os.getpid()}" in err and "Traceback" not in err
        assert not out.exists() and not (tmp_path / "new.speccompat-export-staging").exists()
    finally:
        ds.lock.close()
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 0
    assert verify_dataset(out) == ([], 7)


def test_export_says_what_to_do_for_an_empty_source_unmerged_shards_and_a_full_disk(tmp_path, capsys, monkeypatch,
                                                                                    caplog):
    import errno

    from speccompat.dataset.fsutil import FileOps
    from speccompat.dataset.shards import ShardSpec, open_shard

    src, samples = finished(tmp_path)
    # an empty source: a header, no entry
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.jsonl").write_text((src / "manifest.jsonl").read_text().splitlines()[0] + "\n")
    assert main(["export", str(empty), "--to", "speculators-arrow", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "its manifest lists no sample: nothing to export" in err and "Traceback" not in err
    # a sharded source not merged yet
    shards = tmp_path / "shards"
    prov = provenance(model_dir(tmp_path))
    ds = open_shard(shards, samples, prov, ShardSpec(2, 0, "test"))
    for h in ds.lock:
        h.close()
    assert main(["export", str(shards), "--to", "safetensors", str(tmp_path / "s")]) == 2
    assert f"run `speccompat merge {shards}` first" in capsys.readouterr().err
    # a full disk: export's own words (nothing kept, nothing to resume), exit 1
    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileOps, "reserve", staticmethod(full))
    out = tmp_path / "new"
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nothing was exported and the staging folder is removed; free some space" in err, err
    assert "re-run to resume" not in err and "finished files are kept" not in err
    assert not out.exists() and not (tmp_path / "new.speccompat-export-staging").exists()


def test_a_rerun_finishes_an_export_killed_between_its_two_renames(tmp_path, monkeypatch, caplog, capsys):
    """Killed after OUT was renamed into place but before the token frequencies were: the rerun moves
    them (saying so) instead of only refusing a non-empty OUT; any other non-empty OUT is refused,
    saying what it holds."""
    from speccompat.dataset import speculators_format

    monkeypatch.setattr(speculators_format, "_data_config", lambda entries, info: {"samples": len(entries)})
    src, _ = finished(tmp_path)
    out = tmp_path / "pt"
    assert main(["export", str(src), "--to", "speculators-0.4", str(out)]) == 0
    freq = tmp_path / "pt.token_freq.pt"
    data = freq.read_bytes()
    os.replace(freq, tmp_path / "pt.speccompat-export-staging.token_freq.pt")
    caplog.set_level("WARNING", "speccompat.dataset")
    assert main(["export", str(src), "--to", "speculators-0.4", str(out)]) == 0
    assert "a finished export whose token-frequency file was still at" in caplog.text
    assert freq.read_bytes() == data and not (tmp_path / "pt.speccompat-export-staging.token_freq.pt").exists()
    capsys.readouterr()
    assert main(["export", str(src), "--to", "safetensors", str(out)]) == 2
    assert "exists and is not empty (it holds a data set (manifest.jsonl);" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["hidden_states/hs_1.safetensors", "dataset_info.json"])
def test_verify_reports_a_link_of_the_set_that_points_outside(tmp_path, capsys, name):
    """A view or side file replaced by a symbolic link to a copy outside (the same bytes: every
    content check passes): verify names the link and its target, exit 1."""
    pytest.importorskip("datasets")
    src, _ = finished(tmp_path, layout="speculators-arrow")
    capsys.readouterr()
    copy = tmp_path / "elsewhere"
    copy.write_bytes((src / name).read_bytes())
    os.unlink(src / name)
    os.symlink(copy, src / name)
    assert main(["verify", str(src)]) == 1
    out = capsys.readouterr().out
    assert f"{src}/{name}: a symbolic link to {copy}, outside the data set" in out, out


def test_verify_says_a_set_is_being_written(tmp_path, capsys):
    """While an extraction holds the lock: verify says so (exit 1) instead of "0 problems", and lists
    none of its files in progress as extra; with no manifest yet, exit 2 saying it is being written."""
    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(6, seed=5)))
    prov = provenance(model)
    src = tmp_path / "src"
    run(src, samples[:3], prov, batch=2)
    ds = open_dataset(src, samples, prov)
    (src / f"x.safetensors.{os.getpid()}.partial").write_bytes(b"in progress")
    try:
        capsys.readouterr()
        assert main(["verify", str(src)]) == 1
        got = capsys.readouterr()
        assert f"manifest.jsonl: the data set is being written (pid {os.getpid()} holds .speccompat-dataset.lock)" \
            in got.out and "only the 3 sample(s) finished so far" in got.out
        assert "extra file" not in got.out and "1 problem(s)" in got.err
    finally:
        ds.lock.close()
    fresh = tmp_path / "fresh"
    ds = open_dataset(fresh, samples, prov)
    os.unlink(fresh / "manifest.jsonl")  # as before its first line is written
    try:
        assert main(["verify", str(fresh)]) == 2
        assert "it is being written (pid" in capsys.readouterr().err
    finally:
        ds.lock.close()
