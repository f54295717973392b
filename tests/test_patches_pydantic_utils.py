"""speccompat.patches.pydantic_utils: the patches of speculators.utils.pydantic_utils."""

from __future__ import annotations

import types

import pytest

from speccompat.patches import PYDANTIC_MODULE
from speccompat.patches.pydantic_utils import PYDANTIC


def test_every_patch_targets_pydantic_utils():
    assert [p.id for p in PYDANTIC] == ["pydantic.reload_schema"]
    assert all(p.target.startswith(f"{PYDANTIC_MODULE}:") for p in PYDANTIC)


def test_reload_schema_rebuilds_with_torch_in_the_types_namespace():
    torch = pytest.importorskip("torch", reason="the schema names torch types")
    calls = []

    class Model:
        @classmethod
        def model_rebuild(cls, **kwargs):
            calls.append((cls, kwargs))

    Model.reload_schema = PYDANTIC[0].build(types.SimpleNamespace(adapter=None), None)
    Model.reload_schema()
    assert calls == [(Model, {"force": True, "_types_namespace": {"torch": torch}})]
