"""The server: any step's engine, kept alive across requests, behind vLLM's OpenAI-compatible
API (``python -m <step>.serve --model DIR``; docs/serving.md).

- ``async_llm.py``: ``AsyncLLM``, requests and aborts from any coroutine, each request's
  outputs as an async stream (vLLM's ``AsyncLLM``);
- ``engine_core.py``: ``EngineCore``, the loop that owns the engine, in a process of its own
  (vLLM's ``EngineCoreProc``) or on a thread;
- ``protocol.py``: what a request may hold, what an answer and an error look like;
- ``serving.py``: ``/v1/completions`` and ``/v1/chat/completions``, prompt to stream;
- ``metrics.py``: ``/metrics``, vLLM's metric names;
- ``api_server.py``: the FastAPI app, its routes and its errors;
- ``cli.py`` and ``launch.py``: the command line, and the server assembled from it.

Only ``cli.py`` imports without the ``serve`` extra (fastapi, uvicorn, prometheus_client), so
that a missing package is one line, not a traceback.
"""
