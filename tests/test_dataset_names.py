"""Sample ids as file names (speccompat.dataset.names): injective, reversible, safe on
case-insensitive file systems."""

from __future__ import annotations

from support.dataset_runs import HOSTILE

from speccompat.dataset import name_for_id
from speccompat.dataset.names import id_for_name


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
