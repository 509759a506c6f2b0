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
- ``protocol.py``: what a request may hold and what an error looks like; ``responses.py``: what
  the answers look like, each a pydantic model that the answers are built from and the
  published schema derived from;
- ``serving_engine.py``: what the endpoints share (the tokenizer's and the detokenizer's
  threads, each choice's ``SamplingParams``); ``serving_completion.py``, ``serving_chat.py``
  and ``serving_tokenization.py``: ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``
  and ``/detokenize``, prompt to answer; ``output_processor.py``: one request's choices as
  they grow (their text, stop strings applied, log-probabilities, the usage), each built in
  one place for both endpoints, whole or streamed; ``serving_models.py``:
  the served model and a prompt as it takes it, which both sides name;
- ``serving_render.py``: ``/v1/completions/render`` and ``/v1/chat/completions/render``, a
  prompt's token ids without the run (what a prefix-aware router routes by);
- ``api_server.py``: the FastAPI app, its routes, the HTTP (bodies read and checked, JSON,
  server-sent events, a client that leaves) and its errors; ``limits.py``: a body over
  ``--max-request-bytes`` refused before it is read; ``openapi.py``: the published schema;
- ``metrics.py``: ``/metrics``, vLLM's metric names;
- ``kv_events_config.py`` and ``kv_events.py``: ``--kv-events-config``, and the engine's KV
  cache events published from its core as vLLM publishes them (docs/scale-out.md).

Only ``options.py``, ``kv_events_config.py`` and ``cli.py`` import without the ``serve``
extra (fastapi, uvicorn, prometheus_client) and the ``cluster`` one (pyzmq, msgspec), so that a
missing package is one line, not a traceback.
"""
