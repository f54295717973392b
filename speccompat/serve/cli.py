"""``speccompat serve``: the command line, startup and shutdown (docs/online.md).

    speccompat serve --model-path /models/Kimi-K2.5 --layer-ids 2 30 58 60 --tp-size 8 \
        --backend mooncake --mooncake-master 10.0.0.5:50051 --mooncake-metadata-server http://10.0.0.5:8080/metadata

Startup: the settings are checked against the model's config.json (the layers a draft can train on,
the context length), the backend is prepared (the directory made, the Mooncake store joined) and the
port is bound before the engine starts; any problem there is one line and exit status 2, with
nothing started. Then speccompat is applied, speculators' ``VllmHiddenStatesGenerator`` starts the
engine (a failure: exit 1), and ``serving <model> on http://HOST:PORT`` is printed once requests are
taken. SIGTERM or Ctrl-C stops taking requests, finishes those in flight, removes what was stored
and not claimed, stops the engine and exits 0 (a second signal exits at once). An engine failure
while serving fails every request in flight and waiting (503) and exits 1.

Only the standard library is imported at module level: vLLM's workers start with ``spawn``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_REFUSED", "add_arguments", "main", "parse_args", "serve"]

logger = logging.getLogger("speccompat.serve")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
DESCRIPTION = ("Serve the hidden states of token-id prompts to speculators >= 0.9's online clients "
               "(an OpenAI-compatible endpoint), computed by speculators 0.3/0.4's generator under speccompat.")
EPILOG = """endpoints: GET /health, GET /v1/models, POST /v1/completions (prompt: token ids, max_tokens 1),
POST /v1/chat/completions (messages, where the tokenizer has a chat template). The response's
kv_transfer_params point to the states, as hs-connectors' transfers read them: file and fp8
{"hidden_states_path": ...} (FileTransfer, FP8Transfer), mooncake the transfer manifest
(MooncakeTransfer). Train with speculators >= 0.9: --on-missing generate --vllm-endpoint
http://HOST:PORT/v1 --hidden-states-backend file|fp8|mooncake --target-layer-ids (printed at startup).

exit status: 0 stopped by SIGTERM or Ctrl-C after finishing the requests in flight; 1 the engine did
not start or failed while serving; 2 refused before anything started (settings that do not fit the
model, an unusable backend or hidden-states directory, an unreachable Mooncake store, a port in use,
a missing package).

docs/online.md has the details."""


def positive_int(text: str) -> int:
    from speccompat.dataset.extract import positive_int as check

    return check(text)


def _fraction(text: str) -> float:
    from speccompat.dataset.extract import _fraction as check

    return check(text)


def _bounded(kind: type, ok: Any, what: str) -> Any:
    """An argparse type: ``kind(text)`` for which ``ok(value)`` holds, else the error ``what``."""

    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{what}, got {value}")
        return value

    return check


_positive = _bounded(float, lambda v: v > 0, "must be more than 0")
_non_negative = _bounded(float, lambda v: v >= 0, "must be 0 or more")
_port = _bounded(int, lambda v: 0 <= v <= 65535, "a port is 0..65535 (0: any free port)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", required=True, help="checkpoint directory of the target model")
    ap.add_argument("--layer-ids", type=int, nargs="+", required=True,
                    help="decoder layers to store (layer i = output of decoder layer i = vLLM aux id i+1), ascending, "
                         "the last the final layer (L-1): the trainer's input layers and its verifier state")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback unless told otherwise)")
    ap.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port, printed)")
    ap.add_argument("--served-model-name", default=None, help="the model id in /v1/models (default: --model-path)")
    ap.add_argument("--backend", choices=("file", "fp8", "mooncake"), default="file",
                    help="file: <handle>.safetensors in --hidden-states-dir (hs-connectors' FileTransfer); fp8: the "
                         "same in float8_e4m3fn with per-token scales (FP8Transfer); mooncake: one object per request "
                         "in a Mooncake store, no shared filesystem (MooncakeTransfer)")
    ap.add_argument("--hidden-states-dir", type=Path, default=None,
                    help="file and fp8: the directory the states are written to (shared with the trainer); made if "
                         "absent; its provenance.json lets `speccompat check-draft DRAFT DIR` check a trained draft")
    mc = ap.add_argument_group("mooncake (hs-connectors' MooncakeBackend options)")
    mc.add_argument("--mooncake-master", default="127.0.0.1:50051", help="the Mooncake master's RPC address")
    mc.add_argument("--mooncake-metadata-server", default="P2PHANDSHAKE",
                    help="the metadata server (mooncake_master --enable_http_metadata_server: http://H:P/metadata)")
    mc.add_argument("--mooncake-protocol", choices=("tcp", "rdma"), default="tcp", help="the store's transport")
    mc.add_argument("--mooncake-device", default="", help="RDMA device(s), e.g. mlx5_0; empty: Mooncake chooses")
    mc.add_argument("--mooncake-global-segment-gib", type=_positive, default=4.0,
                    help="memory this server lends the store for objects, GiB")
    mc.add_argument("--mooncake-local-buffer-gib", type=_positive, default=2.0, help="the client's local buffer, GiB")
    mc.add_argument("--mooncake-local-hostname", default=None,
                    help="the address the store reaches this server at (default: 127.0.0.1 when --host is "
                         "loopback, else $MOONCAKE_LOCAL_HOSTNAME or this host's address)")
    en = ap.add_argument_group("engine")
    en.add_argument("--tp-size", type=positive_int, default=1, help="tensor parallel size (GPUs)")
    en.add_argument("--max-model-len", type=positive_int, default=2048,
                    help="the engine's max_model_len; prompts of up to N-1 tokens are served")
    en.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8,
                    help="fraction of GPU memory vLLM may use (on CPU: of memory for the KV cache, e.g. 0.1)")
    lim = ap.add_argument_group("limits")
    lim.add_argument("--max-in-flight-gb", type=_positive, default=4.0,
                     help="memory for states in flight: half for prompts admitted to the engine, half for results "
                          "waiting to be stored (beyond it the engine waits)")
    lim.add_argument("--max-queued-requests", type=positive_int, default=4096,
                     help="requests waiting for the engine; beyond it 503 with Retry-After")
    lim.add_argument("--max-stored-gb", type=_positive, default=16.0,
                     help="stored states not yet claimed by a client; beyond it 503 with Retry-After")
    lim.add_argument("--handle-ttl", type=_positive, default=600.0,
                     help="seconds a stored result waits for its client to delete it; then it is removed")
    lim.add_argument("--shutdown-grace", type=_non_negative, default=5.0,
                     help="seconds a stopping server waits for clients to claim the last results before it removes "
                          "them")
    lim.add_argument("--writer-threads", type=positive_int, default=4, help="threads storing results")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO",
                    help="what is logged to stderr")


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=_Formatter)
    add_arguments(ap)
    return ap.parse_args(argv)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class Refused(Exception):
    """A setting that cannot work; exit 2 before anything started."""


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def check_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What config.json and the machine decide before anything starts; raises :class:`Refused`."""
    from speccompat.dataset import Rejected, read_model_info
    from speccompat.dataset.preflight import tokenizer_config, too_long
    from speccompat.layers import LayerIdsError, _config_dict, training_layers

    try:
        info = read_model_info(args.model_path)
    except Rejected as exc:
        raise Refused(str(exc)) from None
    try:
        training_layers(args.layer_ids, info.num_layers)
    except LayerIdsError as exc:
        raise Refused(f"--layer-ids {' '.join(map(str, args.layer_ids))}: {exc}") from None
    if found := too_long(args.max_model_len, _config_dict(args.model_path), tokenizer_config(args.model_path)):
        raise Refused(f"--max-model-len {args.max_model_len}: more than the model allows ({found[1]}), which vLLM "
                      f"refuses; use --max-model-len {found[0]} or less")
    if args.backend in ("file", "fp8") and args.hidden_states_dir is None:
        raise Refused(f"--backend {args.backend} needs --hidden-states-dir (a directory the trainer reads too)")
    if args.backend == "fp8":
        from speccompat.dataset.fp8 import refuse_unavailable

        if why := refuse_unavailable():
            raise Refused(why.replace("--dtype fp8", "--backend fp8"))
    for module, extra in (("starlette", "serve"), ("uvicorn", "serve"), ("safetensors", "serve"), ("torch", None)):
        try:
            __import__(module)
        except ImportError:
            raise Refused(f"speccompat serve needs {module}: pip install "
                          + (f"'speccompat[{extra}]'" if extra else module)) from None
    return {"info": info}


def make_backend(args: argparse.Namespace) -> Any:
    from .backends import FileBackend, FP8Backend, MooncakeBackend

    if args.backend == "file":
        return FileBackend(args.hidden_states_dir)
    if args.backend == "fp8":
        return FP8Backend(args.hidden_states_dir)
    local = args.mooncake_local_hostname
    if local is None:
        local = "127.0.0.1" if _loopback(args.host) else (
            os.environ.get("MOONCAKE_LOCAL_HOSTNAME") or socket.gethostbyname(socket.gethostname()))
    return MooncakeBackend(master=args.mooncake_master, metadata_server=args.mooncake_metadata_server,
                           local_hostname=local, protocol=args.mooncake_protocol, device=args.mooncake_device,
                           global_segment_bytes=round(args.mooncake_global_segment_gib * (1 << 30)),
                           local_buffer_bytes=round(args.mooncake_local_buffer_gib * (1 << 30)))


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Refused(f"--host {host}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise Refused(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


def start_generator(args: argparse.Namespace) -> Any:
    """speculators' generator (speccompat applied first); this starts vLLM's workers."""
    import speccompat

    status = speccompat.apply()
    if status.state not in ("armed", "active"):
        raise RuntimeError(f"speccompat could not adapt this installation ({status.state}): "
                           + "; ".join(status.warnings + status.errors))
    from speculators.data_generation import VllmHiddenStatesGenerator

    logger.info("starting the engine: %s, TP %d, layers %s, max_model_len %d", args.model_path, args.tp_size,
                args.layer_ids, args.max_model_len)
    return VllmHiddenStatesGenerator(args.model_path, layer_ids=list(args.layer_ids), max_model_len=args.max_model_len,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     tensor_parallel_size=args.tp_size)


def stop_generator(gen: Any) -> None:
    from speccompat.dataset.extract import stop_generator as stop

    stop(gen)


def load_tokenizer(model_path: str) -> tuple[Any, str | None]:
    """The tokenizer when it has a chat template (for /v1/chat/completions), else why not."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - chat is then refused with this reason
        return None, f"the tokenizer of {model_path} did not load ({type(exc).__name__}: {exc})"
    if not getattr(tok, "chat_template", None):
        return None, f"the tokenizer of {model_path} has no chat template"
    return tok, None


def write_provenance(args: argparse.Namespace, info: Any, status: Any, gen: Any = None) -> Path | None:
    """``provenance.json`` in the hidden-states directory (what ``check-draft`` reads), or None.
    The stored dtype is the engine's (``gen``'s model config: what vLLM resolved ``auto`` to), else
    the one config.json names."""
    if args.hidden_states_dir is None:
        return None
    from speccompat.dataset import collect_provenance
    from speccompat.dataset.fsutil import write_atomic
    from speccompat.dataset.spec import DTYPES, StoredSpec
    from speccompat.layers import _config_dict

    if args.backend == "fp8":
        dtype = "fp8"
    else:  # the file transfer stores the engine's states as they are
        engine = getattr(getattr(getattr(gen, "vllm_config", None), "model_config", None), "dtype", None)
        cfg = _config_dict(args.model_path)
        named = [engine, *(c.get(k) for c in (cfg.get("text_config") or {}, cfg) for k in ("dtype", "torch_dtype"))]
        dtype = next((str(d).removeprefix("torch.") for d in named if d), None)
        if dtype not in DTYPES:
            raise ValueError(f"{args.model_path}/config.json names no dtype this record knows ({dtype!r}): the stored "
                             f"states' dtype is not recorded")
    spec = StoredSpec.of_options(dtype, list(args.layer_ids), info.hidden_size)
    prov = collect_provenance(model_path=args.model_path, info=info, spec=spec, max_seq_len=args.max_model_len - 1,
                              on_long_line="refuse", tensor_parallel_size=args.tp_size,
                              layout=f"speccompat-serve-{args.backend}", status=status)
    from speccompat.dataset.names import PROVENANCE_NAME

    path = Path(args.hidden_states_dir) / PROVENANCE_NAME
    write_atomic(path, (json.dumps({"provenance": prov}, indent=1) + "\n").encode())
    return path


def serve(args: argparse.Namespace, *, generator_factory: Any = None, stream: Any = None,
          ready: Any = None, stop: threading.Event | None = None) -> int:
    """Run the server until a signal (or ``stop`` is set) or an engine failure; returns the exit
    status. ``generator_factory(args)`` and ``stream`` replace the engine in tests; ``ready(url)`` is
    called once requests are taken (default: print the line). Signals are handled when this runs in
    the main thread."""
    try:
        settings = check_settings(args)
    except Refused as exc:
        logger.error("%s", exc)
        return EXIT_REFUSED
    info = settings["info"]
    import uvicorn

    from .app import Server, build_app
    from .backends import BackendUnavailable, FileBackend, Handles
    from .engine import EngineLoop

    backend = make_backend(args)
    try:
        backend.setup()
        sock = bind(args.host, args.port)
    except (BackendUnavailable, Refused) as exc:
        logger.error("%s", exc)
        backend.close()
        return EXIT_REFUSED
    host, port = sock.getsockname()[:2]
    if isinstance(backend, FileBackend) and (n := backend.remove_stale(args.handle_ttl)):
        logger.info("removed %d stored result(s) older than --handle-ttl %gs left by an earlier server", n,
                    args.handle_ttl)
    handles = Handles(backend, args.handle_ttl, int(args.max_stored_gb * 1e9))
    tokenizer, why = load_tokenizer(args.model_path)
    name = args.served_model_name or args.model_path
    budget = int(args.max_in_flight_gb * 1e9 / 2)
    server = Server(model_name=name, max_model_len=args.max_model_len, vocab_size=info.vocab_size,
                    hidden_size=info.hidden_size, layer_ids=list(args.layer_ids), num_hidden_layers=info.num_layers,
                    backend=backend, handles=handles, tokenizer=tokenizer, tokenizer_problem=why,
                    writer_threads=args.writer_threads, max_pending_bytes=budget)
    t0 = time.monotonic()
    try:
        gen = (generator_factory or start_generator)(args)
    except Exception:
        logger.exception("the engine did not start")
        sock.close()
        backend.close()
        server.pool.shutdown()
        return EXIT_FAILED
    logger.info("engine ready in %.1f s", time.monotonic() - t0)
    import speccompat
    from speccompat.layers import describe_for_training

    try:
        if (path := write_provenance(args, info, speccompat.status(), gen)) is not None:
            logger.info("provenance: %s", path)
    except Exception as exc:  # noqa: BLE001 - the record is for check-draft; serving goes on
        logger.warning("could not write provenance.json: %s", exc)
    per_token = len(args.layer_ids) * info.hidden_size * 4
    engine = EngineLoop(gen, server.publish, max_in_flight_tokens=max(args.max_model_len, budget // per_token),
                        max_queued=args.max_queued_requests, stream=stream)
    server.engine = engine
    config = uvicorn.Config(build_app(server), log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=max(30, int(args.handle_ttl)))
    http = uvicorn.Server(config)
    http_thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="speccompat-http", daemon=True)
    stopping = stop or threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        if len(signals) > 1:
            logger.error("second signal: exiting now")
            os._exit(130 if signum == signal.SIGINT else 143)
        logger.info("signal %d: finishing the requests in flight, then stopping", signum)
        stopping.set()
        http.should_exit = True

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    janitor_stop = threading.Event()

    def janitor() -> None:
        while not janitor_stop.wait(1.0):
            try:
                handles.sweep()
            except Exception as exc:  # noqa: BLE001 - the next sweep tries again
                logger.warning("sweep of stored results failed: %s", exc)

    janitor_thread = threading.Thread(target=janitor, name="speccompat-janitor", daemon=True)
    code = EXIT_OK
    try:
        http_thread.start()
        janitor_thread.start()
        while not http.started and http_thread.is_alive():
            time.sleep(0.02)
        if not http.started:
            logger.error("the HTTP server did not start")
            return EXIT_FAILED
        shown = f"[{host}]" if ":" in str(host) else host
        url = f"http://{shown}:{port}"
        print(describe_for_training(args.layer_ids, info.num_layers, str(args.hidden_states_dir or "HS_DIR")),
              flush=True)
        (ready or (lambda u: print(f"serving {name} on {u}", flush=True)))(url)
        def done() -> bool:
            if stopping.is_set():
                http.should_exit = True  # stop taking requests; those in flight are finished
                return not http_thread.is_alive()
            return False

        try:
            engine.run(stop=done)
        except Exception as exc:
            logger.error("the engine failed while serving: %s: %s; every request in flight failed (503); exiting",
                         type(exc).__name__, exc)
            code = EXIT_FAILED
        if not stopping.is_set():  # an engine failure: stop taking requests
            http.should_exit = True
        http_thread.join(timeout=60)
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        server.pool.shutdown(wait=True)
        janitor_stop.set()
        janitor_thread.join(timeout=10)
        deadline = time.monotonic() + min(args.shutdown_grace, args.handle_ttl)
        while handles.items and time.monotonic() < deadline:  # a moment for the last clients to claim theirs
            with contextlib.suppress(Exception):
                handles.sweep()
            time.sleep(0.1)
        with contextlib.suppress(Exception):
            handles.sweep(expire_all=True)
        logger.info("stored results: %s", handles.stats())
        stop_generator(gen)
        backend.close()
        with contextlib.suppress(OSError):
            sock.close()


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    from speccompat.dataset.extract import use_spawn

    use_spawn()
    return serve(args)


if __name__ == "__main__":  # vLLM's spawned workers re-import this file: nothing may run then
    sys.exit(main())
