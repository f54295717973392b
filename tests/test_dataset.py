"""speccompat.dataset with fake generator results (no vLLM): names, input checks, provenance,
writer, resume with checksums, a full disk, the in-flight budget, verify, layer ids."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.dataset_fakes import HIDDEN, LAYERS, VOCAB, jsonl, model_dir, random_records, states
from support.dataset_runs import HOSTILE, manifest_entries, needs_torch, provenance, run, scan

from speccompat.dataset import Rejected, name_for_id
from speccompat.dataset.fsutil import FileOps
from speccompat.dataset.names import id_for_name

# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------


def test_names_are_injective_reversible_and_safe_on_case_insensitive_file_systems(tmp_path):
    names = [name_for_id(i, ".safetensors") for i in HOSTILE]
    assert len(set(names)) == len(HOSTILE)
    assert len({n.lower() for n in names}) == len(HOSTILE)  # case-insensitive file systems
    for sample_id, name in zip(HOSTILE, names, strict=True):
        assert "/" not in name and "\0" not in name and "\\" not in name and not name.startswith(".")
        assert len(name.encode()) + len(".12345678.partial") <= 255
        back = id_for_name(name, ".safetensors")
        assert back is None if len(sample_id) >= 100 else back == sample_id
        (tmp_path / name).write_bytes(b"")  # a real file system takes every one
    assert len(list(tmp_path.iterdir())) == len(HOSTILE)
    # the old scheme's collision: a sanitised id equal to another id's name
    assert name_for_id("a/b") != name_for_id("a_b-3ec69c85a4")


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------

def test_every_bad_line_is_reported_with_its_line_number(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    good = {"id": "ok", "input_ids": [5, 6, 7]}
    lines = [
        json.dumps(good),
        '{"id": "big", "input_ids": [5, ' + "9" * 5000 + "]}",                   # 2 int too long for str()
        json.dumps({"id": "f", "input_ids": [5, 6.0]}),                           # 3 float
        json.dumps({"id": "b", "input_ids": [5, True]}),                          # 4 bool
        json.dumps({"id": True, "input_ids": [5]}),                               # 5 bool id
        json.dumps({"id": "oov", "input_ids": [5, VOCAB]}),                       # 6 outside vocabulary
        json.dumps({"id": "m", "input_ids": [5, 6], "loss_mask": [1, 0.5]}),      # 7 float mask
        json.dumps({"id": "m2", "input_ids": [5, 6], "loss_mask": [1, True]}),    # 8 bool mask
        json.dumps({"id": 7, "input_ids": [5]}),                                  # 9 int id "7"
        json.dumps({"id": "7", "input_ids": [5]}),                                # 10 same id as a string
        "[1, 2]",                                                                 # 11 not an object
        '{"id": "x", "input_ids": [5',                                            # 12 bad JSON
        json.dumps({"id": "neg", "input_ids": [-1]}),                             # 13 negative
        json.dumps({"id": "big2", "input_ids": [10 ** 30]}),                      # 14 huge but convertible
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"id": "\xff"}\n'                # 15 not UTF-8
    path = tmp_path / "in.jsonl"
    path.write_bytes(raw)
    scan = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=100)
    got = {p.line: p.reason for p in scan.problems}
    expect = {2: "4300 digits", 3: "6.0 is not an integer", 4: "True is not an integer", 5: '"id" must be',
              6: "outside the vocabulary", 7: "0.5 is not the integer 0 or 1", 8: "True is not the integer",
              10: "duplicate id '7' (first on line 9)", 11: "expected a JSON object", 12: "bad JSON",
              13: "outside the vocabulary", 14: "outside the vocabulary", 15: "not UTF-8"}
    assert sorted(got) == sorted(expect), got
    for line, phrase in expect.items():
        assert phrase in got[line], (line, got[line])
    assert [s.id for s in scan.samples] == ["ok", "7"]
    assert all(p.fatal for p in scan.problems)
    with pytest.raises(Rejected, match=r"13 unusable line\(s\)"):
        from speccompat.dataset.inputs import report_scan

        report_scan(scan, 100)


def test_a_byte_order_mark_is_accepted_and_a_duplicate_key_refused_naming_line_and_key(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "input_ids": [5, 6]}).encode() + b"\n"
                     + b'{"id": "b", "input_ids": [5, 6], "input_ids": [7]}\n'
                     + b'{"id": "c", "input_ids": [5], "loss_mask": [1], "loss_mask": [0]}\n'
                     + json.dumps({"id": "d", "input_ids": [8]}).encode() + b"\n")
    scan = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=100)
    assert [(s.id, list(s.input_ids)) for s in scan.samples] == [("a", [5, 6]), ("d", [8])]
    assert [(p.line, p.reason) for p in scan.problems] == [
        (2, "duplicate key 'input_ids' in a JSON object: which value is meant cannot be told"),
        (3, "duplicate key 'loss_mask' in a JSON object: which value is meant cannot be told")]
    assert all(p.fatal for p in scan.problems)


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


def test_long_lines_truncate_skip_or_fail(tmp_path):
    from speccompat.dataset.inputs import scan_jsonl

    path = jsonl(tmp_path / "in.jsonl", [{"id": "l", "input_ids": list(range(4, 20)), "loss_mask": [1] * 16}])
    s = scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10).samples[0]
    assert s.num_tokens == 10 and s.truncated_from == 16 and len(s.loss_mask) == 10
    assert scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10, on_long="skip").samples == []
    assert scan_jsonl(path, vocab_size=VOCAB, max_seq_len=10, on_long="fail").problems[0].fatal


# ---------------------------------------------------------------------------------------------
# a data set written from fake results
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path):
    model = model_dir(tmp_path)
    records = random_records(10) + [{"id": i, "input_ids": [5, 6, 7, k + 4]} for k, i in enumerate(HOSTILE[:12])]
    data = jsonl(tmp_path / "data.jsonl", records)
    return tmp_path, model, data, scan(data)


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


class SlowDisk(FileOps):
    def write(self, fd, buf):
        time.sleep(0.02)
        return os.write(fd, buf)


@needs_torch
def test_the_in_flight_budget_bounds_memory_and_the_caller_does_not_wait_below_it(tmp_path):
    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(12, lo=30, hi=31)))
    per = 30 * HIDDEN * 2 * len(LAYERS)
    ds = open_dataset(tmp_path / "out", samples, provenance(model))
    w = ds.writer(threads=2, max_in_flight_bytes=3 * per, ops=SlowDisk())
    w.submit([ds.job(s, states(s)) for s in ds.todo[:2]])
    assert w.stats.waits == 0  # below the budget: returns without waiting
    for k in range(2, 12, 2):
        w.submit([ds.job(s, states(s)) for s in ds.todo[k:k + 2]])
    stats = w.close()
    assert stats.files == 12 and stats.waits > 0 and stats.waited_s > 0 and stats.peak_in_flight <= 4 * per


class SlowFsyncDir(FileOps):
    """Directory fsyncs of 50 ms (a disk whose journal commits lag); counts them. The
    ``fail_rename``-th rename fails with EIO when set."""

    def __init__(self, fail_rename: int | None = None) -> None:
        self.calls, self.renames, self.fail_rename = 0, 0, fail_rename

    def fsync_dir(self, path):
        self.calls += 1
        time.sleep(0.05)
        return super().fsync_dir(path)

    def replace(self, src, dst):
        self.renames += 1
        if self.renames == self.fail_rename:
            raise OSError(errno.EIO, "Input/output error")
        return super().replace(src, dst)


@needs_torch
def test_batches_finished_during_a_commit_are_committed_together_in_submission_order(tmp_path):
    from speccompat.dataset import open_dataset, verify_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(40, lo=30, hi=31)))
    ds = open_dataset(tmp_path / "out", samples, provenance(model))
    ops = SlowFsyncDir()
    w = ds.writer(threads=4, ops=ops)
    for s in ds.todo:
        w.submit([ds.job(s, states(s))])  # one sample per batch, as the streaming driver submits
    stats = w.close()
    ds.lock.close()
    assert stats.files == 40
    # a commit per batch would take 40 directory fsyncs (2 s); the writer threads finish batches
    # while one commits, and the next commit takes all of them
    assert ops.calls < 40 / 2, ops.calls
    assert [e["id"] for e in manifest_entries(tmp_path / "out")] == [s.id for s in samples]
    problems, _ = verify_dataset(tmp_path / "out")
    assert problems == []


@needs_torch
def test_a_failed_group_commit_lists_only_files_in_place_and_commits_nothing_later(tmp_path):
    from speccompat.dataset import WriterFailed, open_dataset, verify_dataset

    model = model_dir(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(24, lo=30, hi=31)))
    out = tmp_path / "out"
    ds = open_dataset(out, samples, provenance(model))
    w = ds.writer(threads=4, ops=SlowFsyncDir(fail_rename=5))
    with pytest.raises(WriterFailed, match="Input/output error"):
        for s in ds.todo:
            w.submit([ds.job(s, states(s))])
        w.close()
    w.close(raise_error=False)
    ds.lock.close()
    kept = manifest_entries(out)
    assert [e["id"] for e in kept] == [s.id for s in samples[:4]]  # the files renamed before the failure
    assert {p.name for p in out.glob("*.safetensors")} == {e["file"] for e in kept}
    assert not list(out.glob("*.partial"))
    problems, _ = verify_dataset(out)
    assert problems == []


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), from ``mincore`` on a mapping that
    touches none of them."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


class OpsLog(FileOps):
    """Records, per file descriptor, the writer's calls on it (drop_cache as the writer makes it)."""

    def __init__(self, keep_cache: bool = False) -> None:
        self.calls: dict[int | str, list[str]] = {}  # by fd while open, by "path#fd" once closed
        self.paths: dict[int, str] = {}
        self.keep_cache = keep_cache
        self.lock = threading.Lock()

    def _log(self, fd, what):
        with self.lock:
            self.calls.setdefault(fd, []).append(what)

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        with self.lock:
            self.calls[fd], self.paths[fd] = [], str(path)
        return fd

    def write(self, fd, buf):
        self._log(fd, "write")
        return os.write(fd, buf)

    def fsync(self, fd):
        self._log(fd, "fsync")
        os.fsync(fd)

    def drop_cache(self, fd):
        self._log(fd, "drop_cache")
        if not self.keep_cache:
            FileOps.drop_cache(fd)

    def close(self, fd):
        self._log(fd, "close")
        with self.lock:
            self.calls[f"{self.paths[fd]}#{fd}"] = self.calls.pop(fd)  # an fd number is reused
        os.close(fd)


def written(tmp_path: Path, hidden: int, ops: FileOps, n: int = 6):
    """``n`` samples of 40 tokens x ``hidden`` written through ``ops``; the data set's directory."""
    import torch

    from speccompat.dataset import open_dataset

    model = model_dir(tmp_path / f"m{hidden}", hidden=hidden)
    samples = scan(jsonl(tmp_path / f"d{hidden}.jsonl", random_records(n, lo=40, hi=41)))
    out = tmp_path / f"out-{type(ops).__name__}-{getattr(ops, 'keep_cache', '')}"
    ds = open_dataset(out, samples, provenance(model))
    w = ds.writer(threads=2, ops=ops)
    g = torch.Generator().manual_seed(0)
    for s in ds.todo:
        w.submit([ds.job(s, [torch.randn(s.num_tokens, hidden, generator=g).to(torch.bfloat16) for _ in LAYERS])])
    stats = w.close()
    ds.lock.close()
    assert stats.files == n
    return out


@needs_torch
def test_each_sample_file_is_dropped_from_the_page_cache_once_it_is_durable(tmp_path):
    ops = OpsLog()
    out = written(tmp_path, HIDDEN, ops)
    files = {k: v for k, v in ops.calls.items() if ".safetensors." in k}
    assert len(files) == 6
    for name, calls in files.items():
        # reserve is not logged; the header and the tensors are written, then fsync, then the drop
        assert calls[-3:] == ["fsync", "drop_cache", "close"], (name, calls)
        assert calls.count("drop_cache") == 1 and set(calls[:-3]) == {"write"}, (name, calls)
    manifest = [c for k, c in ops.calls.items() if k.startswith(str(out / "manifest.jsonl"))]
    assert manifest and all("drop_cache" not in c for c in manifest)  # the manifest is read back at once
    from speccompat.dataset import verify_dataset

    assert verify_dataset(out) == ([], 6)


@needs_torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise as on Linux")
def test_written_sample_files_leave_no_pages_in_the_page_cache(tmp_path):
    # what this file system does with a written, fsync'd file once told its pages are not needed
    probe = tmp_path / "probe.bin"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT)
    os.write(fd, os.urandom(64 * 4096))
    os.fsync(fd)
    cached_after_write = resident_pages(probe)[0]
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if cached_after_write == 0 or resident_pages(probe)[0] > 0:
        pytest.skip(f"the file system of {tmp_path} keeps no written pages or keeps them whatever it is told "
                    "(tmpfs, some network file systems): nothing to drop")
    hidden = 1024  # files of 80 pages and more
    dropped = written(tmp_path, hidden, OpsLog())
    kept = written(tmp_path, hidden, OpsLog(keep_cache=True))  # the control: the pages were there to drop
    for out, expect_cached in ((dropped, False), (kept, True)):
        files = sorted(out.glob("*.safetensors"))
        assert len(files) == 6
        for f in files:
            cached, pages = resident_pages(f)
            assert pages >= 80
            assert (cached > pages // 2) if expect_cached else cached == 0, (f.name, cached, pages)


@needs_torch
def test_a_failing_page_cache_drop_is_no_write_error(tmp_path, monkeypatch):
    from speccompat.dataset import verify_dataset

    calls = []

    def refuse(fd, offset, length, advice):
        calls.append(advice)
        raise OSError(errno.ESPIPE, "Illegal seek")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    monkeypatch.setattr(os, "POSIX_FADV_DONTNEED", 4, raising=False)
    out = written(tmp_path, HIDDEN, FileOps())
    assert len(calls) == 6  # asked for each file; refused; the files are written all the same
    assert verify_dataset(out) == ([], 6)


@needs_torch
def test_verify_reports_each_planted_problem(world, capsys):
    from speccompat.cli import main as cli_main
    from speccompat.dataset import open_dataset, verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    assert cli_main(["verify", str(out)]) == 0
    f = {s.id: out / ds.files[s.id] for s in samples}
    f["s000"].unlink()                                                   # missing
    data = bytearray(f["s001"].read_bytes())
    data[-2:] = b"\x01\x02"
    f["s001"].write_bytes(bytes(data))                                   # checksum
    (out / "stray.bin").write_bytes(b"")                                 # extra
    (out / "x.safetensors.1.partial").write_bytes(b"")                   # leftover
    # a file of another provenance (and a NaN sample) written under the same manifest
    other = provenance(model)
    other["max_seq_len"] = 99
    ds2 = open_dataset(root / "out2", [samples[2]], other)
    w = ds2.writer()
    bad_states = states(samples[2])
    bad_states[0][0, 0] = float("nan")
    w.submit([ds2.job(samples[2], bad_states)])
    w.close()
    ds2.lock.close()
    (root / "out2" / ds2.files["s002"]).replace(f["s002"])
    entries = manifest_entries(root / "out2")
    with open(out / "manifest.jsonl", "a") as m:
        m.write(json.dumps(entries[0]) + "\n")
    problems, _ = verify_dataset(out)
    text = "\n".join(problems)
    for phrase in ["s000.safetensors: missing", "s001.safetensors: hidden_states_5 checksum differs",
                   "stray.bin: extra file", "x.safetensors.1.partial: extra file (temporary",
                   "s002.safetensors: hidden_states_1 has 1 non-finite", "s002.safetensors: provenance differs",
                   "max_seq_len"]:
        assert phrase in text, (phrase, text)
    assert len(problems) == 6, text
    assert cli_main(["verify", str(out)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6 and all(line.startswith(str(out)) for line in printed)


# ---------------------------------------------------------------------------------------------
# layer ids
# ---------------------------------------------------------------------------------------------

def test_layer_id_defaults_are_checked_against_the_model(tmp_path):
    from speccompat.layers import LayerIdsError, check_generator_layer_ids, resolve_layer_ids

    assert resolve_layer_ids(None, 61) == [2, 30, 58, 60]
    assert resolve_layer_ids(None, 8) == [2, 4, 5, 7]
    with pytest.raises(LayerIdsError, match=r"\[2, 3, 3, 5\] for this model's 6 decoder layers"):
        resolve_layer_ids(None, 6)
    with pytest.raises(LayerIdsError, match=r"outside the model's decoder layers \[0, 5\]"):
        resolve_layer_ids([1, 6], 6)
    model = model_dir(tmp_path)  # 6 layers
    with pytest.raises(LayerIdsError, match=r"\[2, 3, 3, 5\]"):
        check_generator_layer_ids(str(model), None)
    check_generator_layer_ids(str(model), [1, 2, 4, 5])
    kimi = model_dir(tmp_path / "kimi", text_config={"num_hidden_layers": 61})
    cfg = json.loads((kimi / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (kimi / "config.json").write_text(json.dumps(cfg))
    check_generator_layer_ids(str(kimi), None)  # text_config: 61 layers, default fine


def test_the_generator_patch_rejects_a_colliding_default_before_speculators_init_runs(tmp_path):
    from speccompat.generator import wrap_init

    model = model_dir(tmp_path)  # 6 layers: speculators' default would be [2, 3, 3, 5]
    called = []
    with pytest.raises(ValueError, match=r"\[2, 3, 3, 5\]"):
        wrap_init(lambda *a, **k: called.append(1), None, (str(model),), {})
    with pytest.raises(ValueError, match=r"\[2, 3, 3, 5\]"):
        wrap_init(lambda *a, **k: called.append(1), None, (), {"model_path": str(model), "layer_ids": None})
    assert called == []
    wrap_init(lambda *a, **k: called.append(1), None, (str(model), [1, 2, 4, 5]), {})
    assert called == [1]


def test_importing_the_package_imports_neither_torch_nor_safetensors():
    code = ("import sys, speccompat, speccompat.dataset, speccompat.dataset.verify, speccompat.cli;"
            "from speccompat.dataset import store, writer, inputs;"
            "print([m for m in ('torch', 'safetensors', 'vllm', 'xxhash') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
