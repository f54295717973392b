"""Start and talk to engine hosts (see :mod:`speccompat.testing.host`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .host import KEY_ENV, new_key, recv, send

__all__ = ["EngineError", "EngineHost"]


class EngineError(RuntimeError):
    """The host reported an error; ``type`` is the exception class name raised there."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"{reply['type']}: {reply['error']}\n--- in the engine host ---\n{reply['traceback']}")
        self.type = reply["type"]
        self.error = reply["error"]


class EngineHost:
    """One engine host process. ``start()`` blocks until the generator is built (or failed)."""

    def __init__(
        self,
        model: str | Path,
        layer_ids: list[int],
        *,
        speculators_path: str | None = None,
        apply: bool = True,
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.3,
        max_num_batched_tokens: int = 0,
        tp: int = 1,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        timeout: float = 900,
    ) -> None:
        self.args = [
            python, "-m", "speccompat.testing.host",
            "--model", str(model),
            "--layer-ids", *map(str, layer_ids),
            "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--tp", str(tp),
        ]
        if speculators_path:
            self.args += ["--speculators-path", str(speculators_path)]
        if not apply:
            self.args.append("--no-apply")
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp()) / "engine.log"
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.conn: Any = None
        self.startup: dict[str, Any] | None = None
        self.record: dict[str, Any] | None = None  # what a test pool notes of this engine (its start, its tests)

    def start(self) -> EngineHost:
        from multiprocessing.connection import Listener

        self._dir = tempfile.mkdtemp(prefix="speccompat-host-")  # mode 0700: only this user gets in
        address = os.path.join(self._dir, "engine.sock")
        key = new_key()
        listener = Listener(address, family="AF_UNIX", authkey=key)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the process' lifetime
        self.proc = subprocess.Popen([*self.args, "--address", address], stdout=log, stderr=subprocess.STDOUT,
                                     env={**self.env, KEY_ENV: key.hex()})
        try:
            listener._listener._socket.settimeout(self.timeout)  # noqa: SLF001 - no public timeout
            self.conn = listener.accept()
        except OSError as exc:
            self.stop()
            raise RuntimeError(f"engine host did not connect (see {self.log_path}): {exc}") from exc
        finally:
            listener.close()
        self.startup = self._reply()
        return self

    def _reply(self) -> Any:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"engine host silent for {self.timeout} s (see {self.log_path})")
        reply = recv(self.conn)
        if not reply["ok"]:
            raise EngineError(reply)
        return reply["result"]

    def call(self, op: str, **kw: Any) -> Any:
        if self.conn is None:
            raise RuntimeError("engine host is not running")
        send(self.conn, {"op": op, **kw})
        return self._reply()

    def generate(self, token_ids: Any) -> dict[str, Any]:
        return self.call("generate", token_ids=token_ids)

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.conn is not None:
            try:
                send(self.conn, {"op": "stop"})
            except OSError:
                pass
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EngineHost:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
