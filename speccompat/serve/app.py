"""The HTTP exchange of ``speccompat serve``: what speculators 0.9's client sends and reads, in the
shapes of vLLM's OpenAI-compatible server (``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``, ``serve/engine/protocol.py`` of vLLM 0.32.0).

- ``GET /health``: 200 with an empty body while the engine serves, 503 after it failed.
- ``GET /v1/models``: one model card (``id`` the served model name, ``max_model_len``), plus
  ``hidden_states``: the backend, the stored layers (``speccompat.layers.layer_records``) and the
  ``--target-layer-ids`` a draft trained on them needs.
- ``POST /v1/completions``: ``prompt`` a list of token ids (or one such list in a list),
  ``max_tokens`` 1 (or absent): the states of the prompt's tokens are stored and the response is a
  ``text_completion`` with ``choices[0].prompt_token_ids`` (when ``return_token_ids``) and
  ``kv_transfer_params`` (the backend's, :mod:`.backends`). The server generates no text: ``text`` is
  empty and ``usage.completion_tokens`` 0.
- ``POST /v1/chat/completions``: ``messages`` rendered and tokenized with the tokenizer's chat
  template (``add_generation_prompt``, ``continue_final_message`` as sent; text content only), then
  the same; ``prompt_token_ids`` at the top level, as vLLM puts it.

A request the server cannot serve gets one line in vLLM's error shape, ``{"error": {"message",
"type", "param", "code"}}``: 400 (not JSON, no or empty prompt, a token id that is not an integer or
outside the vocabulary, too long, a parameter this server cannot honour), 404 (unknown model or
path), 405, 413 (body too large), 500 (the states failed their checks or could not be stored; the
server goes on), 503 (the engine failed; or, with ``Retry-After``, too much waiting or unclaimed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine import EngineFailed, EngineLoop, Job, RequestFailed, RequestRejected, ServerBusy

__all__ = ["Server", "build_app"]

logger = logging.getLogger("speccompat.serve")

#: The largest request body read (token ids and chat messages), bytes.
MAX_BODY = 64 << 20


class Server:
    """The served model, its engine loop and its backend; what the HTTP handlers call."""

    def __init__(self, *, model_name: str, max_model_len: int, vocab_size: int, hidden_size: int,
                 layer_ids: list[int], num_hidden_layers: int, backend: Any, handles: Any,
                 tokenizer: Any = None, tokenizer_problem: str | None = None, writer_threads: int = 4,
                 max_pending_bytes: int = 1 << 30, created: int | None = None) -> None:
        self.model_name, self.max_model_len, self.vocab_size = model_name, max_model_len, vocab_size
        self.hidden_size, self.layer_ids, self.num_hidden_layers = hidden_size, list(layer_ids), num_hidden_layers
        self.backend, self.handles = backend, handles
        self.tokenizer, self.tokenizer_problem = tokenizer, tokenizer_problem
        self.engine: EngineLoop | None = None
        self.created = created or int(time.time())
        self.instance = uuid.uuid4().hex[:12]
        self._count = 0
        self._count_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="speccompat-publish")
        self.max_pending_bytes = max_pending_bytes
        self._pending = 0
        self._pending_cv = threading.Condition()
        self.failures = 0

    # ---- the engine side: publish a result (called by the engine loop)

    def _state_bytes(self, n: int) -> int:
        return n * len(self.layer_ids) * self.hidden_size * 4

    def publish(self, job: Job, states: list[Any]) -> None:
        """Hand a result to a publisher thread; waits while ``max_pending_bytes`` of results wait to be
        stored (the engine then waits too: memory stays bounded)."""
        nbytes = self._state_bytes(len(job.ids))
        with self._pending_cv:
            while self._pending and self._pending + nbytes > self.max_pending_bytes:
                self._pending_cv.wait()
            self._pending += nbytes
        self.pool.submit(self._publish_one, job, states, nbytes)

    def _publish_one(self, job: Job, states: list[Any], nbytes: int) -> None:
        import torch

        from .backends import check_states

        try:
            with self._count_lock:
                self._count += 1
                handle = f"speccompat-{self.instance}-{self._count}"
            check_states(states, len(job.ids), len(self.layer_ids), self.hidden_size)
            token_ids = torch.tensor(job.ids, dtype=torch.long)
            params, stored = self.backend.put(handle, token_ids, states)
            self.handles.add(handle, stored)
            job.future.set_result(params)
        except ValueError as exc:
            self.failures += 1
            logger.error("a result failed its check and was not stored: %s", exc)
            job.fail(RequestFailed(f"the hidden states failed their check: {exc}"))
        except Exception as exc:  # noqa: BLE001 - this request fails; the server goes on
            self.failures += 1
            logger.error("storing a result failed: %s: %s", type(exc).__name__, exc)
            job.fail(RequestFailed(f"storing the hidden states failed: {type(exc).__name__}: {exc}"))
        finally:
            del states
            with self._pending_cv:
                self._pending -= nbytes
                self._pending_cv.notify_all()

    # ---- the HTTP side

    def check_prompt(self, ids: Any) -> list[int]:
        """The prompt as a list of ints in the vocabulary, at most ``max_model_len - 1`` of them."""
        from speccompat.generator import normalize_sequence

        if not isinstance(ids, list) or not ids:
            raise RequestRejected("prompt is empty" if isinstance(ids, list) else
                                  f"prompt must be a list of token ids, got {type(ids).__name__}")
        try:
            out, _ = normalize_sequence(0, ids, vocab_size=self.vocab_size, max_len=len(ids))
        except (TypeError, ValueError) as exc:
            raise RequestRejected(str(exc).replace("sequence 0, position ", "prompt[").replace(": token id", "]: token id")
                                  ) from None
        limit = self.max_model_len - 1
        if len(out) > limit:
            raise RequestRejected(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                  f"request has {len(out)} input tokens and 1 for the completion; this server takes "
                                  f"at most {limit} prompt tokens (--max-model-len {self.max_model_len})")
        return out

    async def extract(self, ids: list[int]) -> dict[str, Any]:
        if self.handles.full():
            raise ServerBusy(f"{self.handles.bytes / 1e9:.2f} GB of hidden states are stored and not yet claimed "
                             f"(--max-stored-gb {self.handles.max_bytes / 1e9:g}); retry later")
        assert self.engine is not None
        return await asyncio.wrap_future(self.engine.submit(ids))

    def model_card(self) -> dict[str, Any]:
        from speccompat.layers import layer_records, training_layers

        t = training_layers(self.layer_ids, self.num_hidden_layers)
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "speccompat",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len, "permission": [],
                "hidden_states": {**self.backend.describe(), "layer_ids": self.layer_ids,
                                  "layers": layer_records(self.layer_ids), "num_hidden_layers": self.num_hidden_layers,
                                  "target_layer_ids": list(t.aux_ids), "verifier_layer": t.verifier_layer}}


def _error(message: str, status: int, *, param: str | None = None, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLarge",
            500: "InternalServerError", 503: "ServiceUnavailableError"}.get(status, "Error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


async def _body(request: Any) -> dict[str, Any]:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise RequestRejected(f"request body of {size} bytes is larger than the {MAX_BODY} this server reads", 413)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise RequestRejected(f"request body larger than the {MAX_BODY} bytes this server reads", 413)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestRejected(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestRejected(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_common(server: Server, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != server.model_name:
        raise RequestRejected(f"The model `{model}` does not exist.", 404)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and max_tokens != 1:
        raise RequestRejected(f"max_tokens {max_tokens!r}: this server stores the prompt's hidden states and "
                              "generates no tokens; send max_tokens=1")
    if body.get("stream"):
        raise RequestRejected("stream: this server answers each request once; send stream=false")
    if body.get("n", 1) != 1:
        raise RequestRejected(f"n {body.get('n')!r}: one result per request; send n=1")


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _chat_ids(server: Server, body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRejected("messages must be a non-empty list of chat messages")
    if server.tokenizer is None:
        raise RequestRejected(f"chat completions need the model's chat template: {server.tokenizer_problem}; send "
                              "token ids to /v1/completions")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestRejected(f"messages[{i}] must be an object with a role")
        if not isinstance(m.get("content", ""), (str, type(None))):
            raise RequestRejected(f"messages[{i}].content: only text content is served (images and other parts are "
                                  "not); send token ids to /v1/completions")
    try:
        ids = server.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)), return_dict=False)
    except Exception as exc:  # noqa: BLE001 - the template's own error, one line
        raise RequestRejected(f"the chat template could not render these messages: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, dict) or (hasattr(ids, "keys") and "input_ids" in ids):
        ids = ids["input_ids"]
    return list(ids)


def build_app(server: Server) -> Any:
    """The starlette application of ``server``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def serve_one(request: Any, chat: bool) -> Any:
        try:
            body = await _body(request)
            _check_common(server, body)
            if chat:
                ids = server.check_prompt(_chat_ids(server, body))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                    prompt = prompt[0]
                elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
                    raise RequestRejected(f"{len(prompt)} prompts: one prompt per request")
                elif isinstance(prompt, str):
                    raise RequestRejected("prompt is text: this server takes token ids (a list of integers); "
                                          "tokenize the prompt, or use /v1/chat/completions with messages")
                ids = server.check_prompt(prompt)
            params = await server.extract(ids)
        except RequestRejected as exc:
            return _error(str(exc), exc.status)
        except ServerBusy as exc:
            return _error(str(exc), 503, headers={"Retry-After": "1"})
        except (RequestFailed, EngineFailed) as exc:
            return _error(str(exc), exc.status)
        prompt_ids = ids if body.get("return_token_ids") else None
        if chat:
            return JSONResponse({
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": server.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": "length", "stop_reason": None, "token_ids": None}],
                "usage": _usage(len(ids)), "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
                "kv_transfer_params": params})
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": prompt_ids}],
            "usage": _usage(len(ids)), "kv_transfer_params": params})

    async def completions(request: Any) -> Any:
        return await serve_one(request, chat=False)

    async def chat_completions(request: Any) -> Any:
        return await serve_one(request, chat=True)

    async def models(request: Any) -> Any:
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    async def health(request: Any) -> Any:
        if server.engine is not None and server.engine.failed is not None:
            return _error(f"the engine failed: {server.engine.failed}", 503)
        return Response(status_code=200)

    async def http_error(request: Any, exc: Any) -> Any:
        message = {404: f"no such path: {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return _error(message, exc.status_code)

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
