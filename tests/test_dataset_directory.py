"""The output directory's owner (speccompat.dataset.directory) with fake results (no vLLM): paths
stay inside the directory, locks are never leaked, malformed files and manifest fields are named,
--overwrite's semantics, the writer's commit errors, sharding from the environment, and the exit
statuses of verify and merge."""

from __future__ import annotations

import ast
import errno
import fcntl
import json
import logging
import os
import re
from pathlib import Path

import pytest
from support.dataset_fakes import jsonl, model_dir, random_records, states

from speccompat.dataset import Rejected
from speccompat.dataset.fsutil import FileOps

torch = pytest.importorskip("torch", reason="the writer needs torch")

from support.dataset_runs import manifest_entries, provenance, run, scan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def world(tmp_path):
    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "data.jsonl", random_records(8))
    return tmp_path, model, data, scan(data)


def lock_is_free(out: Path, name: str = ".speccompat-dataset.lock") -> bool:
    with open(out / name, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def write_header(out: Path, mutate) -> None:
    lines = (out / "manifest.jsonl").read_text().splitlines()
    obj = json.loads(lines[1])
    mutate(obj)
    lines[1] = json.dumps(obj)
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# locks
# ---------------------------------------------------------------------------------------------

def test_a_refused_open_releases_the_directory_lock(world):
    from speccompat.dataset import open_dataset
    from speccompat.dataset.shards import ShardSpec, open_shard

    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    with pytest.raises(Rejected, match="made differently") as refused:
        open_dataset(out, samples, provenance(model, dtype="float16"))
    assert lock_is_free(out), "open_dataset kept the lock after refusing"
    with pytest.raises(Rejected, match="made differently") as refused_shard:
        open_shard(out, samples, provenance(model, dtype="float16"), ShardSpec(2, 0, "test"))
    assert lock_is_free(out) and lock_is_free(out, ".speccompat-shard-00000-of-00002.lock")
    with open_dataset(out, samples, provenance(model)) as ds:  # a corrected run starts at once
        assert ds.todo == [] and not lock_is_free(out)
    assert lock_is_free(out)
    del refused, refused_shard


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(world):
    from speccompat.cli import main as cli_main

    root, model, _data, samples = world
    out, victim = root / "out", root / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    (out / ".speccompat-dataset.lock").symlink_to(victim)
    with pytest.raises(Rejected, match=r"\.speccompat-dataset\.lock is a symbolic link"):
        run(out, samples, provenance(model))
    assert cli_main(["merge", str(out)]) == 2
    assert victim.read_text() == "precious"
    assert not (out / "manifest.jsonl").exists()


@pytest.mark.parametrize("name", [".speccompat-dataset.lock", ".speccompat-shard-00000-of-00002.lock"])
def test_a_hard_linked_lock_file_is_refused_and_the_other_file_untouched(world, name):
    """A lock file that is a hard link to a file outside: every command that takes (or probes) the
    lock refuses, naming it; the outside file keeps its bytes (the pid is never written into it)."""
    from speccompat.cli import main as cli_main
    from speccompat.dataset.directory import DatasetDir
    from speccompat.dataset.shards import ShardSpec, open_shard

    root, model, _data, samples = world
    out, victim = root / "out", root / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    os.link(victim, out / name)
    with pytest.raises(Rejected, match=rf"{re.escape(name)} has 2 hard links: refused"):
        if name.startswith(".speccompat-shard"):
            open_shard(out, samples, provenance(model), ShardSpec(2, 0, "test"))
        else:
            run(out, samples, provenance(model))
    with pytest.raises(Rejected, match="hard links"):
        DatasetDir(out).held(name)
    assert cli_main(["merge", str(out)]) == 2
    assert victim.read_text() == "precious" and os.stat(victim).st_nlink == 2
    assert not (out / "manifest.jsonl").exists()


def test_a_symlinked_manifest_is_refused_and_its_target_untouched(world):
    from speccompat.cli import main as cli_main

    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    target = root / "elsewhere.jsonl"
    (out / "manifest.jsonl").rename(target)
    (out / "manifest.jsonl").symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(Rejected, match=r"cannot read .*manifest.jsonl: .*a manifest must be a plain file"):
        run(out, samples, provenance(model))
    assert lock_is_free(out)
    assert cli_main(["verify", str(out)]) == 2
    assert target.read_bytes() == before and (out / "manifest.jsonl").is_symlink()


# ---------------------------------------------------------------------------------------------
# nothing outside the directory
# ---------------------------------------------------------------------------------------------

def test_a_manifest_entry_naming_a_path_outside_is_dropped_and_nothing_outside_is_touched(world, caplog):
    from speccompat.dataset import verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    victim_dir = root / "victim"
    victim_dir.mkdir()
    (victim_dir / "b.txt").write_text("precious")
    lines = (out / "manifest.jsonl").read_text().splitlines()
    entry = json.loads(lines[1])
    (out / entry["file"]).unlink()  # the sample must be redone: the run would write it
    entry["file"] = "../victim/b.txt"
    lines[1] = json.dumps(entry)
    absolute = {**json.loads(lines[2]), "file": str(victim_dir / "b.txt"), "id": "not-in-input"}
    (out / "manifest.jsonl").write_text("\n".join([*lines, json.dumps(absolute)]) + "\n")
    problems, _ = verify_dataset(out)
    assert any("line 2: file '../victim/b.txt' contains a path separator" in p for p in problems), problems
    with caplog.at_level(logging.WARNING):
        _, stats = run(out, samples, provenance(model))
    assert "line 2: file '../victim/b.txt'" in caplog.text
    assert stats.files == 1
    assert (victim_dir / "b.txt").read_text() == "precious"
    assert sorted(p.name for p in victim_dir.iterdir()) == ["b.txt"]
    # --overwrite with an entry of an id not in the input naming an outside path: dropped too
    (out / "manifest.jsonl").write_text((out / "manifest.jsonl").read_text() + json.dumps(absolute) + "\n")
    run(out, samples, provenance(model), overwrite=True)
    assert (victim_dir / "b.txt").read_text() == "precious"
    assert verify_dataset(out) == ([], len(samples))
    assert ds.files == {s.id: f for s, f in zip(samples, [ds.files[s.id] for s in samples], strict=True)}


def test_a_symlinked_sample_file_is_redone_in_place_and_its_target_untouched(world):
    from speccompat.dataset import verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    victim = root / "victim.safetensors"
    name = ds.files[samples[0].id]
    (out / name).rename(victim)
    (out / name).symlink_to(victim)
    before = victim.read_bytes()
    problems, _ = verify_dataset(out)
    assert problems == [f"{name}: is a symbolic link, not a file of this data set (refused)"]
    _, stats = run(out, samples, provenance(model))
    assert stats.files == 1 and victim.read_bytes() == before
    assert not (out / name).is_symlink() and verify_dataset(out) == ([], len(samples))


# ---------------------------------------------------------------------------------------------
# malformed files and manifest fields: named, never a traceback
# ---------------------------------------------------------------------------------------------

HEADER_DAMAGE = {
    "flipped byte (data_offsets)": lambda h: h.replace(b'"data_offsets"', b'"data_offsetz"', 1),
    "not an object": lambda h: b"[1]" + b" " * (len(h) - 3),
    "shape not a list": lambda h: h.replace(b'"shape":[', b'"shape":7,"x":[', 1),
    "offsets not numbers": lambda h: h.replace(b'"data_offsets":[0', b'"data_offsets":["0"', 1),
    "tensor info not an object": lambda h: h.replace(b'{"dtype":"I64"', b'[{"dtype":"I64"', 1),
    "metadata not strings": lambda h: h.replace(b'"__metadata__":{', b'"__metadata__":{"n":1,', 1),
    "dtype missing": lambda h: h.replace(b'"dtype":"I64"', b'"dtypo":"I64"', 1),
}


@pytest.mark.parametrize("damage", sorted(HEADER_DAMAGE))
def test_a_malformed_sample_header_is_named_by_verify_and_redone_by_a_resume(world, damage):
    from speccompat.dataset import open_dataset, verify_dataset
    from speccompat.dataset.formats import read_safetensors

    root, model, _data, samples = world
    out = root / "out"
    ds, _ = run(out, samples, provenance(model))
    name = ds.files[samples[3].id]
    raw = (out / name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = HEADER_DAMAGE[damage](raw[8:8 + n])
    header = header[:n] + b" " * (n - len(header))  # same length: only the header changes
    (out / name).write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(ValueError):
        read_safetensors(out / name)
    problems, _ = verify_dataset(out)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: unreadable: "), problems
    with open_dataset(out, samples, provenance(model)) as ds2:
        assert [s.id for s in ds2.todo] == [samples[3].id]


MANIFEST_DAMAGE = {
    "bytes": "x", "line": -1, "num_tokens": None, "tensors": [], "input_sha256": 5, "id": 7,
    "file": "../x.safetensors",
}


def test_each_malformed_manifest_field_is_named_with_its_line(world):
    from speccompat.cli import main as cli_main
    from speccompat.dataset import open_dataset, verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    lines = (out / "manifest.jsonl").read_text().splitlines()
    for k, (key, value) in enumerate(MANIFEST_DAMAGE.items(), start=1):
        e = json.loads(lines[k])
        e[key] = value
        lines[k] = json.dumps(e)
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    problems, n = verify_dataset(out)
    for k, key in enumerate(MANIFEST_DAMAGE, start=2):
        assert any(p.startswith(f"manifest.jsonl line {k}: ") and key.split("_")[0] in p for p in problems), (key, problems)
    assert n == 1 and cli_main(["verify", str(out)]) == 1
    with open_dataset(out, samples, provenance(model)) as ds:  # a resume redoes them
        assert len(ds.todo) == 7
    # a malformed header: verify says so (exit 2), a resume refuses naming the file and line
    write_header(out, lambda h: None)
    lines = (out / "manifest.jsonl").read_text().splitlines()
    h = json.loads(lines[0])
    h["provenance"]["hidden_states"]["layer_ids"] = "1,2"
    (out / "manifest.jsonl").write_text("\n".join([json.dumps(h), *lines[1:]]) + "\n")
    assert verify_dataset(out)[0][0].startswith("manifest.jsonl line 1 (the header): provenance.hidden_states")
    assert cli_main(["verify", str(out)]) == 2
    with pytest.raises(Rejected, match=r"manifest.jsonl line 1 \(the header\): provenance.hidden_states.layer_ids"):
        open_dataset(out, samples, provenance(model))


def test_output_dir_dot_has_a_token_frequency_path_beside_it(tmp_path, monkeypatch):
    from speccompat.dataset.speculators_format import default_token_freq_path

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert default_token_freq_path(Path(".")) == tmp_path / "work.token_freq.pt"
    assert default_token_freq_path(Path("sub/")) == work / "sub.token_freq.pt"


# ---------------------------------------------------------------------------------------------
# --overwrite
# ---------------------------------------------------------------------------------------------

def test_overwrite_with_a_limit_is_refused_and_deletes_nothing(world):
    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".safetensors"}
    with pytest.raises(Rejected, match=r"--overwrite would delete 6 finished sample\(s\)"):
        run(out, samples[:2], provenance(model), overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".safetensors"} == before
    assert len(manifest_entries(out)) == len(samples)


class Interrupt(Exception):
    pass


def test_an_interrupted_overwrite_never_leaves_old_and_new_files_side_by_side(world, monkeypatch):
    from speccompat.dataset import open_dataset, verify_dataset
    from speccompat.dataset.formats import read_safetensors

    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    other = model_dir(root / "other", rope_theta=5.0)
    new = provenance(other)

    def origins() -> set[str]:
        return {json.loads(read_safetensors(p)[0]["speccompat_provenance"])["model"]["path"]
                for p in out.glob("*.safetensors")}

    # interrupted while writing the new set: no old file is left beside the new ones
    ds = open_dataset(out, samples, new, overwrite=True)
    w = ds.writer(threads=1)
    w.submit([ds.job(s, states(s)) for s in ds.todo[:2]])
    w.close()
    ds.close()
    assert origins() == {str(other)}
    # interrupted while moving the old set aside: a plain run refuses, --overwrite finishes it
    run(out, samples, provenance(model), overwrite=True)
    from speccompat.dataset import directory as directory_mod

    calls = {"n": 0}
    real = os.replace

    def flaky(a, b):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupt()
        return real(a, b)

    monkeypatch.setattr(directory_mod.os, "replace", flaky)
    with pytest.raises(Interrupt):
        open_dataset(out, samples, new, overwrite=True)
    monkeypatch.setattr(directory_mod.os, "replace", real)
    assert origins() <= {str(model)}  # only old files (some of them) are visible
    assert not (out / "manifest.jsonl").exists()
    with pytest.raises(Rejected, match="--overwrite that was interrupted"):
        run(out, samples, new)
    _, stats = run(out, samples, new, overwrite=True)
    assert stats.files == len(samples) and origins() == {str(other)}
    assert verify_dataset(out) == ([], len(samples))


# ---------------------------------------------------------------------------------------------
# the writer's commit errors
# ---------------------------------------------------------------------------------------------

class Faulty(FileOps):
    """Fails the ``at``-th call of ``op`` with ``err``."""

    def __init__(self, op: str, at: int, err: int = errno.EIO) -> None:
        self.op, self.at, self.err, self.calls = op, at, err, 0

    def _maybe(self, op: str) -> None:
        if op == self.op:
            self.calls += 1
            if self.calls == self.at:
                raise OSError(self.err, os.strerror(self.err))

    def replace(self, a, b):
        self._maybe("replace")
        return os.replace(a, b)

    def fsync_dir(self, path):
        self._maybe("fsync_dir")
        return FileOps.fsync_dir(path)

    def write(self, fd, buf):
        if isinstance(buf, memoryview) and buf.nbytes and b"\"input_sha256\"" in bytes(buf[:2000]):
            self._maybe("manifest")
        return os.write(fd, buf)


def drain(w) -> None:
    """Wait until every submitted batch has been committed (or dropped)."""
    import time

    while w.batches:
        time.sleep(0.005)


@pytest.mark.parametrize(("op", "at"), [("replace", 3), ("fsync_dir", 2), ("manifest", 2)])
def test_a_commit_error_reaches_close_and_no_later_batch_commits(world, op, at):
    from speccompat.dataset import WriterFailed, open_dataset, verify_dataset

    root, model, _data, samples = world
    out = root / "out"
    ds = open_dataset(out, samples, provenance(model))
    w = ds.writer(threads=1, ops=Faulty(op, at))
    for k in range(0, len(ds.todo), 2):
        try:
            w.submit([ds.job(s, states(s)) for s in ds.todo[k:k + 2]])
        except WriterFailed:
            break
        drain(w)
    with pytest.raises(WriterFailed, match="Input/output error"):
        w.close()
    ds.close()
    listed = {e["file"] for e in manifest_entries(out)}
    present = {p.name for p in out.glob("*.safetensors")}
    assert listed <= present, "the manifest lists a file that was never renamed into place"
    assert len(listed) == (4 if op == "fsync_dir" else 2)  # batch 1 (and 2 when only its fsync failed)
    assert present == listed  # nothing of a later batch
    assert not list(out.glob("*.partial"))
    _, stats = run(out, samples, provenance(model))
    assert stats.files == len(samples) - len(listed)
    assert verify_dataset(out) == ([], len(samples))


# ---------------------------------------------------------------------------------------------
# sharding from the environment
# ---------------------------------------------------------------------------------------------

def test_the_environment_shards_only_when_asked(caplog):
    from speccompat.dataset.shards import ShardSpec, resolve_shard

    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "10", "RANK": "1", "WORLD_SIZE": "2"}
    with caplog.at_level(logging.WARNING):
        assert resolve_shard(None, None, env) == ShardSpec(1, 0, "default: one shard")
    assert "SLURM_ARRAY_TASK_ID=3" in caplog.text and "WORLD_SIZE=2" in caplog.text and "--num-shards auto" in caplog.text
    s = resolve_shard("auto", None, env)
    assert (s.num_shards, s.index) == (10, 3)
    s = resolve_shard("auto", None, {"RANK": "1", "WORLD_SIZE": "2"})
    assert (s.num_shards, s.index, s.source) == (2, 1, "RANK/WORLD_SIZE")
    with pytest.raises(Rejected, match="neither a SLURM job array"):
        resolve_shard("auto", None, {})
    with pytest.raises(Rejected, match="without --shard-index"):
        resolve_shard(4, None, env)
    with pytest.raises(Rejected, match="--shard-index without --num-shards"):
        resolve_shard(None, 1, env)


# ---------------------------------------------------------------------------------------------
# exit statuses of verify and merge
# ---------------------------------------------------------------------------------------------

def test_verify_and_merge_exit_statuses(world, monkeypatch):
    from speccompat.cli import main as cli_main
    from speccompat.dataset import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_REJECTED
    from speccompat.dataset import shards as shards_mod
    from speccompat.dataset import verify as verify_mod

    root, model, _data, samples = world
    out = root / "out"
    run(out, samples, provenance(model))
    assert cli_main(["verify", str(out)]) == EXIT_OK
    assert cli_main(["merge", str(out)]) == EXIT_OK
    assert cli_main(["verify", str(root / "missing")]) == EXIT_REJECTED
    assert cli_main(["merge", str(root / "missing")]) == EXIT_REJECTED

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_mod, "verify_dataset", interrupted)
    monkeypatch.setattr(shards_mod, "verify_dataset", interrupted, raising=False)
    assert cli_main(["verify", str(out)]) == EXIT_INTERRUPTED
    assert cli_main(["merge", str(out)]) == EXIT_INTERRUPTED
    monkeypatch.undo()
    next(out.glob("*.safetensors")).unlink()
    assert cli_main(["verify", str(out)]) == EXIT_FAILED
    assert cli_main(["merge", str(out)]) == EXIT_FAILED


def test_the_data_set_modules_import_no_circle():
    """store, verify and directory never import shards; directory imports neither store nor verify."""
    def imports(mod: str) -> set[str]:
        tree = ast.parse((REPO / "speccompat" / "dataset" / f"{mod}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}

    for mod in ("store", "verify", "directory", "manifest", "writer"):
        assert "shards" not in imports(mod), mod
    assert not {"store", "verify"} & imports("directory")
    assert "store" not in imports("verify")


@pytest.mark.parametrize(("options", "granularity"), [
    (("bfloat16", [0, 2, 4], 64, None), None),
    (("float32", [5], 8, "token"), None),  # --fp8-scale without fp8: the CLI refuses it; the spec has none
    (("fp8", [1, 3], 64, "token-layer"), "token-layer"),
    (("fp8", [1, 3], 64, None), "token"),  # the default granularity
])
def test_the_stored_spec_is_what_the_provenance_records(options, granularity):
    """A run's spec (its options), written into the provenance's record, reads back as itself."""
    from speccompat.dataset.provenance import hidden_states_record
    from speccompat.dataset.spec import DTYPES, StoredSpec

    dtype, layer_ids, hidden, scale = options
    spec = StoredSpec.of_options(dtype, layer_ids, hidden, scale)
    assert (spec.dtype, spec.layer_ids, spec.hidden_size, spec.granularity) == (dtype, tuple(layer_ids), hidden,
                                                                                  granularity)
    record = hidden_states_record(spec)
    assert record["dtype"] == dtype and record["layer_ids"] == layer_ids
    assert [r["vllm_aux_id"] for r in record["layers"]] == list(spec.serving_ids) == [i + 1 for i in layer_ids]
    assert ("fp8" in record) == (dtype == "fp8") and (record.get("fp8") or {}).get("scale") == granularity
    assert StoredSpec.of_provenance({"hidden_states": record, "model": {"hidden_size": hidden}}) == spec
    assert spec.safetensors_dtype == DTYPES[dtype][1]
    n = 7  # bytes of n tokens: every layer's states, plus fp8's float32 scales
    states = len(layer_ids) * n * hidden * DTYPES[dtype][0]
    assert states < spec.expected_bytes(n) - 4096 <= states + n * (16 + (4 * len(layer_ids) if granularity else 0))


@pytest.mark.parametrize(("args", "why"), [
    (("bf16", (1,), 8, None), "is not one of"),
    (("bfloat16", (1,), 8, "token"), "fp8 only"),
    (("fp8", (1,), 8, None), "fp8 only"),
    (("bfloat16", (), 8, None), "one or more"),
    (("bfloat16", (-1,), 8, None), "one or more"),
    (("bfloat16", (1,), 0, None), "positive"),
])
def test_the_stored_spec_refuses_what_no_set_stores(args, why):
    from speccompat.dataset.spec import StoredSpec

    with pytest.raises(ValueError, match=why):
        StoredSpec(*args)


def test_a_token_frequency_file_inside_the_output_directory_is_refused(tmp_path, monkeypatch, caplog):
    from speccompat.cli import main
    from speccompat.dataset import extract as ex

    model = model_dir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", random_records(3))
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "start_generator", lambda *a: pytest.fail("the engine must not start"))
    for inside in (out / "token_freq.pt", out / "sub" / "f.pt", out):
        caplog.clear()
        code = ex.main(["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                        "--format", "speculators", "--layer-ids", "1", "2", "4", "5", "--token-freq-path",
                        str(inside)])
        assert code == 2 and not out.exists(), inside
        assert "is inside the output directory" in caplog.text
    os.symlink(tmp_path, tmp_path / "via")  # the same place through a link
    out.mkdir()
    assert main(["merge", str(out), "--token-freq-path", str(tmp_path / "via" / "out" / "f.pt")]) == 2
    assert sorted(os.listdir(out)) == []
    beside = ex.ExtractConfig(model_path=str(model), prepared_data=data, output_dir=out, layout="speculators",
                              layer_ids=[1, 2, 4, 5], token_freq_path=tmp_path / "out.freq.pt")
    assert ex.check_settings(beside)[1] == [1, 2, 4, 5]  # beside the directory: accepted
