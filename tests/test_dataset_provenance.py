"""The model's identity comes from the weights' whole content: a copy of a checkpoint with one
tensor, some rows or one byte changed (same file names, same sizes) is another model for resume and
merge; the digests are cached per file, outside the checkpoint."""

from __future__ import annotations

import shutil
import struct

import pytest
from support.dataset_fakes import model_dir, write_safetensors

from speccompat.dataset import provenance as prov_mod
from speccompat.dataset.spec import StoredSpec

BIG = 5 * 1024 + 3  # float32 elements


def checkpoint(root):
    d = model_dir(root)
    write_safetensors(d / "model-00001-of-00002.safetensors",
                      {"a.weight": [float(i % 7) - 3 for i in range(BIG)], "b.bias": [0.25, -1.0, 2.0]})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"c.weight": [0.0, 1.5, -2.5] * 11})
    return d


def negate(path, name):
    """Flip the sign of every element of tensor ``name`` in place (file size unchanged)."""
    import json

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    lo, hi = 8 + n + begin, 8 + n + end
    values = struct.unpack(f"<{(hi - lo) // 4}f", raw[lo:hi])
    raw[lo:hi] = struct.pack(f"<{len(values)}f", *(-v for v in values))
    path.write_bytes(bytes(raw))


def provenance(model):
    info = prov_mod.read_model_info(str(model))
    spec = StoredSpec.of_options("bfloat16", [1, 2], info.hidden_size)
    return prov_mod.collect(model_path=str(model), info=info, spec=spec, max_seq_len=64,
                            on_long_line="truncate", tensor_parallel_size=1, layout="safetensors",
                            status={"state": "armed"})


@pytest.mark.parametrize(("file", "tensor"), [
    ("model-00001-of-00002.safetensors", "a.weight"),  # large
    ("model-00001-of-00002.safetensors", "b.bias"),  # small, after a large one
    ("model-00002-of-00002.safetensors", "c.weight"),  # contains zeros: -0.0 differs from 0.0 in bits
    ("model.safetensors", "norm.weight"),
])
def test_a_copy_with_one_tensor_negated_is_another_model(tmp_path, file, tensor):
    original = checkpoint(tmp_path / "a")
    copy = tmp_path / "b" / "model"
    shutil.copytree(original, copy)
    sizes = {p.name: p.stat().st_size for p in copy.iterdir()}
    same = provenance(copy)
    assert prov_mod.differences(provenance(original), same) == []  # only the path differs: informational
    negate(copy / file, tensor)
    assert {p.name: p.stat().st_size for p in copy.iterdir()} == sizes
    stored, current = provenance(original), provenance(copy)
    diffs = prov_mod.differences(stored, current)
    # what a resume reports and refuses on, and what a merge compares (the digest)
    assert [d.split(":")[0] for d in diffs] == ["model.weights.content_sha256"]
    assert prov_mod.digest(stored) != prov_mod.digest(current)


def flip_rows(path, name, rows, width):
    """Negate rows ``rows`` of the 2-D float32 tensor ``name`` (``width`` columns) in place."""
    import json

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    for r in rows:
        lo = 8 + n + begin + r * width * 4
        values = struct.unpack(f"<{width}f", raw[lo:lo + width * 4])
        raw[lo:lo + width * 4] = struct.pack(f"<{width}f", *(-v for v in values))
    path.write_bytes(bytes(raw))


def embed_checkpoint(root, rows=1000, width=64):
    d = model_dir(root)
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": [((i * 7919) % 1000) / 500 - 1
                                                                            for i in range(rows * width)],
                                                "norm.weight": [1.0] * 8})
    return d


def test_ten_flipped_embedding_rows_and_one_interior_byte_change_the_identity(tmp_path):
    """Adding special tokens flips rows of embed_tokens (same shapes, same sizes): rows 100-109 lie
    between the blocks a sampled identity read; one byte in the middle of a tensor likewise."""
    original = embed_checkpoint(tmp_path / "a")
    base = prov_mod.model_identity(str(original))["weights"]
    assert base["method"] == prov_mod.IDENTITY_METHOD
    flipped = tmp_path / "b" / "model"
    shutil.copytree(original, flipped)
    flip_rows(flipped / "model.safetensors", "model.embed_tokens.weight", range(100, 110), 64)
    assert (flipped / "model.safetensors").stat().st_size == (original / "model.safetensors").stat().st_size
    assert prov_mod.model_identity(str(flipped))["weights"]["content_sha256"] != base["content_sha256"]
    edited = tmp_path / "c" / "model"
    shutil.copytree(original, edited)
    raw = bytearray((edited / "model.safetensors").read_bytes())
    raw[len(raw) // 2 + 1] ^= 0x01
    (edited / "model.safetensors").write_bytes(bytes(raw))
    assert prov_mod.model_identity(str(edited))["weights"]["content_sha256"] != base["content_sha256"]
    again = tmp_path / "d" / "model"
    shutil.copytree(original, again)  # a copy: other inodes, the same content, the same identity
    assert prov_mod.model_identity(str(again))["weights"] == base


def reads(monkeypatch):
    """Counts the segments contenthash reads (byte ranges of files)."""
    from speccompat.dataset import contenthash

    seen = []
    real = contenthash._segment

    def spy(path, start, end, buffers):
        seen.append((path, start, end))
        return real(path, start, end, buffers)

    monkeypatch.setattr(contenthash, "_segment", spy)
    return seen


def test_digests_are_cached_per_file_and_an_edit_is_read_again(tmp_path, monkeypatch):
    from speccompat.dataset import contenthash

    monkeypatch.setenv("SPECCOMPAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(contenthash, "SEGMENT", 4096)  # several segments per file, hashed in parallel
    d = embed_checkpoint(tmp_path / "a")
    seen = reads(monkeypatch)
    first = prov_mod.model_identity(str(d))["weights"]
    size = (d / "model.safetensors").stat().st_size
    assert sum(b - a for _p, a, b in seen) == size and len(seen) == -(-size // 4096)  # every byte, once
    seen.clear()
    assert prov_mod.model_identity(str(d))["weights"] == first and seen == []  # a resume reads nothing
    assert len(list((tmp_path / "cache" / "file-digests").iterdir())) == 1
    # one byte changed in place, same size: a new mtime/ctime, read again, another identity
    path = d / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[size // 2] ^= 0x80
    path.write_bytes(bytes(raw))
    after = prov_mod.model_identity(str(d))["weights"]
    assert sum(b - a for _p, a, b in seen) == size and after["content_sha256"] != first["content_sha256"]
    # the same digest whatever the number of threads and without the cache
    monkeypatch.setenv("SPECCOMPAT_CACHE_DIR", "")
    assert prov_mod.weights_identity([path], threads=1) == prov_mod.weights_identity([path], threads=5) == after


def test_a_read_only_checkpoint_is_identified_and_nothing_is_written_beside_it(tmp_path, monkeypatch):
    import os
    import stat

    monkeypatch.setenv("SPECCOMPAT_CACHE_DIR", str(tmp_path / "cache"))
    d = embed_checkpoint(tmp_path / "a")
    listing = sorted(os.listdir(d))
    os.chmod(d, stat.S_IRUSR | stat.S_IXUSR)
    try:
        a = prov_mod.model_identity(str(d))["weights"]
        assert prov_mod.model_identity(str(d))["weights"] == a
    finally:
        os.chmod(d, stat.S_IRWXU)
    assert sorted(os.listdir(d)) == listing
    # a cache directory that cannot be written: identified all the same, uncached
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPECCOMPAT_CACHE_DIR", str(blocked))
    assert prov_mod.model_identity(str(d))["weights"] == a


def test_other_weight_formats_are_hashed_in_full_and_a_broken_header_is_named(tmp_path):
    d = checkpoint(tmp_path)
    (d / "pytorch_model.bin").write_bytes(b"x" * 10_000)
    before = prov_mod.model_identity(str(d))["weights"]
    (d / "pytorch_model.bin").write_bytes(b"x" * 5_000 + b"y" + b"x" * 4_999)
    after = prov_mod.model_identity(str(d))["weights"]
    assert before["files"] == after["files"] == 4 and before["content_sha256"] != after["content_sha256"]
    (d / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"{not json}")
    from speccompat.dataset.errors import Rejected

    with pytest.raises(Rejected, match="model.safetensors: safetensors header is not JSON"):
        prov_mod.model_identity(str(d))


def test_a_resume_after_a_one_byte_edit_of_the_weights_is_refused(tmp_path):
    pytest.importorskip("torch", reason="the data set's writer")
    from support.dataset_fakes import jsonl, random_records
    from support.dataset_runs import provenance as run_provenance
    from support.dataset_runs import run, scan

    from speccompat.dataset import Rejected, open_dataset

    model = embed_checkpoint(tmp_path)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(6)))
    out = tmp_path / "out"
    run(out, samples, run_provenance(model))
    ds = open_dataset(out, samples, run_provenance(model))  # unchanged: every sample done
    ds.close()
    assert ds.todo == [] and ds.done == 6
    path = model / "model.safetensors"
    raw = bytearray(path.read_bytes())
    head = 8 + int.from_bytes(raw[:8], "little")
    raw[head + 100 * 64 * 4 + 3] ^= 0x04  # row 100 of embed_tokens: far from its first, middle and last 4 KiB
    path.write_bytes(bytes(raw))
    manifest = (out / "manifest.jsonl").read_bytes()
    with pytest.raises(Rejected, match=r"model\.weights\.content_sha256: \"[0-9a-f]{64}\" -> \"[0-9a-f]{64}\""):
        open_dataset(out, samples, run_provenance(model))
    assert (out / "manifest.jsonl").read_bytes() == manifest


def test_shards_made_with_models_ten_embedding_rows_apart_are_refused_by_the_shard_and_by_merge(tmp_path, capsys):
    pytest.importorskip("torch", reason="the data set's writer")
    from support.dataset_fakes import jsonl, random_records
    from support.dataset_runs import provenance as run_provenance
    from support.dataset_runs import scan
    from support.shard_runs import run_shard

    from speccompat.cli import main
    from speccompat.dataset import Rejected
    from speccompat.dataset.shards import part_name

    a = embed_checkpoint(tmp_path / "a")
    b = tmp_path / "b" / "model"
    shutil.copytree(a, b)
    flip_rows(b / "model.safetensors", "model.embed_tokens.weight", range(100, 110), 64)
    samples = scan(jsonl(tmp_path / "d.jsonl", random_records(12)))
    out, other = tmp_path / "out", tmp_path / "other"
    run_shard(out, samples, run_provenance(a), 0, 2)
    with pytest.raises(Rejected, match=r"model\.weights\.content_sha256"):
        run_shard(out, samples, run_provenance(b), 1, 2)  # the same directory: refused before it runs
    # shard 1 made elsewhere with the other model, its part and files brought in
    ds = run_shard(other, samples, run_provenance(b), 1, 2)
    for f in [part_name(1, 2), *ds.files.values()]:
        shutil.copy2(other / f, out / f)
    before = sorted(p.name for p in out.iterdir())
    assert main(["merge", str(out)]) == 2
    printed = capsys.readouterr()
    assert f"{part_name(1, 2)}: provenance differs from the data set's: model.weights.content_sha256" in printed.out
    assert sorted(p.name for p in out.iterdir()) == before and not (out / "manifest.jsonl").exists()
