"""``RequestSizeLimit``: a body over ``--max-request-bytes`` is refused before anything reads it
as JSON, and before it is held in memory whole.

An ASGI middleware, outermost: it answers 413 with OpenAI's error JSON at once when the
``Content-Length`` says too much, or when a body sent without one (chunked) streams past the
limit. It then reads the rest of the body and drops it, up to ``DRAIN_BYTES``: a client sends
its whole body before it reads the answer, and would otherwise see a broken connection instead
of the 413. A body that fits is read here, then handed on to the app as it came; whatever the
client sends after it (a disconnect) goes on through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from .protocol import OpenAIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DRAIN_BYTES = 256 * 2**20  # the most of a refused body read and dropped before hanging up


class RequestSizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if declared_length(scope) > self.max_bytes:
            await self.refuse(scope, receive, send, received=0)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.refuse(scope, receive, send, size, message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(chunks), receive), send)

    async def refuse(
        self, scope: Scope, receive: Receive, send: Send, received: int, more: bool = True
    ) -> None:
        """413 now; then the rest of the body read and dropped (up to ``DRAIN_BYTES``)."""
        error = OpenAIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes: the server's "
            "--max-request-bytes",
            code="request_too_large",
        )
        await JSONResponse(error.response().model_dump(), status_code=413)(scope, receive, send)
        while more and received < DRAIN_BYTES:
            message = await receive()
            received += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)


def declared_length(scope: Scope) -> int:
    """The ``Content-Length`` header's value (0 when there is none, or it is not a number:
    the body is then counted as it comes)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read, then whatever comes next."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again
