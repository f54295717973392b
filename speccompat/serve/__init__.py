"""``speccompat serve``: hidden states for speculators >= 0.9's online clients, from speculators
0.3/0.4's generator under speccompat, on any supported vLLM release (docs/online.md).

An OpenAI-compatible endpoint (``/v1/models``, ``/v1/completions`` with token-id prompts,
``/v1/chat/completions``, ``/health``) in front of one engine:

- :mod:`.engine`: the engine loop. Requests are queued by the HTTP threads; the loop (the main
  thread, which owns the engine) feeds them to ``speccompat.generator.stream`` as they arrive, so
  concurrent requests share the engine's steps; a result goes to a publisher thread.
- :mod:`.backends`: where a request's states go, as hs-connectors' transfers read them: ``file``
  (``<handle>.safetensors``: ``hidden_states`` [n, layers, hidden], ``token_ids`` [n]), ``fp8`` (the
  same with fp8 values and ``hidden_states_scales``), ``mooncake`` (one packed object per request in a
  Mooncake store, its transfer manifest in the response). Handles the client does not delete expire.
- :mod:`.app`: the HTTP exchange (starlette, served by uvicorn), request checks and error replies.
- :mod:`.cli`: the command line, startup (settings checked before any engine starts) and shutdown.

Nothing here is imported by the core; the data-set package provides the fp8 rule and the layer
records. Importing this package imports neither torch nor the HTTP stack.
"""
