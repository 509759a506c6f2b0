"""The server: any step's engine, kept alive across requests, behind vLLM's OpenAI-compatible
API (``python -m <step>.serve --model DIR``; docs/serving.md).

- ``options.py``: the command line, read into ``ServeOptions``; ``cli.py``: ``main``, which
  reads it, checks the packages and calls ``launch.py``'s ``run_server``: the server's life,
  in order;
- ``async_llm.py``: ``AsyncLLM``, requests and aborts from any coroutine, each request's
  outputs as an async stream (vLLM's ``AsyncLLM``), and ``build_async_engine_client``, the one
  owner of its life;
- ``engine_core.py``: ``EngineCore``, the loop that owns the engine, in a process of its own
  (vLLM's ``EngineCoreProc``) or on a thread;
- ``protocol.py``: what a request may hold, what an answer and an error look like;
- ``serving_engine.py``: what the generating endpoints share; ``serving_completion.py`` and
  ``serving_chat.py``: ``/v1/completions`` and ``/v1/chat/completions``, prompt to answer;
- ``api_server.py``: the FastAPI app, its routes, the HTTP (JSON, server-sent events, a client
  that leaves) and its errors;
- ``metrics.py``: ``/metrics``, vLLM's metric names;
- ``serving_render.py``: ``/v1/completions/render`` and ``/v1/chat/completions/render``, a
  prompt's token ids without the run (what a prefix-aware router routes by);
- ``kv_events_config.py`` and ``kv_events.py``: ``--kv-events-config``, and the engine's KV
  cache events published from its core as vLLM publishes them (docs/scale-out.md).

Only ``options.py``, ``kv_events_config.py`` and ``cli.py`` import without the ``serve``
extra (fastapi, uvicorn, prometheus_client) and the ``cluster`` one (pyzmq, msgspec), so that a
missing package is one line, not a traceback.
"""
