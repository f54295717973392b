"""The model's identity comes from the weights' content: a copy of a checkpoint with one tensor
changed (same file names, same sizes) is another model for resume and merge."""

from __future__ import annotations

import shutil
import struct

import pytest
from dataset_fakes import model_dir, write_safetensors

from speccompat.dataset import provenance as prov_mod

BIG = 5 * 1024 + 3  # float32 elements: more than three sampled blocks of 4 KiB


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
    return prov_mod.collect(model_path=str(model), info=info, layer_ids=[1, 2], dtype="bfloat16", max_seq_len=64,
                            on_long_line="truncate", tensor_parallel_size=1, layout="safetensors",
                            status={"state": "armed"})


@pytest.mark.parametrize(("file", "tensor"), [
    ("model-00001-of-00002.safetensors", "a.weight"),  # large: only sampled blocks are read
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


def test_a_large_tensor_is_read_only_in_sampled_blocks(tmp_path):
    d = checkpoint(tmp_path)
    path = d / "model-00001-of-00002.safetensors"
    before = prov_mod.weights_identity([path])
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    # one element between the first and the middle block of a.weight: not in the identity
    pos = 8 + n + prov_mod.SAMPLE_BLOCK + 4
    raw[pos:pos + 4] = struct.pack("<f", 123.0)
    path.write_bytes(bytes(raw))
    assert prov_mod.weights_identity([path]) == before
    ranges = prov_mod._sample_ranges(0, BIG * 4)
    assert len(ranges) == 3 and sum(b - a for a, b in ranges) == 3 * prov_mod.SAMPLE_BLOCK
    assert ranges[0][0] == 0 and ranges[-1][1] == BIG * 4


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
