"""The HTTP server: FastAPI routes over one ``AsyncLLM`` (vLLM's ``api_server.py``).

``build_app`` wires the endpoints, vLLM's set:

- ``GET /health`` (200 while the engine runs), ``GET /metrics`` (``metrics.py``),
  ``POST /reset_prefix_cache``;
- under ``/v1``, guarded by the API key when one is set: ``GET /v1/models``,
  ``POST /v1/completions`` (``serving_completion.py``), ``POST /v1/chat/completions``
  (``serving_chat.py``), and their ``/render`` twins, the prompt's token ids without the run
  (``serving_render.py``: what a prefix-aware router routes by).

The HTTP is here and only here: a handler returns an answer (a dict) or an ``EventStream``,
and ``respond`` writes it, as JSON or as server-sent events ending with ``data: [DONE]``,
watching meanwhile for a client that leaves (its request is then aborted). The engine's life
is not the app's: ``launch.py`` starts it before the app serves and stops it after.

Every error is OpenAI's JSON shape with its status: a bad field 400 (FastAPI's own 422 for a
body that does not parse becomes 400, as OpenAI and vLLM answer), a missing or wrong key 401,
an unknown model or path 404. A bug is a 500 with no traceback in the answer (it goes to the
server's log): no request, however bad, gets one, and the next request is served as usual.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import protocol
from .async_llm import AsyncLLM, EngineDeadError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import EventStream, OpenAIServing, ServedModel
from .serving_render import add_render_routes

logger = logging.getLogger("serve")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
T = TypeVar("T")


def build_app(
    llm: AsyncLLM, served: ServedModel, metrics: Metrics, api_key: str | None = None
) -> FastAPI:
    """The app over a running ``llm`` (``build_async_engine_client`` started it)."""
    app = FastAPI(title="Paged Prefix Cache: an OpenAI-compatible server")
    add_error_handlers(app)
    app.include_router(v1_router(llm, served, api_key))

    @app.get("/health")
    async def health() -> Response:
        if llm.dead is not None:
            return error_response(OpenAIError(503, f"the engine failed: {llm.dead}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await llm.call("reset_prefix_cache"):
            raise OpenAIError(
                409,
                "requests are running: the prefix cache is reset only when none is (their "
                "blocks are in it); try again once they finished",
                code="requests_running",
            )
        return Response(status_code=200)

    return app


def v1_router(llm: AsyncLLM, served: ServedModel, api_key: str | None) -> APIRouter:
    """``/v1/*``: the OpenAI API, behind the key."""
    completion, chat = OpenAIServingCompletion(llm, served), OpenAIServingChat(llm, served)
    created = int(time.time())  # /v1/models' "created"

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise OpenAIError(
                401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key"
            )

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @router.get("/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": created,
            "owned_by": "paged-prefix-cache",
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(request, completion, body)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, chat, body)

    add_render_routes(router, completion, chat)  # what a prefix-aware router routes by
    return router


async def respond(request: Request, serving: OpenAIServing, body: Any) -> Response:
    """The handler's answer over HTTP: JSON, or server-sent events; a client that leaves
    before a whole answer is ready gets nothing, and its request is aborted."""
    answer = await until_disconnected(request, serving.create(body))
    if answer is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
    if isinstance(answer, EventStream):
        # ``close`` runs after the response, whatever ended it (a no-op for a finished
        # request): also when the client left before the first event was sent.
        return StreamingResponse(
            server_sent_events(answer.chunks),
            media_type="text/event-stream",
            background=BackgroundTask(answer.close),
        )
    return JSONResponse(answer)


async def server_sent_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client disconnected first (``work`` is cancelled
    then: nobody is left to answer)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
    return None if gone else task.result()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI) -> None:
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    async def bad_body(request: Request, exc: RequestValidationError) -> Response:
        return error_response(protocol.validation_error(list(exc.errors())))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(OpenAIError(exc.status_code, str(exc.detail)))

    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(OpenAIError(500, str(exc)))

    async def bug(request: Request, exc: Exception) -> Response:
        logger.exception("a bug answered 500", exc_info=exc)
        return error_response(OpenAIError(500, f"internal server error ({type(exc).__name__})"))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, bad_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(Exception, bug)


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
