"""The worker-to-driver transport of packed hidden states (shared-memory file or inline)."""

from __future__ import annotations

import errno
import os

import pytest

torch = pytest.importorskip("torch", reason="the transport moves torch tensors")

from speccompat import transport  # noqa: E402


@pytest.mark.parametrize("tokens", [3, 5000])
def test_round_trip_is_exact_and_leaves_no_file(tokens):
    layers = [torch.randn(tokens, 256).to(torch.bfloat16) for _ in range(4)]
    desc = transport.pack(layers)
    assert ("file" in desc) == (tokens * 256 * 2 * 4 > transport.INLINE_LIMIT)
    out = transport.unpack(desc)
    assert out.shape == (4, tokens, 256) and out.dtype == torch.bfloat16
    for i, t in enumerate(layers):
        assert torch.equal(out[i], t)
    if "file" in desc:
        assert not os.path.exists(desc["file"])


def test_a_failed_pack_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(transport, "_SHM", str(tmp_path))
    monkeypatch.setattr(transport, "INLINE_LIMIT", 0)

    good = torch.ones(10, 8)
    bad = torch.ones(10, 8)
    with pytest.raises(RuntimeError):
        transport.pack([good, bad.view(8, 10)])  # shape mismatch while copying
    assert list(tmp_path.iterdir()) == []


def test_a_small_dev_shm_falls_back_to_inline(monkeypatch):
    monkeypatch.setattr(transport, "_shm_has_room", lambda nbytes: False)
    layers = [torch.ones(5000, 256) for _ in range(4)]
    desc = transport.pack(layers)
    assert "inline" in desc and torch.equal(transport.unpack(desc)[3], layers[3])


def test_staging_file_is_reused_until_it_must_grow(monkeypatch):
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        seen = []
        for tokens in (5000, 3000, 5000, 20000):  # 10 MB, 6 MB, 10 MB, 41 MB of bf16
            layers = [torch.randn(tokens, 256).to(torch.bfloat16) for _ in range(4)]
            desc, buf = staging.allocate((4, tokens, 256), torch.bfloat16, "cpu")
            for i, t in enumerate(layers):
                buf[i].copy_(t)
            staging.ready()
            assert "file" in desc
            out = transport.unpack(desc)
            assert not os.path.exists(desc["file"])  # removed by the driver's first mapping
            for i, t in enumerate(layers):
                assert torch.equal(out[i], t)
            seen.append((desc["staging"], desc["capacity"]))
        assert seen[0] == seen[1] == seen[2]  # same file, no new pages
        assert seen[3][0] != seen[0][0] and seen[3][1] >= 4 * 20000 * 256 * 2
        assert list(transport._MAPPED) == [os.getpid()]  # the old mapping was dropped
    finally:
        staging.release()


def test_staging_counts_the_files_a_reply_had_to_make(monkeypatch):
    """A pool shaped for one batch size meets a larger one while the caller still holds views of
    the last reply (as the example driver's writer does): each such reply makes a file, until the
    pool holds enough large ones; the counter says so, then reads 0."""
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        made, ids = [], []
        for tokens in (5000, 5000, 5000, 10000, 10000, 10000, 10000):
            desc, _ = staging.allocate((4, tokens, 256), torch.bfloat16, "cpu", busy=ids[-1:])
            ids.append(desc["staging"])
            count, seconds = staging.take_made()
            assert seconds >= 0.0 and (seconds > 0.0) == (count > 0)
            made.append(count)
        # 5000: one file, then a second (the first is busy), then the first again; 10000: two new
        # files (none large enough is free), then they alternate
        assert made == [1, 1, 0, 1, 1, 0, 0]
        assert ids[2] == ids[0] and ids[5] == ids[3] and ids[6] == ids[4]
        assert staging.take_made() == (0, 0.0)
    finally:
        staging.release()


def test_try_allocate_makes_a_file_on_a_thread_and_allocate_waits_for_it(monkeypatch):
    """try_allocate never waits: it starts making a file that fits on a thread and answers None
    until the file is there; allocate waits for a build that fits instead of making a second file."""
    import threading

    monkeypatch.setattr(transport, "_MAPPED", {})
    gate, real = threading.Event(), transport._Buffer
    monkeypatch.setattr(transport, "_Buffer", lambda capacity: (gate.wait(30), real(capacity))[1])
    staging = transport.Staging()
    try:
        shape = (4, 5000, 256)
        assert staging.try_allocate(shape, torch.bfloat16, "cpu") is None
        build = staging.build
        assert build is not None and build.capacity >= 4 * 5000 * 256 * 2
        assert staging.try_allocate(shape, torch.bfloat16, "cpu") is None and staging.build is build  # one build
        gate.set()
        build.join()
        desc, buf = staging.try_allocate(shape, torch.bfloat16, "cpu")
        assert desc["capacity"] == build.capacity and staging.build is None
        assert staging.take_made()[0] == 1
        # a larger reply: try_allocate starts a build, allocate waits for it rather than make another
        gate.clear()
        assert staging.try_allocate((4, 9000, 256), torch.bfloat16, "cpu", busy=[desc["staging"]]) is None
        threading.Timer(0.2, gate.set).start()
        desc2, buf2 = staging.allocate((4, 9000, 256), torch.bfloat16, "cpu", busy=[desc["staging"]])
        made, waited = staging.take_made()
        assert made == 1 and waited >= 0.15 and desc2["capacity"] >= 4 * 9000 * 256 * 2
        assert desc2["staging"] != desc["staging"] and len(staging.buffers) == 2  # the busy file stays
        buf2.fill_(3)
        assert torch.equal(transport.unpack(desc2), torch.full((4, 9000, 256), 3, dtype=torch.bfloat16))
    finally:
        staging.release()


def test_a_build_that_finds_no_room_sends_the_reply_inline(monkeypatch):
    def full(capacity):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transport, "_Buffer", full)
    staging = transport.Staging()
    assert staging.try_allocate((4, 5000, 256), torch.bfloat16, "cpu") is None
    staging.build.join()
    desc, buf = staging.try_allocate((4, 5000, 256), torch.bfloat16, "cpu")
    assert "inline" in desc and buf.shape == (4, 5000, 256) and staging.buffers == []


def test_staging_view_is_overwritten_by_the_next_reply(monkeypatch):
    """Why the generator copies each sequence out before returning."""
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        desc, buf = staging.allocate((4, 5000, 256), torch.float32, "cpu")
        buf.fill_(1.0)
        first = transport.unpack(desc)
        kept = first[0].clone()
        desc, buf = staging.allocate((4, 5000, 256), torch.float32, "cpu")
        buf.fill_(2.0)
        transport.unpack(desc)
        assert float(first[0, 0, 0]) == 2.0 and float(kept[0, 0]) == 1.0
    finally:
        staging.release()


def test_staging_release_removes_an_unmapped_file_and_discard_keeps_it(monkeypatch, tmp_path):
    monkeypatch.setattr(transport, "_SHM", str(tmp_path))
    staging = transport.Staging()
    desc, _ = staging.allocate((4, 5000, 256), torch.float32, "cpu")
    transport.discard(desc)  # an error while filling: the staging file stays for the next reply
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(desc["file"])]
    staging.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_out_gives_each_sequence_and_layer_its_own_memory(monkeypatch, threads):
    from speccompat import generator
    from speccompat.generator import copy_out

    calls = []
    monkeypatch.setattr(generator, "copy_threads", lambda parts: calls.append(len(parts)) or threads)
    states = torch.randn(4, 1000, 64)
    lengths = [100, 1, 899]
    hidden = copy_out(torch.split(states, lengths, dim=1))
    assert [len(h) for h in hidden] == [4, 4, 4]
    ptrs = {t.untyped_storage().data_ptr() for h in hidden for t in h}
    assert len(ptrs) == 12
    lo, hi = states.data_ptr(), states.data_ptr() + states.numel() * 4
    assert not any(lo <= p < hi for p in ptrs)
    off = 0
    for h, n in zip(hidden, lengths, strict=True):
        for layer, t in enumerate(h):
            assert t.shape == (n, 64) and torch.equal(t, states[layer, off:off + n])
        off += n
    assert calls == [3]  # one decision per call, in input order after the split over threads


def test_copy_threads_only_where_torch_runs_single_threaded(monkeypatch):
    from speccompat import generator

    big = list(torch.empty(4, 32 << 20, dtype=torch.uint8).split([2 << 20] * 16, dim=1))  # 128 MiB, untouched
    small = list(torch.empty(4, 1 << 20, dtype=torch.uint8).split([1 << 16] * 16, dim=1))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert generator.copy_threads(big) == 1  # torch spreads each copy itself
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as vLLM leaves the driver on GPU hosts
    assert generator.copy_threads(big) == 8
    assert generator.copy_threads(small) == 1  # 4 MiB: not worth a pool
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert generator.copy_threads(big) == 1  # no cores to spare


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning the staging file needs a CUDA device")
def test_staging_from_a_gpu_is_pinned_and_exact(monkeypatch):
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        for seed in (0, 1):  # the second reply reuses the pinned file
            torch.manual_seed(seed)
            src = torch.randn(4, 20000, 1024, device="cuda").to(torch.bfloat16)
            desc, buf = staging.allocate(tuple(src.shape), src.dtype, src.device)
            for i in range(4):
                buf[i].copy_(src[i], non_blocking=True)
            staging.ready()
            assert staging.pinned is True
            assert torch.equal(transport.unpack(desc), src.cpu())
    finally:
        staging.release()


def test_staging_falls_back_to_inline_when_dev_shm_lacks_room(monkeypatch):
    monkeypatch.setattr(transport, "_shm_has_room", lambda nbytes: False)
    staging = transport.Staging()
    layers = torch.randn(4, 5000, 256)
    desc, buf = staging.allocate(tuple(layers.shape), layers.dtype, "cpu")
    buf.copy_(layers)
    staging.ready()
    assert "inline" in desc and staging.path is None
    assert torch.equal(transport.unpack(desc), layers)


def test_a_staging_file_with_live_views_is_not_overwritten(monkeypatch):
    """copy=False hands out views: the worker fills another file while they live, and reuses the
    first (no new pages) once they are gone."""
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        desc, buf = staging.allocate((4, 5000, 256), torch.float32, "cpu", busy=transport.busy())
        buf.fill_(1.0)
        kept = transport.unpack(desc)[2, 10:20]  # a view, as generate(copy=False) returns
        assert transport.busy() == [desc["staging"]]
        second, buf = staging.allocate((4, 5000, 256), torch.float32, "cpu", busy=transport.busy())
        buf.fill_(2.0)
        again = transport.unpack(second)
        assert second["staging"] != desc["staging"] and len(second["pool"]) == 2
        assert float(kept.min()) == float(kept.max()) == 1.0 and float(again[0, 0, 0]) == 2.0
        del kept
        del again
        assert transport.busy() == []
        third, buf = staging.allocate((4, 4000, 256), torch.float32, "cpu", busy=transport.busy())
        assert third["staging"] in (desc["staging"], second["staging"]) and len(third["pool"]) == 2
    finally:
        staging.release()


def test_a_free_file_too_small_is_replaced_not_kept(monkeypatch):
    monkeypatch.setattr(transport, "_MAPPED", {})
    staging = transport.Staging()
    try:
        small, _ = staging.allocate((4, 3000, 256), torch.float32, "cpu")
        transport.unpack(small)
        big, buf = staging.allocate((4, 30000, 256), torch.float32, "cpu", busy=transport.busy())
        assert big["pool"] == [big["staging"]] and big["capacity"] >= 4 * 30000 * 256 * 4
        buf.fill_(3.0)
        out = transport.unpack(big)
        assert list(transport._MAPPED[os.getpid()]) == [big["staging"]]  # the replaced mapping was dropped
        assert float(out[3, -1, -1]) == 3.0
    finally:
        staging.release()


@pytest.mark.parametrize("kind", ["reply", "staging"])
def test_shared_memory_files_are_reserved_not_sparse(monkeypatch, tmp_path, kind):
    """Two engines on a host could both pass the free-space check with sparse files and then die of
    SIGBUS writing into a full /dev/shm: the pages are reserved when the file is made."""
    monkeypatch.setattr(transport, "_SHM", str(tmp_path))
    monkeypatch.setattr(transport, "_shm_has_room", lambda nbytes: True)
    shape = (4, 5000, 256)  # 10 MB of bf16
    if kind == "reply":
        desc, _ = transport.allocate(shape, torch.bfloat16)
    else:
        staging = transport.Staging()
        desc, _ = staging.allocate(shape, torch.bfloat16, "cpu")
    st = os.stat(desc["file"])
    assert st.st_blocks * 512 >= 4 * 5000 * 256 * 2
    if kind == "staging":
        staging.release()
    else:
        transport.discard(desc)


def test_a_dev_shm_that_fills_up_after_the_check_replies_inline(monkeypatch, tmp_path):
    monkeypatch.setattr(transport, "_SHM", str(tmp_path))
    monkeypatch.setattr(transport, "_shm_has_room", lambda nbytes: True)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transport.os, "posix_fallocate", full)
    layers = [torch.ones(5000, 256) for _ in range(4)]
    desc = transport.pack(layers)
    assert "inline" in desc and torch.equal(transport.unpack(desc)[2], layers[2])
    staging = transport.Staging()
    desc, buf = staging.allocate((4, 5000, 256), torch.float32, "cpu")
    assert "inline" in desc and buf.shape == (4, 5000, 256)
    assert list(tmp_path.iterdir()) == []
