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
problems ``verify_dataset`` found after the resumes (must be 0). A real-engine variant (the same
checks around an extraction with vLLM) is not part of this script.

    python benchmarks/fault_injection.py --kills 24 --out benchmarks/results/fault-injection.json
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import random
import shutil
import signal
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
    (model / "model.safetensors").write_bytes(b"\0" * 64)
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

    return collect_provenance(model_path=str(model), info=read_model_info(str(model)), layer_ids=LAYERS,
                              dtype="bfloat16", max_seq_len=256, on_long_line="truncate", tensor_parallel_size=1,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args()
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
    write(doc, args.out, echo=False)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=2))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    ok = doc["lost"] == 0 and doc["verify_problems"] == 0 and doc["resume_failures"] == 0 \
        and doc["faults_injected"] == doc["faults"] == doc["faults_failed_run"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
