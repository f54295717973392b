"""``speccompat serve`` against the offline data set, on a real engine: the harness of
tests/engine/test_serve.py, ``nox -s serve_e2e`` and benchmarks/serve_load.py.

- :class:`ServerProcess`: ``python -m speccompat serve ... --port 0`` in a process of its own (its
  log in a file), ready once it printed ``serving <model> on http://HOST:PORT``; stopped with SIGTERM
  (its exit status kept).
- :func:`mooncake_master`: a real ``mooncake_master`` on loopback (RPC, HTTP metadata and admin ports
  on 127.0.0.1), stopped afterwards.
- :func:`extract_offline`: ``speccompat extract --layout speculators-arrow`` of the same samples.
- :data:`COMPARE`: speculators 0.9.0's own ``ArrowDataset`` (from the released wheel, in a fresh
  interpreter) twice over the same Arrow rows: offline (``on_missing="raise"``, the extracted set)
  and online (``on_missing="generate"`` against the server, through hs-connectors' transfer of the
  backend), item by item.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["COMPARE", "MOONCAKE_DIR", "ServerProcess", "extract_offline", "free_port", "mooncake_master",
           "mooncake_missing", "rows_only"]

REPO = Path(__file__).resolve().parents[2]
#: Mooncake's client, installed by scripts/mkenv.py beside the environments (not into them)
MOONCAKE_VERSION = "0.3.13.post1"
MOONCAKE_DIR = REPO / ".envs" / f"mooncake-{MOONCAKE_VERSION}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m speccompat serve ARGS --port 0`` until :meth:`stop` (SIGTERM)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 600) -> None:
        self.args, self.log, self.env, self.timeout = list(args), Path(log), env, timeout
        self.url: str | None = None
        self.returncode: int | None = None
        self.started_s = 0.0

    def start(self) -> ServerProcess:
        t0 = time.monotonic()
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "speccompat", "serve", *self.args, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=self._out, text=True, env=self.env, cwd=REPO)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout
        for line in self.proc.stdout:
            if line.startswith("serving ") and " on http://" in line:
                self.url = line.rsplit(" on ", 1)[1].strip()
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise RuntimeError(f"speccompat serve did not start (exit {self.returncode}):\n"
                               + self.log.read_text()[-4000:])
        self.started_s = time.monotonic() - t0
        return self

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        with contextlib.suppress(Exception):
            self.proc.stdout.close()
        self._out.close()
        return self.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def mooncake_master(log: Path) -> Iterator[tuple[str, str]]:
    """A ``mooncake_master`` on loopback, stopped afterwards; yields ``(master address, metadata URL)``."""
    binary = MOONCAKE_DIR / "mooncake" / "mooncake_master"
    rpc, meta, admin = free_port(), free_port(), free_port()
    cmd = [str(binary), "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
           "--metrics_host=127.0.0.1", f"--metrics_port={admin}"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", rpc), timeout=1):
                break
            time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited ({proc.returncode}): {Path(log).read_text()[-2000:]}")
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mooncake_missing() -> str | None:
    """Why Mooncake's client cannot run here (None when it can): not installed (scripts/mkenv.py
    installs it), or its libraries are missing (Debian: libibverbs1 librdmacm1 libnuma1)."""
    if not list((MOONCAKE_DIR / "mooncake").glob("store*.so")):
        return f"Mooncake's client is not installed in {MOONCAKE_DIR} (scripts/mkenv.py installs it)"
    proc = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(MOONCAKE_DIR)}, timeout=120)
    if proc.returncode != 0:
        return ("Mooncake's client does not load (Debian: apt-get install libibverbs1 librdmacm1 libnuma1): "
                + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return None


def extract_offline(model: Path, data: Path, out: Path, layer_ids: list[int], *, env: dict[str, str],
                    max_seq_len: int, dtype: str = "bfloat16", log: Path | None = None) -> None:
    """``speccompat extract --layout speculators-arrow`` (the offline set the server must equal)."""
    cmd = [sys.executable, "-m", "speccompat", "extract", "--model-path", str(model), "--prepared-data", str(data),
           "--output-dir", str(out), "--layout", "speculators-arrow", "--layer-ids", *map(str, layer_ids),
           "--max-seq-len", str(max_seq_len), "--gpu-memory-utilization", "0.1", "--dtype", dtype, "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    if log is not None:
        Path(log).write_text(f"{cmd}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        raise RuntimeError(f"speccompat extract failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def rows_only(arrow: Path, dest: Path) -> Path:
    """A copy of an Arrow data set's rows (no hidden states): what an online trainer starts from."""
    dest.mkdir(parents=True)
    for p in arrow.iterdir():
        if p.is_file() and (p.suffix == ".arrow" or p.name in ("dataset_info.json", "state.json")):
            shutil.copyfile(p, dest / p.name)
    return dest


#: argv: the speculators root (import_loader), url, backend, the offline set, the rows-only copy, the
#: output JSON, [master, metadata URL]; prints JSON: rows, exact rows, worst relative error, handles.
COMPARE = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    import torch
    data = import_loader(Path(sys.argv[1]))
    from hs_connectors.transfer import FileTransfer, FP8Transfer, MooncakeTransfer
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    url, backend, offline, online, out = sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6]
    fp8 = backend == "fp8" or (len(sys.argv) > 7 and sys.argv[7] == "fp8-offline")
    if backend == "mooncake":
        transfer = MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig(
            local_hostname="127.0.0.1", metadata_server=sys.argv[8], master_server_address=sys.argv[7],
            global_segment_size=256 << 20, local_buffer_size=128 << 20)))
        fp8 = False
    else:
        transfer = (FP8Transfer if backend == "fp8" else FileTransfer)(online / "hidden_states")
    ref_transfer = (FP8Transfer if fp8 else FileTransfer)(offline / "hidden_states")
    ref = data.ArrowDataset(max_len=1 << 20, datapath=str(offline), transfer=ref_transfer, on_missing="raise")
    live = data.ArrowDataset(max_len=1 << 20, datapath=str(online), transfer=transfer,
                             vllm_endpoint=url + "/v1", on_missing="generate")
    assert len(ref) == len(live)
    exact, worst, t0 = 0, 0.0, time.monotonic()
    for k in range(len(ref)):
        a, b = ref[k], live[k]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"]), k
        assert a["hidden_states"].shape == b["hidden_states"].shape, k
        same = all(torch.equal(a[key], b[key]) for key in ("hidden_states", "verifier_last_hidden_states"))
        exact += same
        for key in ("hidden_states", "verifier_last_hidden_states"):
            x, y = a[key].float(), b[key].float()
            worst = max(worst, float((x - y).norm() / x.norm()))
    left = sorted(p.name for p in (online / "hidden_states").glob("*")) if (online / "hidden_states").exists() else []
    doc = {"rows": len(ref), "exact_rows": exact, "worst_rel": worst, "online_s": round(time.monotonic() - t0, 2),
           "left_in_online_dir": left}
    Path(out).write_text(json.dumps(doc))
    print(json.dumps(doc))
''')
