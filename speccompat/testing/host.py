"""An engine host: one speculators generator in its own process, driven over a socket.

Tests share engines (start-up takes 10-40 s) and need engines of different speculators versions
in one test session; a separate process per engine gives both. The host puts the requested
speculators version first on ``sys.path`` (and on ``PYTHONPATH``, which vLLM's spawned workers
inherit), calls ``speccompat.apply()`` unless told not to, builds the generator and answers
requests until it is told to stop or its parent goes away.

    python -m speccompat.testing.host --address ADDR --model PATH --layer-ids 1 3 5 [...]

Requests (pickled over ``multiprocessing.connection``): ``{"op": "generate", "token_ids": ...}`` (and
``"mode"``: ``SPECCOMPAT_GENERATE`` for this call), ``{"op": "stream", "token_ids": ...,
"options": {...}}`` (``speccompat.generator.stream``'s keywords; every item, in delivery order),
``{"op": "status"}``, ``{"op": "stop"}``. Replies: ``{"ok": True, "result": ...}`` or
``{"ok": False, "type": ..., "error": ..., "traceback": ...}``.

Both ends unpickle what they receive, so the channel is private to one client and its host: the
socket lives in a folder only the user can enter (mode 0700, made by the client), and the
connection is authenticated with a random key made per host (``secrets.token_bytes``), handed
to the host in its environment (``SPECCOMPAT_HOST_KEY``, hex), never on its command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any

#: Environment variable holding the per-host connection key (hex).
KEY_ENV = "SPECCOMPAT_HOST_KEY"


def new_key() -> bytes:
    import secrets

    return secrets.token_bytes(32)


def send(conn: Any, obj: Any) -> None:
    """Plain pickle: Connection.send would use torch's shared-memory reducers, which need the
    two processes to be multiprocessing relatives (same authkey)."""
    import pickle

    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Any:
    import pickle

    return pickle.loads(conn.recv_bytes())


def _serve(args: argparse.Namespace) -> None:
    from multiprocessing.connection import Client

    key = os.environ.pop(KEY_ENV, "")
    if not key:
        raise SystemExit(f"{KEY_ENV} is not set: the engine host is started by speccompat.testing.client")
    conn = Client(args.address, authkey=bytes.fromhex(key))
    t0 = time.time()
    try:
        if not args.no_apply:
            import speccompat

            speccompat.apply()
        from speculators.data_generation import VllmHiddenStatesGenerator

        kwargs: dict[str, Any] = {
            "layer_ids": args.layer_ids,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "tensor_parallel_size": args.tp,
        }
        if args.max_num_batched_tokens:
            import inspect

            if "max_num_batched_tokens" in inspect.signature(VllmHiddenStatesGenerator.__init__).parameters:
                kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
            else:  # speculators 0.3: the generator sets it to max(its minimum, max_model_len) itself
                print(f"speccompat.testing.host: this generator takes no max_num_batched_tokens; "
                      f"{args.max_num_batched_tokens} not applied", file=sys.stderr, flush=True)
        gen = VllmHiddenStatesGenerator(args.model, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which decides
        send(conn, {"ok": False, "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()})
        return
    send(conn, {"ok": True, "result": {"startup_s": time.time() - t0, "pid": os.getpid()}})
    while True:
        try:
            req = recv(conn)
        except (EOFError, OSError):
            break
        op = req.get("op")
        if op == "stop":
            break
        try:
            if op == "generate":
                t = time.time()
                before = os.environ.get("SPECCOMPAT_GENERATE")
                if req.get("mode"):  # speccompat.generator.generate_mode, for this call
                    os.environ["SPECCOMPAT_GENERATE"] = req["mode"]
                try:
                    out = gen.generate(req["token_ids"])
                finally:
                    os.environ.pop("SPECCOMPAT_GENERATE", None)
                    if before is not None:
                        os.environ["SPECCOMPAT_GENERATE"] = before
                result: Any = {
                    "results": out,
                    "seconds": time.time() - t,
                    "stats": getattr(gen, "_speccompat_stats", None),
                }
            elif op == "stream":
                from speccompat.generator import stream

                t = time.time()
                out = list(stream(gen, req["token_ids"], **req.get("options", {})))
                result = {"items": [(i, states) for i, states, _ in out], "seconds": time.time() - t,
                          "stats": out[-1][2] if out else None}
            elif op == "status":
                import speccompat

                result = speccompat.status().as_dict()
            else:
                raise ValueError(f"unknown op {op!r}")
            send(conn, {"ok": True, "result": result})
        except BaseException as exc:  # noqa: BLE001
            send(conn, {"ok": False, "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()})
    try:
        gen.executor.shutdown()
    except Exception:  # noqa: BLE001
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layer-ids", type=int, nargs="+", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--speculators-path", default="")
    ap.add_argument("--no-apply", action="store_true")
    args = ap.parse_args()
    if args.speculators_path:
        sys.path.insert(0, args.speculators_path)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (args.speculators_path, os.environ.get("PYTHONPATH", "")) if p
        )
    _serve(args)


if __name__ == "__main__":
    main()
