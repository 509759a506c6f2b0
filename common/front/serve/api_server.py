"""The HTTP server: FastAPI routes over one ``AsyncLLM`` (vLLM's ``api_server.py``).

``build_app`` wires the endpoints, vLLM's set:

- ``GET /health`` (200 while the engine runs), ``GET /metrics`` (``metrics.py``),
  ``POST /reset_prefix_cache``;
- under ``/v1``, guarded by the API key when one is set: ``GET /v1/models``,
  ``POST /v1/completions``, ``POST /v1/chat/completions`` (``serving.py``).

Every error is OpenAI's JSON shape with its status: a bad field 400 (FastAPI's own 422 for a
body that does not parse becomes 400, as OpenAI and vLLM answer), a missing or wrong key 401,
an unknown model or path 404. A bug is a 500 with no traceback in the answer (it goes to the
server's log): no request, however bad, gets one, and the next request is served as usual.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from . import protocol
from .async_llm import AsyncLLM, EngineDeadError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from .serving import OpenAIServing

logger = logging.getLogger("serve")


def build_app(
    llm: AsyncLLM, serving: OpenAIServing, metrics: Metrics, api_key: str | None = None
) -> FastAPI:
    """The app; it starts the engine core when it starts and stops it when it stops, and
    keeps what the stop found wrong with the pool in ``app.state.pool_problems``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        app.state.pool_problems = await llm.shutdown()

    app = FastAPI(title="Paged Prefix Cache: an OpenAI-compatible server", lifespan=lifespan)
    app.state.pool_problems = None
    add_error_handlers(app)
    app.include_router(v1_router(serving, api_key))

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


def v1_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """``/v1/*``: the OpenAI API, behind the key."""

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
        model = serving.model
        card = {
            "id": model.name,
            "object": "model",
            "created": serving.created,
            "owned_by": "paged-prefix-cache",
            "max_model_len": model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.create_completion(body, request)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.create_chat_completion(body, request)

    return router


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
