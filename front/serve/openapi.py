"""The published schema (``/openapi.json``) says what the server does: each route's answers
with their status, media type and model, and each request body's fields with their real types
and bounds. A schema fuzzer (schemathesis, in the suite) holds the server to it.

FastAPI documents what it parses itself; the routes here read their bodies themselves (any
``Content-Type``), so ``documented`` declares each route's body and answers, and
``publish_schema`` adds the request models and drops what FastAPI would have said for its own
parsing (a 422 the server never answers: a bad body is a 400, as in OpenAI and vLLM).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.responses import PlainTextResponse, Response

from .protocol import ErrorResponse

REF = "#/components/schemas/{model}"
WHY = {
    400: "a bad field, named by the error's param",
    401: "the API key is missing or wrong (--api-key)",
    404: "no such model (or path)",
    409: "requests are running (their blocks are in the cache)",
    413: "the body is over --max-request-bytes",
    503: "the engine failed, or the server is stopping",
}
# One event of a streamed answer: its data, a chunk's JSON (the answer's shape, ``choices``
# with ``delta`` or ``text``), and last ``[DONE]``.
SERVER_SENT_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
REQUEST_MODELS: list[type[BaseModel]] = []  # the bodies the routes declare, for the schema


def documented(
    model: type[BaseModel] | None,
    *errors: int,
    body: type[BaseModel] | None = None,
    stream: bool = False,
    empty: bool = False,
    prometheus: bool = False,
) -> dict[str, Any]:
    """A route's keyword arguments that describe it: its 200 (``model`` as JSON, with server
    -sent events too when it can ``stream``, or an ``empty`` body, or Prometheus text), its
    errors in OpenAI's shape, and its JSON ``body``."""
    responses: dict[int | str, Any] = {
        code: {"model": ErrorResponse, "description": WHY[code]} for code in errors
    }
    ok: dict[str, Any] = {"description": "the answer"}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": SERVER_SENT_EVENT}}
    responses[200] = ok
    kwargs: dict[str, Any] = {"responses": responses}
    if model is not None:
        kwargs["response_model"] = model
    if empty:
        kwargs["response_class"] = Response
    if prometheus:
        kwargs["response_class"] = PlainTextResponse
    if body is not None:
        REQUEST_MODELS.append(body)
        schema = {"$ref": REF.format(model=body.__name__)}
        content = {"application/json": {"schema": schema}}
        kwargs["openapi_extra"] = {"requestBody": {"required": True, "content": content}}
    return kwargs


def publish_schema(app: FastAPI) -> None:
    """``app.openapi()`` with the request models in its components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_MODELS:
                described = model.model_json_schema(ref_template=REF)
                components.update(described.pop("$defs", {}))
                components[model.__name__] = described
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
