"""speccompat.patches.custom_worker: the worker extension's capture, replaced by speccompat.capture."""

from __future__ import annotations

import types

import pytest

from speccompat import capture, patching
from speccompat.errors import SpeccompatError
from speccompat.patches import EXT_CLASS
from speccompat.patches.custom_worker import WORKER


def test_every_patch_targets_the_worker_extension():
    assert [p.id for p in WORKER] == ["worker._setup_hidden_states_capture", "worker._reset_capture",
                                      "worker._get_captured_states", "worker._speccompat_info"]
    assert all(p.target.startswith(f"{EXT_CLASS}.") for p in WORKER)
    assert [p.adds for p in WORKER] == [False, False, False, True]


def test_the_replacements_are_capture_functions_and_refuse_to_run_after_revert(monkeypatch):
    ctx = types.SimpleNamespace(adapter=None)

    def original(self, *a):
        raise AssertionError("the original must not run")

    impls = [capture.setup_hidden_states_capture, capture.reset_capture, capture.get_captured_states]
    built = [p.build(ctx, original) for p in WORKER[:3]]
    assert [b.__speccompat_impl__ for b in built] == impls
    assert all(b.__wrapped__ is original for b in built)
    assert WORKER[3].build(ctx, None) is capture.worker_info
    # The real implementation runs: a worker without a capture is told to set one up first.
    with pytest.raises(RuntimeError, match="Must call _setup_hidden_states_capture before capturing states"):
        built[1](types.SimpleNamespace())
    monkeypatch.setattr(patching, "_generation", patching.generation() + 1)
    with pytest.raises(SpeccompatError, match="speccompat was reverted"):
        built[1](types.SimpleNamespace())
