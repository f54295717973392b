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


def test_a_file_being_written_has_the_temporary_name_the_leftover_sweep_knows(tmp_path):
    """names.tmp_name is what the writer, write_atomic and the shared header write to; the
    directory's sweep of an interrupted run's leftovers recognises exactly those names."""
    import os

    from speccompat.dataset.directory import _TMP_RE, DatasetDir
    from speccompat.dataset.names import TMP_SUFFIX, tmp_name

    assert tmp_name("a.safetensors", 42) == "a.safetensors.42" + TMP_SUFFIX
    assert tmp_name("a.safetensors") == f"a.safetensors.{os.getpid()}{TMP_SUFFIX}"
    assert _TMP_RE.match(tmp_name("a.safetensors", 42)).group(1) == "a.safetensors"
    ddir = DatasetDir(tmp_path)
    for name in (tmp_name("s1.safetensors", 7), tmp_name("manifest.header.json", 8), "keep.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    ddir.remove_leftovers()
    assert sorted(os.listdir(tmp_path)) == ["keep.safetensors"]
