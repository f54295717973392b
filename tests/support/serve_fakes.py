"""``speccompat serve`` without an engine: a fake generator and stream whose states are a function of
the token ids, a server in a thread of the test process (or, run as a script, in a process of its
own, for signals); the real ``mooncake_master`` on loopback is speccompat.testing.online's.

    python tests/support/serve_fakes.py MODEL_DIR ARGS...   # speccompat serve ARGS with the fake engine
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # run as a script: the repository and tests/support's parent

from speccompat.testing.online import MOONCAKE_DIR, free_port, mooncake_master, mooncake_missing  # noqa: E402,F401
from support.dataset_fakes import HIDDEN, LAYERS, VOCAB  # noqa: E402

POISON = VOCAB - 1  # a prompt holding this token gets non-finite states from the fake engine
FATAL = VOCAB - 2  # ... and this one kills the fake engine


def fake_states(ids, layers=None, hidden=HIDDEN):
    """Deterministic states of a prompt: one bfloat16 [n, hidden] tensor per layer."""
    import torch

    g = torch.Generator().manual_seed(sum(i * (k + 1) for k, i in enumerate(ids[:64])) + len(ids))
    return [torch.randn(len(ids), hidden, generator=g).to(torch.bfloat16) for _ in range(layers or len(LAYERS))]


class FakeGen:
    """Stands in for speculators' generator: records the batches the loop formed."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[int] = []
        self.alone = 0
        self._speccompat_stats: dict = {}
        self.executor = None
        import torch  # what vLLM resolved the model's dtype to (fake_states' dtype)

        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))

    def generate(self, seqs, copy=True):
        from speccompat.errors import HiddenStatesError

        self.alone += 1
        out = []
        for seq in seqs:
            if POISON in seq:
                raise HiddenStatesError("sequence 0, layer 1: non-finite values in 1 token(s)")
            out.append({"input_ids": seq, "hidden_states": fake_states(seq)})
        return out


def fake_stream(gen, token_ids, *, max_in_flight_sequences=None, max_in_flight_tokens=None, copy=False):
    """``speccompat.generator.stream``'s contract: inputs read lazily, admitted up to the token budget,
    each admitted batch one "step" of ``gen.delay`` seconds."""
    from speccompat.errors import HiddenStatesError

    it, index = iter(token_ids), 0
    while True:
        batch, tokens = [], 0
        for seq in it:
            batch.append((index, list(seq)))
            index += 1
            tokens += len(seq)
            if max_in_flight_tokens is not None and tokens >= max_in_flight_tokens:
                break
        if not batch:
            return
        gen.batches.append(len(batch))
        time.sleep(gen.delay)
        if any(FATAL in seq for _, seq in batch):
            raise RuntimeError("the fake engine's worker died")
        if any(POISON in seq for _, seq in batch):
            raise HiddenStatesError("non-finite values in a sequence of this step")
        for i, seq in batch:
            yield i, fake_states(seq), {}


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_json(url: str, payload, timeout: float = 30, raw: bytes | None = None) -> tuple[int, dict, dict]:
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


class ThreadServer:
    """``speccompat serve`` with the fake engine in a thread of this process."""

    def __init__(self, argv: list[str], delay: float = 0.0) -> None:
        from speccompat.serve.cli import parse_args

        self.args = parse_args(argv)
        self.gen = FakeGen(delay)
        self.url: str | None = None
        self.code: int | None = None
        self.stop = threading.Event()
        self._ready = threading.Event()

    def __enter__(self) -> ThreadServer:
        from speccompat.serve.cli import serve

        def ready(url: str) -> None:
            self.url = url
            self._ready.set()

        def target() -> None:
            self.code = serve(self.args, generator_factory=lambda a: self.gen, stream=fake_stream, ready=ready,
                              stop=self.stop)
            self._ready.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        self._ready.wait(60)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


if __name__ == "__main__":  # speccompat serve with the fake engine, in a process of its own
    import logging

    from speccompat.serve.cli import parse_args, serve

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gen = FakeGen(float(os.environ.get("FAKE_DELAY", "0")))
    sys.exit(serve(parse_args(sys.argv[1:]), generator_factory=lambda a: gen, stream=fake_stream))
