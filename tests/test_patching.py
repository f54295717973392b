"""Patch records: exact revert, all-or-nothing groups, idempotency, thread safety."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from speccompat import patching
from speccompat.errors import PatchError
from speccompat.patching import MISSING, Patch


@pytest.fixture
def target():
    mod = types.ModuleType("sc_fake_target")

    class Thing:
        def method(self):
            return "original"

        @classmethod
        def cm(cls):
            return "original cm"

        @staticmethod
        def sm():
            return "original sm"

    class Child(Thing):
        pass

    mod.Thing, mod.Child, mod.name = Thing, Child, "original name"
    sys.modules[mod.__name__] = mod
    yield mod
    patching.revert_all()
    del sys.modules[mod.__name__]


def P(pid, target, build, **kw):
    return Patch(id=pid, target=target, why="w", how="h", vllm_change="c", remove_when="r", build=build, **kw)


def snapshot(mod):
    return {"mod": dict(vars(mod)), "Thing": dict(vars(mod.Thing)), "Child": dict(vars(mod.Child))}


def test_revert_restores_every_original_object_exactly(target):
    before = snapshot(target)
    group = [
        P("a", "sc_fake_target:name", lambda ctx, o: "patched"),
        P("b", "sc_fake_target:Thing.method", lambda ctx, o: lambda self: "patched"),
        P("c", "sc_fake_target:Thing.cm", lambda ctx, o: classmethod(lambda cls: "patched cm")),
        P("d", "sc_fake_target:Thing.sm", lambda ctx, o: staticmethod(lambda: "patched sm")),
        P("e", "sc_fake_target:Child.method", lambda ctx, o: lambda self: "child patched"),  # inherited
        P("f", "sc_fake_target:Thing.added", lambda ctx, o: lambda self: "new", adds=True),
    ]
    outcomes = patching.apply_group(group, None)
    assert [o.state for o in outcomes] == ["applied"] * 6
    assert target.name == "patched" and target.Thing().method() == "patched"
    assert target.Thing.cm() == "patched cm" and target.Thing.sm() == "patched sm"
    assert target.Child().method() == "child patched" and target.Thing().added() == "new"
    assert patching.patch_marker(target.Thing.__dict__["method"]) == "b"
    assert sorted(patching.revert_all()) == sorted("abcdef")
    after = snapshot(target)
    for key in before:
        assert after[key].keys() == before[key].keys(), key
        for name, obj in before[key].items():
            assert after[key][name] is obj, f"{key}.{name} not restored"
    # Child had no own `method`: revert must delete it, not copy Thing's into Child.
    assert "method" not in vars(target.Child)
    assert not hasattr(target.Thing, "added")


def test_group_is_all_or_nothing(target):
    before = snapshot(target)

    def boom(ctx, original):
        raise RuntimeError("cannot build")

    group = [
        P("ok", "sc_fake_target:name", lambda ctx, o: "patched"),
        P("bad", "sc_fake_target:Thing.method", boom),
    ]
    with pytest.raises(PatchError, match="bad .*could not be built: cannot build"):
        patching.apply_group(group, None)
    assert snapshot(target) == before
    assert patching.applied_ids() == []


def test_missing_target_fails_unless_optional(target):
    with pytest.raises(PatchError, match="sc_fake_target:nope does not exist"):
        patching.apply_group([P("x", "sc_fake_target:nope", lambda ctx, o: 1)], None)
    out = patching.apply_group([P("y", "sc_fake_target:nope", lambda ctx, o: 1, optional=True)], None)
    assert out[0].state == "skipped" and "does not exist" in out[0].reason
    assert not hasattr(target, "nope")


def test_not_needed_is_skipped_with_reason(target):
    out = patching.apply_group([P("n", "sc_fake_target:name", lambda ctx, o: 1, needed=lambda ctx: "not here")], None)
    assert (out[0].state, out[0].reason) == ("skipped", "not here")
    assert target.name == "original name"


def test_applying_twice_is_idempotent(target):
    group = [P("a", "sc_fake_target:Thing.method", lambda ctx, o: lambda self: ("wrapped", o(self)))]
    patching.apply_group(group, None)
    second = patching.apply_group(group, None)
    assert second[0].reason == "already applied"
    assert target.Thing().method() == ("wrapped", "original")  # wrapped once, not twice


def test_adding_refuses_to_overwrite(target):
    with pytest.raises(PatchError, match="already exists"):
        patching.apply_group([P("a", "sc_fake_target:Thing.method", lambda ctx, o: 1, adds=True)], None)


def test_threads_apply_each_patch_once(target):
    calls = []

    def build(ctx, original):
        calls.append(1)
        return lambda self: "patched"

    group = [P("t", "sc_fake_target:Thing.method", build)]
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        patching.apply_group(group, None)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert patching.applied_ids() == ["t"]
    patching.revert_all()
    assert target.Thing().method() == "original"
    assert vars(target.Thing).get("method") is not MISSING
