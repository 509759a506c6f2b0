"""The HTTP server: FastAPI routes over one ``AsyncLLM`` (vLLM's ``api_server.py``).

``build_app`` wires the endpoints, vLLM's set:

- ``GET /health`` (200, empty, while the engine runs), ``GET /metrics`` (``metrics.py``) and
  ``GET /kv_event_sources`` (where the KV cache events go: ``kv_events_config.py``): open to
  anyone, as in vLLM, so that a load balancer, Prometheus and a router need no key; they tell
  how the server is, and change nothing;
- with ``--api-key``, every other route needs it: ``GET /v1/models``, ``POST /v1/completions``
  (``serving_completion.py``), ``POST /v1/chat/completions`` (``serving_chat.py``), their
  ``/render`` twins, the prompt's token ids without the run (``serving_render.py``: what a
  prefix-aware router routes by), ``POST /tokenize`` and ``/detokenize``
  (``serving_tokenization.py``), and ``POST /reset_prefix_cache``, which changes what every
  later request costs.

The HTTP is here and only here: a body is read (any ``Content-Type``: ``curl -d`` sends a form
type) and checked against its request model, a handler returns its response (a model of
``responses.py``) or an ``EventStream``, and ``respond`` writes it, as JSON or as server-sent
events ending with
``data: [DONE]``, watching meanwhile for a client that leaves (its request is then aborted).
``RequestSizeLimit`` (``limits.py``) refuses a body over ``--max-request-bytes`` with 413
before any of that. The engine's life is not the app's: ``launch.py`` starts it before the app
serves and stops it after.

Every error is OpenAI's JSON shape with its status: a bad field 400, a missing or wrong key
401, an unknown model or path 404, a method the path does not take 405 (with ``Allow``), a
body over the limit 413. A bug is a 500 with no traceback in the answer (it goes to the
server's log): no request, however bad, gets one, and the next request is served as usual.
``openapi.py`` publishes what each route really answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import protocol
from .async_llm import AsyncLLM, EngineDeadError
from .kv_events_config import KVEventsConfig, KVEventSource, event_sources
from .limits import RequestSizeLimit
from .metrics import Metrics
from .openapi import documented, publish_schema
from .options import MAX_REQUEST_BYTES
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from .responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import EventStream, OpenAIServing
from .serving_models import ServedModel
from .serving_render import OpenAIServingRender
from .serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("serve")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def build_app(
    llm: AsyncLLM,
    served: ServedModel,
    metrics: Metrics,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    kv_events: KVEventsConfig | None = None,
) -> FastAPI:
    """The app over a running ``llm`` (``build_async_engine_client`` started it)."""
    app = FastAPI(title="Paged Prefix Cache: an OpenAI-compatible server", version="1")
    add_error_handlers(app)
    app.include_router(open_router(llm, metrics, kv_events))
    app.include_router(guarded_router(llm, served, api_key))
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    publish_schema(app)
    return app


def open_router(llm: AsyncLLM, metrics: Metrics, kv_events: KVEventsConfig | None) -> APIRouter:
    """``/health``, ``/metrics`` and ``/kv_event_sources``: no key, as in vLLM."""
    router = APIRouter()

    @router.get("/health", **documented(None, 503, empty=True))
    async def health() -> Response:
        if llm.dead is not None:
            return error_response(OpenAIError(503, f"the engine failed: {llm.dead}"))
        return Response(status_code=200)

    @router.get("/metrics", **documented(None, prometheus=True))
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @router.get("/kv_event_sources", **documented(dict[str, KVEventSource]))  # type: ignore
    async def kv_event_sources() -> Response:
        return JSONResponse(event_sources(kv_events))

    return router


def guarded_router(llm: AsyncLLM, served: ServedModel, api_key: str | None) -> APIRouter:
    """Every route that generates, tokenizes or changes the server's state: behind the key."""
    completion, chat = OpenAIServingCompletion(llm, served), OpenAIServingChat(llm, served)
    tokenization = OpenAIServingTokenization(llm, served)
    guard = [Depends(key_check(api_key))] if api_key is not None else []
    router = APIRouter(dependencies=guard)
    keyed = (401,) if api_key is not None else ()

    card = ModelCard(  # "created": when the server started
        id=served.name,
        created=int(time.time()),
        owned_by="paged-prefix-cache",
        max_model_len=served.max_model_len,
    )

    @router.get("/v1/models", **documented(ModelList, *keyed))
    async def models() -> Response:
        return json_response(ModelList(data=[card]))

    @router.post(
        "/v1/completions",
        **documented(CompletionResponse, 400, *keyed, 404, 413, 503,
                     body=CompletionRequest, stream=True),
    )  # fmt: skip
    async def completions(request: Request) -> Response:
        return await respond(request, completion, await parse(request, CompletionRequest))

    @router.post(
        "/v1/chat/completions",
        **documented(ChatCompletionResponse, 400, *keyed, 404, 413, 503,
                     body=ChatCompletionRequest, stream=True),
    )  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return await respond(request, chat, await parse(request, ChatCompletionRequest))

    @router.post(
        "/tokenize",
        **documented(TokenizeResponse, 400, *keyed, 404, 413,
                     body=TokenizeRequest),
    )  # fmt: skip
    async def tokenize(request: Request) -> Any:
        body = await parse(request, TokenizeRequest)
        return json_response(await tokenization.create_tokenize(body))

    @router.post(
        "/detokenize",
        **documented(DetokenizeResponse, 400, *keyed, 404, 413,
                     body=DetokenizeRequest),
    )  # fmt: skip
    async def detokenize(request: Request) -> Any:
        body = await parse(request, DetokenizeRequest)
        return json_response(await tokenization.create_detokenize(body))

    @router.post("/reset_prefix_cache", **documented(None, *keyed, 409, 413, empty=True))
    async def reset_prefix_cache() -> Response:
        if not await llm.call("reset_prefix_cache"):
            raise OpenAIError(
                409,
                "requests are running: the prefix cache is reset only when none is (their "
                "blocks are in it); try again once they finished",
                code="requests_running",
            )
        return Response(status_code=200)

    add_render_routes(router, OpenAIServingRender(completion, chat), keyed)
    return router


def add_render_routes(router: APIRouter, render: OpenAIServingRender, keyed: tuple) -> None:
    """The generating endpoints' ``/render`` twins: a prompt's token ids without the run,
    what a prefix-aware router routes by (``serving_render.py``)."""

    @router.post(
        "/v1/completions/render",
        **documented(list[GenerateRequest], 400, *keyed, 404, 413,
                     body=CompletionRequest),
    )  # fmt: skip
    async def render_completion(request: Request) -> Any:
        body = await parse(request, CompletionRequest)
        return json_response(await render.render_completion(body))

    @router.post(
        "/v1/chat/completions/render",
        **documented(GenerateRequest, 400, *keyed, 404, 413,
                     body=ChatCompletionRequest),
    )  # fmt: skip
    async def render_chat(request: Request) -> Any:
        body = await parse(request, ChatCompletionRequest)
        return json_response(await render.render_chat(body))


def key_check(api_key: str) -> Any:
    """The dependency that wants ``Authorization: Bearer KEY`` (declared as a bearer scheme
    in the schema); the comparison takes the same time whatever the key's first wrong byte."""
    bearer = Depends(HTTPBearer(auto_error=False, description="the server's --api-key"))

    def check_key(credentials: HTTPAuthorizationCredentials | None = bearer) -> None:
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise OpenAIError(
                401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key"
            )

    return check_key


async def parse(request: Request, model: type[M]) -> M:
    """The body as ``model``, whatever its ``Content-Type`` says (``curl -d`` says a form);
    a body that is not JSON, or not the model's, is a 400 that names the field."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise protocol.validation_error(list(exc.errors())) from None


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
    return json_response(answer)


def json_response(body: BaseModel | Sequence[BaseModel]) -> JSONResponse:
    """A response model (or a list of them) as JSON."""
    if not isinstance(body, BaseModel):
        return JSONResponse([model.model_dump() for model in body])
    return JSONResponse(body.model_dump())


async def server_sent_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    async for chunk in chunks:
        data = json.dumps(chunk.model_dump(), ensure_ascii=False, separators=(",", ":"))
        yield f"data: {data}\n\n"
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

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # a 405's ``Allow`` header names the methods the path takes: kept
        return error_response(OpenAIError(exc.status_code, str(exc.detail)), exc.headers)

    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(OpenAIError(500, str(exc)))

    async def bug(request: Request, exc: Exception) -> Response:
        logger.exception("a bug answered 500", exc_info=exc)
        return error_response(OpenAIError(500, f"internal server error ({type(exc).__name__})"))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(Exception, bug)


def error_response(error: OpenAIError, headers: Any = None) -> JSONResponse:
    body = error.response().model_dump()
    return JSONResponse(body, status_code=error.status, headers=headers)
