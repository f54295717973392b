"""Opening an output directory for a run (speccompat.dataset.store.open_dataset) with fake results
(no vLLM): what is written, resume with checksums, a changed model or input refused, a full disk,
resumed and uninterrupted runs byte-identical, the manifest in input order."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from support.dataset_fakes import HIDDEN, LAYERS, jsonl, model_dir, random_records, states
from support.dataset_runs import manifest_entries, needs_torch, provenance, run, scan

from speccompat.dataset import Rejected
from speccompat.dataset.fsutil import FileOps


@needs_torch
def test_the_manifest_keeps_the_input_order_after_a_sample_is_redone(tmp_path):
    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(6, seed=2)))
    out = tmp_path / "out"
    run(out, samples, provenance(model), batch=2)
    order = [e["id"] for e in manifest_entries(out)]
    assert order == [s.id for s in samples]
    victim = out / next(e["file"] for e in manifest_entries(out) if e["id"] == samples[1].id)
    victim.unlink()  # the resume redoes it: its entry is appended after the others
    ds, _ = run(out, samples, provenance(model), batch=2)
    assert [s.id for s in ds.todo] == [samples[1].id]
    assert [e["id"] for e in manifest_entries(out)] == order


@needs_torch
def test_written_files_hold_the_results_the_provenance_and_pass_verify(world):
    import torch
    from safetensors import safe_open

    from speccompat.dataset import verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds, stats = run(out, samples, provenance(model))
    assert stats.files == len(samples) and not list(out.glob("*.partial"))
    entries = manifest_entries(out)
    assert sorted(e["id"] for e in entries) == sorted(s.id for s in samples)
    header = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert header["provenance"]["model"]["config_sha256"] and header["checksum"] in ("xxh3_64", "crc32")
    for s in samples:
        path = out / ds.files[s.id]
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            assert f.get_tensor("input_ids").tolist() == list(s.input_ids)
            for layer, h in zip(LAYERS, states(s), strict=True):
                assert torch.equal(f.get_tensor(f"hidden_states_{layer}"), h)
            if s.loss_mask is not None:
                assert f.get_tensor("loss_mask").tolist() == list(s.loss_mask)
        assert json.loads(meta["speccompat_provenance"]) == header["provenance"]
        assert json.loads(meta["speccompat_sample"])["id"] == s.id
    assert verify_dataset(out) == ([], len(samples))


@needs_torch
def test_resume_skips_intact_files_and_redoes_changed_ones(world, caplog):
    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    victim = out / ds.files["s003"]
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    # same size, hidden-state bytes overwritten in place with NaN
    data = bytearray(victim.read_bytes())
    data[-64:] = (b"\xc0\x7f" * 32)
    victim.write_bytes(bytes(data))
    (out / ds.files["s004"]).unlink()
    from speccompat.dataset import open_dataset

    with caplog.at_level("INFO"):
        ds2 = open_dataset(out, samples, provenance(model))
    ds2.lock.close()
    assert sorted(s.id for s in ds2.todo) == ["s003", "s004"]
    assert "checksum differs from the manifest" in caplog.text
    _, stats = run(out, samples, provenance(model))
    assert stats.files == 2
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert {n for n in after if after[n] != before.get(n)} == {victim.name, ds.files["s004"]}
    from speccompat.dataset import verify_dataset

    assert verify_dataset(out)[0] == []


def test_a_header_without_samples_is_replaced_by_the_corrected_command(world):
    """An engine that did not start leaves only the run's header: the command run again with corrected
    settings is not refused as "made differently" (nothing could be mixed); one finished sample is."""
    from speccompat.dataset import open_dataset

    root, model, data, samples = world
    out = root / "out"
    ds = open_dataset(out, samples, provenance(model, max_seq_len=64))
    ds.close()  # the engine failed to start: nothing was written but the header
    assert json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["provenance"]["max_seq_len"] == 64
    ds = open_dataset(out, samples, provenance(model, max_seq_len=32))
    ds.close()
    head = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    assert head["provenance"]["max_seq_len"] == 32 and len(ds.todo) == len(samples)


@needs_torch
def test_a_different_model_or_input_is_refused_before_anything_runs_unless_overwrite(world):
    root, model, data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    manifest = (out / "manifest.jsonl").read_bytes()
    other = model_dir(root / "other", hidden=HIDDEN, rope_theta=5.0)
    with pytest.raises(Rejected, match="model.config_sha256"):
        run(out, samples, provenance(other))
    with pytest.raises(Rejected, match=r"hidden_states.dtype: \"bfloat16\" -> \"float16\""):
        run(out, samples, provenance(model, dtype="float16"))
    with pytest.raises(Rejected, match="versions.vllm"):
        run(out, samples, provenance(model, status={"vllm": {"raw": "0.33.0"}}))
    changed = json.loads(data.read_text().splitlines()[2])
    changed["loss_mask"] = [1 - m for m in changed["loss_mask"]]
    lines = data.read_text().splitlines()
    lines[2] = json.dumps(changed)
    data2 = jsonl(root / "data2.jsonl", lines)
    with pytest.raises(Rejected, match=r"id 's002' \(line 3\): input_ids/loss_mask differ"):
        run(out, scan(data2), provenance(model))
    assert (out / "manifest.jsonl").read_bytes() == manifest  # refused: nothing touched
    ds, stats = run(out, samples, provenance(other), overwrite=True)
    assert stats.files == len(samples)
    assert json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["provenance"]["model"]["path"] == str(other)


@needs_torch
def test_no_manifest_but_sample_files_is_refused(tmp_path):
    model = model_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").write_bytes(b"x")
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(2)))
    with pytest.raises(Rejected, match="no manifest.jsonl"):
        run(out, samples, provenance(model))


@pytest.mark.parametrize("kind", ["file", "readonly", "sys"])
def test_output_dir_problems_are_rejected_with_a_message(tmp_path, kind):
    from speccompat.dataset.fsutil import check_output_dir

    if kind == "file":
        target = tmp_path / "f"
        target.write_text("")
        match = "not a directory"
    elif kind == "readonly":
        if os.geteuid() == 0:
            # root ignores permission bits: a read-only bind mount is what refuses root
            target = tmp_path / "ro"
            target.mkdir()
            r = subprocess.run(["mount", "--bind", "-o", "ro", str(target), str(target)], capture_output=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make a read-only mount here: {r.stderr.decode().strip()}")
            match = "read-only"
        else:
            target = tmp_path / "ro"
            target.mkdir()
            target.chmod(0o500)
            match = "permission denied"
    else:
        target = Path("/sys/speccompat-test")
        match = "cannot create --output-dir"
    try:
        with pytest.raises(Rejected, match=match):
            check_output_dir(target)
    finally:
        if kind == "readonly" and os.geteuid() == 0:
            subprocess.run(["umount", str(target)], capture_output=True)


class FullDisk(FileOps):
    """The disk fills after ``left`` bytes. A file's space is taken whole when the writer reserves
    it (as ``posix_fallocate`` does), so files written side by side cannot all end half-written:
    the files that got their space are complete, the first that does not fit fails with ENOSPC."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.lock = threading.Lock()

    def reserve(self, fd, size):
        with self.lock:
            if self.left < size:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= size


@needs_torch
def test_a_full_disk_keeps_finished_files_and_a_rerun_resumes(world):
    from speccompat.dataset import NoSpace, verify_dataset

    root, model, _data, samples = world
    out, ref = root / "out", root / "ref"
    run(ref, samples, provenance(model))
    with pytest.raises(NoSpace, match=f"no space left on {out}"):
        run(out, samples, provenance(model), ops=FullDisk(left=6000))
    kept = manifest_entries(out)
    assert 0 < len(kept) < len(samples)
    assert not list(out.glob("*.partial"))
    assert {p.name for p in out.glob("*.safetensors")} == {e["file"] for e in kept}
    problems, _ = verify_dataset(out)
    assert problems == []  # what is there is complete and listed
    _, stats = run(out, samples, provenance(model))
    assert stats.files == len(samples) - len(kept)
    # byte-identical to the uninterrupted run (same created date: SOURCE_DATE_EPOCH unset -> kept
    # from the first run, so compare tensors and sample facts, and the whole file where dates agree)
    for p in ref.glob("*.safetensors"):
        from speccompat.dataset.formats import read_safetensors

        m1, t1, _ = read_safetensors(p)
        m2, t2, _ = read_safetensors(out / p.name)
        assert {k: bytes(v[2]) for k, v in t1.items()} == {k: bytes(v[2]) for k, v in t2.items()}
        assert m1["speccompat_sample"] == m2["speccompat_sample"]


@needs_torch
def test_resumed_and_uninterrupted_runs_are_byte_identical(world, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    root, model, _data, samples = world
    run(root / "a", samples, provenance(model))
    from speccompat.dataset import NoSpace

    with pytest.raises(NoSpace):
        run(root / "b", samples, provenance(model), ops=FullDisk(left=9000))
    run(root / "b", samples, provenance(model))
    a = {p.name: p.read_bytes() for p in (root / "a").glob("*.safetensors")}
    b = {p.name: p.read_bytes() for p in (root / "b").glob("*.safetensors")}
    assert a == b and len(a) == len(samples)
