"""Scale-out of the example driver on the real CPU engine (tiny Llama): several engines, shards,
a killed shard, a re-shard, an engine that dies, Ray actors; each compared with one uninterrupted
single-engine run.

The gate runs one chain on one output folder (7 engine starts, 30-150 s each on the 2-core
machine): the reference run (1); shard 0 of 2 killed with SIGKILL and resumed (2); the rest re-sharded
over 3 engines side by side, one of which dies mid-run and is reported (3); the re-run, which retries
only the dead engine's samples (1). The separate scenarios (two engines side by side, the killed
shard and a re-shard, two Ray actors, an engine that dies: 12 more starts) are engine_full."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_env import ENGINE_ENV

from .crash_hook import crash_env, crashed_after

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "examples" / "kimi_k25" / "extract_hidden_states.py"
LAYER_IDS = [0, 2, 4, 5]
MAX_SEQ_LEN = 256
SAMPLES = 30
TIMEOUT = 900
IDS = [f"conv-{k:04d}" for k in range(SAMPLES)]
EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: one provenance date, so that data sets compare byte for byte


def _env(crash: dict | None = None) -> dict[str, str]:
    """The driver's environment; ``crash``: the crash hook's arguments (``crash_hook.crash_env``)."""
    env = {**os.environ, **ENGINE_ENV.get("engine_env", {}), "PYTHONPATH": ENGINE_ENV["speculators"]["0.4.0.1"],
           "SOURCE_DATE_EPOCH": EPOCH}
    return crash_env(env, **crash) if crash else env


def driver_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(DRIVER), "--model-path", str(model), "--prepared-data", str(data),
            "--output-dir", str(out), "--layer-ids", *map(str, LAYER_IDS), "--max-seq-len", str(MAX_SEQ_LEN),
            "--batch-size", "1", "--tp-size", "1", "--gpu-memory-utilization", "0.1", *extra]


def run_driver(model: Path, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(driver_args(model, data, out, *extra), capture_output=True, text=True, env=_env(),
                          timeout=TIMEOUT, cwd=REPO)
    n = len(list(data.parent.glob("driver-*.log")))
    (data.parent / f"driver-{n}.log").write_text(f"{proc.args}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def entries(out: Path) -> tuple[str, dict[str, dict]]:
    lines = (out / "manifest.jsonl").read_text().splitlines()
    return lines[0], {e["id"]: e for e in map(json.loads, lines[1:])}


def part_ids(out: Path) -> set[str]:
    """Ids of the entries of every manifest part whose file is in place."""
    ids = set()
    for p in out.glob("manifest.shard-*.jsonl"):
        for line in p.read_text().splitlines()[1:]:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if (out / e["file"]).exists():
                ids.add(e["id"])
    return ids


def stamps(out: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.safetensors")}


def same_as_reference(out: Path, ref: Path) -> int:
    """Assert ``out`` holds the reference's samples, shapes, provenance and (within bf16 batch noise)
    values; return how many files are byte-identical."""
    import torch
    from safetensors import safe_open

    head, got = entries(out)
    ref_head, want = entries(ref)
    h, r = json.loads(head), json.loads(ref_head)
    assert h["provenance"] == r["provenance"]
    # the header's record of the command names the run's own output directory; a merged set's names
    # the job's command and the shards it was merged from
    def facts(run: dict) -> dict:
        return {k: v for k, v in run.items() if k not in ("command", "merged_from")}

    assert {**h, "run": facts(h["run"])} == {**r, "run": facts(r["run"])}
    if "merged_from" in h["run"]:
        assert h["run"]["merged_from"]["shards"] >= 2 and "--shard-index" not in h["run"]["command"]
    assert sorted(got) == sorted(want)
    identical = 0
    for i, e in want.items():
        g = got[i]
        assert (g["file"], g["input_sha256"], g["num_tokens"]) == (e["file"], e["input_sha256"], e["num_tokens"])
        assert {k: (v["dtype"], v["shape"]) for k, v in g["tensors"].items()} == \
            {k: (v["dtype"], v["shape"]) for k, v in e["tensors"].items()}
        with safe_open(str(out / g["file"]), "pt") as fa, safe_open(str(ref / e["file"]), "pt") as fb:
            assert fa.metadata() == fb.metadata()
            for k in fb.keys():
                a, b = fa.get_tensor(k), fb.get_tensor(k)
                if k.startswith("hidden_states_"):
                    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=2e-2, msg=f"{i} {k}")
                else:
                    assert torch.equal(a, b), (i, k)
        identical += (out / g["file"]).read_bytes() == (ref / e["file"]).read_bytes()
    return identical


def verify(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speccompat", "verify", str(out), *extra], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


class World:
    def __init__(self, root: Path, model: Path) -> None:
        import random

        self.root, self.model = root, model
        rng = random.Random(11)
        lines = []
        for k in range(SAMPLES):
            n = rng.randrange(150, MAX_SEQ_LEN + 40)  # some are truncated
            lines.append(json.dumps({"id": IDS[k], "input_ids": [rng.randrange(4, 512) for _ in range(n)]}))
        self.data = root / "data.jsonl"
        self.data.write_text("\n".join(lines) + "\n")
        self.ref = root / "reference"
        proc = run_driver(model, self.data, self.ref)
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def world(engines, tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("scale-out")
    return World(root, engines.checkpoint("llama"))


def kill_shard_zero_of_two_then_resume(world, out: Path) -> set[str]:
    """Shard 0 of 2, killed (SIGKILL, its whole process group: driver and engine) once 3 samples are
    committed, then the same shard again: it resumes, skipping what it finished. Returns shard 0's ids."""
    crash = {"after": 3, "argv": "--num-shards 2 --shard-index 0", "group": True}
    proc = subprocess.run(driver_args(world.model, world.data, out, "--num-shards", "2", "--shard-index", "0"),
                          capture_output=True, text=True, env=_env(crash), cwd=REPO, timeout=TIMEOUT,
                          start_new_session=True)
    (world.root / "killed.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    from speccompat.dataset.shards import shard_of

    shard0 = {i for i in IDS if shard_of(i, 2) == 0}
    first = part_ids(out)
    assert len(first) == crashed_after(proc.stderr) and 3 <= len(first) < len(shard0), first
    before = stamps(out)

    proc = run_driver(world.model, world.data, out, "--num-shards", "2", "--shard-index", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"shard 0 of 2: {len(shard0)} of the input's {SAMPLES} samples; {len(first)} already done" in proc.stderr
    assert f"summary: {len(shard0) - len(first)} written, {len(first)} already done" in proc.stderr
    assert part_ids(out) == shard0
    after = stamps(out)
    assert all(after[name] == st for name, st in before.items())
    return shard0


def verified_like_reference(out: Path, world) -> int:
    """``speccompat verify`` passes on ``out`` and it holds the single-engine run's data set; returns
    how many files are byte-identical to that run's."""
    v = verify(out)
    assert v.returncode == 0, v.stdout + v.stderr
    identical = same_as_reference(out, world.ref)
    print(f"{identical} of {SAMPLES} files byte-identical to the single-engine run")
    return identical


def kill_an_engine_mid_run(world, out: Path, engines: int, victim: int, log_path: Path) -> str:
    """``--data-parallel-size engines``; engine ``victim``'s driver process kills itself (SIGKILL) once
    it committed a sample. The run must report it, not merge, and keep what is finished; returns the log."""
    crash = {"after": 1, "argv": f"--num-shards {engines} --shard-index {victim}"}
    proc = subprocess.run(driver_args(world.model, world.data, out, "--data-parallel-size", str(engines)),
                          capture_output=True, text=True, env=_env(crash), cwd=REPO, timeout=TIMEOUT)
    text = proc.stdout + proc.stderr
    log_path.write_text(text)
    crashed_after(text)
    assert proc.returncode == 128 + signal.SIGKILL, text[-3000:]
    assert f"engine {victim} (shard {victim} of {engines}): exit -9 (killed by SIGKILL)" in text
    for k in set(range(engines)) - {victim}:
        assert f"engine {k} (shard {k} of {engines}): exit 0" in text
    assert f"1 of {engines} engine(s) did not finish their shard" in text and "re-run the same command" in text
    assert list(out.glob("manifest.shard-*")) and not (out / "manifest.jsonl").exists()  # not merged
    return text


def test_scale_out_chain_kill_resume_reshard_die_retry(world):
    """The gate's chain on one output folder: a killed shard resumes; a re-shard over 3 engines side
    by side skips (checked) what shard 0 of 2 finished; one of the 3 dies mid-run and is reported;
    the re-run retries only its samples, rewrites nothing, merges, and equals the single-engine run."""
    import re

    from speccompat.dataset.shards import shard_of

    out = world.root / "chain"
    shard0 = kill_shard_zero_of_two_then_resume(world, out)
    left = {k: {i for i in IDS if shard_of(i, 3) == k} - shard0 for k in range(3)}
    victim = max(left, key=lambda k: len(left[k]))
    assert len(left[victim]) >= 3, left  # room to die with work left
    before = stamps(out)

    text = kill_an_engine_mid_run(world, out, 3, victim, world.root / "chain-dies.log")
    assert "3 engine(s) of 1 GPU(s) each on this host: shards 0..2 of 3" in text
    for k in range(3):
        mine = {i for i in IDS if shard_of(i, 3) == k}
        m = re.search(rf"shard {k} of 3: (\d+) of the input's {SAMPLES} samples; (\d+) already done", text)
        assert m is not None and (int(m.group(1)), int(m.group(2))) == (len(mine), len(mine & shard0)), text[-3000:]
    finished = part_ids(out)
    assert shard0 < finished and not left[victim] <= finished
    assert finished - shard0 - left[victim] == set().union(*(left[k] for k in left if k != victim))
    after = stamps(out)
    assert all(after[name] == st for name, st in before.items())  # nothing finished was rewritten
    before = after

    proc = run_driver(world.model, world.data, out, "--data-parallel-size", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k in set(range(3)) - {victim}:
        assert re.search(rf"\[engine {k} \(shard {k} of 3\)\] .*nothing to do", proc.stderr), proc.stderr[-3000:]
    w = re.search(rf"\[engine {victim} \(shard {victim} of 3\)\] .*summary: (\d+) written, (\d+) already done",
                  proc.stderr)
    assert w is not None and int(w.group(1)) == SAMPLES - len(finished), proc.stderr[-3000:]
    after = stamps(out)
    assert all(after[name] == st for name, st in before.items())
    # the 2-split's part 0 and the three parts of the 3-split
    assert f"complete: 4 manifest part(s) merged, all {SAMPLES} input samples present once" in proc.stderr
    verified_like_reference(out, world)


@pytest.mark.engine_full
def test_two_engines_side_by_side_make_the_same_data_set_as_one(world):
    out = world.root / "dp2"
    proc = run_driver(world.model, world.data, out, "--data-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert "2 engine(s) of 1 GPU(s) each on this host: shards 0..1 of 2" in log
    for k in range(2):
        assert f"[engine {k} (shard {k} of 2)]" in log
        assert f"engine {k} (shard {k} of 2): exit 0" in log
    assert f"complete: 2 manifest part(s) merged, all {SAMPLES} input samples present once" in log
    assert not list(out.glob("manifest.shard-*")) and not (out / "manifest.header.json").exists()
    identical = verified_like_reference(out, world)
    if identical == SAMPLES:  # a deterministic engine: the whole data set is byte-identical (but the header's run)
        assert (out / "manifest.jsonl").read_bytes().split(b"\n", 1)[1] == \
            (world.ref / "manifest.jsonl").read_bytes().split(b"\n", 1)[1]


@pytest.mark.engine_full
def test_a_killed_shard_resumes_and_a_reshard_from_two_to_three_recomputes_nothing(world):
    out = world.root / "reshard"
    from speccompat.dataset.shards import shard_of

    shard0 = kill_shard_zero_of_two_then_resume(world, out)
    before = stamps(out)

    # re-shard: the rest by 3 engines (shards of 3); shard 0 of 2's samples are skipped, checked
    proc = run_driver(world.model, world.data, out, "--data-parallel-size", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = done = 0
    import re

    for k in range(3):
        mine = {i for i in IDS if shard_of(i, 3) == k}
        m = re.search(rf"shard {k} of 3: (\d+) of the input's {SAMPLES} samples; (\d+) already done", proc.stderr)
        assert m is not None and int(m.group(1)) == len(mine)
        assert int(m.group(2)) == len(mine & shard0)
        done += int(m.group(2))
        w = re.search(rf"\[engine {k} \(shard {k} of 3\)\] .*summary: (\d+) written", proc.stderr)
        written += int(w.group(1)) if w else 0  # an engine with nothing to do writes no summary
    assert done == len(shard0) and written == SAMPLES - len(shard0)
    after = stamps(out)
    assert all(after[name] == st for name, st in before.items())  # nothing finished was rewritten
    # the 2-split's part 0 and the three parts of the 3-split
    assert f"complete: 4 manifest part(s) merged, all {SAMPLES} input samples present once" in proc.stderr
    verified_like_reference(out, world)


@pytest.mark.engine_full
def test_two_ray_actors_on_a_local_cluster_make_the_same_data_set(world):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'speccompat[ray]')")
    out = world.root / "ray"
    proc = run_driver(world.model, world.data, out, "--data-parallel-size", "2", "--ray", "--ray-address", "local")
    assert proc.returncode == 0, proc.stderr[-5000:]
    log = proc.stdout + proc.stderr
    assert "the Ray cluster has no GPUs: the 2 engine(s) run on CPU" in log
    for k in range(2):
        assert f"engine {k} (shard {k} of 2): exit 0" in log
    assert f"job progress: {SAMPLES}/{SAMPLES} samples extracted by 2 engine(s) (0 running)" in log
    assert f"complete: 2 manifest part(s) merged, all {SAMPLES} input samples present once" in log
    verified_like_reference(out, world)


@pytest.mark.engine_full
def test_an_engine_that_dies_is_reported_and_a_rerun_retries_its_samples(world):
    import re

    out = world.root / "dp-failure"
    kill_an_engine_mid_run(world, out, 2, 1, world.root / "dp-failure.log")
    finished = part_ids(out)
    before = stamps(out)
    assert len(finished) < SAMPLES

    proc = run_driver(world.model, world.data, out, "--data-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[engine 0 (shard 0 of 2)]" in proc.stderr and "nothing to do" in proc.stderr
    w = re.search(r"\[engine 1 \(shard 1 of 2\)\] .*summary: (\d+) written, (\d+) already done", proc.stderr)
    assert w is not None and int(w.group(1)) == SAMPLES - len(finished)
    after = stamps(out)
    assert all(after[name] == st for name, st in before.items())
    assert f"complete: 2 manifest part(s) merged, all {SAMPLES} input samples present once" in proc.stderr
    verified_like_reference(out, world)
