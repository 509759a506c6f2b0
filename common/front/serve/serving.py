"""From an OpenAI request to the engine and back: ``/v1/completions`` and
``/v1/chat/completions`` (vLLM's ``serving_completion.py`` and ``serving_chat.py``).

Both endpoints do the same five things. Check the model's name and the fields this server
does not implement. Turn the prompt into token ids: a completion's text as ``generate_text``
tokenizes it, a chat's messages through the checkpoint's chat template, so that
``temperature: 0`` gives exactly ``generate_text``'s answer. Make the ``SamplingParams``, with
the checkpoint's ``generation_config.json`` filling what the request leaves out, as vLLM
does. Queue the request on the ``AsyncLLM``. Then answer at once, or stream the text as
server-sent events, each piece whole (``IncrementalDetokenizer``), ending with
``data: [DONE]``.

Every refusal is an ``OpenAIError`` naming the field. The engine's own checks raise
``RequestError`` with the engine's parameter name in ``param``; ``ENGINE_PARAMS`` maps it onto
the request's field, so no message text is ever parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...errors import ContextLengthError, RequestError, one_line
from ...sampling import RequestOutput, SamplingParams
from ..stream import IncrementalDetokenizer, answer_ids
from ..text import TextCodec
from . import protocol
from .async_llm import AsyncLLM, RequestStream
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, SamplingRequest

DEFAULT_MAX_TOKENS = 16  # a completion's, when the request gives none (OpenAI's and vLLM's)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """What the server knows of its checkpoint, loaded once: its name, its text side (the
    tokenizer, the chat template, the eos ids), and what a request falls back on."""

    name: str
    codec: TextCodec
    max_model_len: int | None
    sampling_defaults: dict[str, Any]  # generation_config.json's temperature, top_p, top_k


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    field: str  # the request's field it came from: "prompt" or "messages"


class OpenAIServing:
    """The two generating endpoints over one ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, model: ServedModel) -> None:
        self.llm = llm
        self.model = model
        self.created = int(time.time())  # /v1/models' "created"

    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        self.check_request(request)
        return await self.serve(request, raw, self.completion_prompt(request.prompt), chat=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> Response:
        self.check_request(request)
        return await self.serve(request, raw, self.chat_prompt(request.messages), chat=True)

    # ---- the request in -----------------------------------------------------------------------

    def check_request(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model != self.model.name:
            raise OpenAIError(
                404,
                f"the model {request.model!r} does not exist: this server serves "
                f"{self.model.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        unsupported = protocol.unsupported_field(request)
        if unsupported is not None:
            raise unsupported

    def completion_prompt(self, prompt: Any) -> Prompt:
        """A string, tokenized as ``generate_text`` does a plain prompt, or token ids."""
        if isinstance(prompt, str):
            return Prompt(self.model.codec.completion_ids(prompt), "prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return Prompt(prompt, "prompt")
        raise OpenAIError(
            400,
            "prompt must be a string or a list of token ids (one prompt per request), got "
            f"{type(prompt).__name__}",
            param="prompt",
        )

    def chat_prompt(self, messages: list[Any]) -> Prompt:
        """The conversation in the checkpoint's chat markup, ending with the assistant's
        header: the ids ``generate_text`` gives the same messages."""
        if self.model.codec.template is None:
            raise OpenAIError(
                400,
                "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): use /v1/completions",
                param="messages",
            )
        try:
            conversation = [text_only(message, i) for i, message in enumerate(messages, 1)]
            return Prompt(self.model.codec.chat_ids(conversation), "messages")
        except ValueError as exc:  # a bad message, or the template refused it
            raise OpenAIError(400, one_line(exc), param="messages") from None

    def sampling_params(
        self, request: SamplingRequest, prompt: Prompt, chat: bool
    ) -> SamplingParams:
        """The request's fields over the checkpoint's defaults."""
        max_tokens = request.max_tokens_asked()
        if max_tokens is None:
            max_tokens = self.default_max_tokens(prompt, chat)
        given = {
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "seed": request.seed,
            "stop_token_ids": request.stop_token_ids,
        }
        chosen = {name: value for name, value in given.items() if value is not None}
        try:
            return SamplingParams(
                max_tokens=max_tokens, **{**self.model.sampling_defaults, **chosen}
            )
        except RequestError as exc:
            raise openai_error(exc, prompt.field) from None

    def default_max_tokens(self, prompt: Prompt, chat: bool) -> int:
        """vLLM's: a completion makes 16 tokens, a chat answer may fill what the context has
        left (at least one: a prompt that fills it all is then refused, with the numbers)."""
        limit = self.model.max_model_len
        if not chat or limit is None:
            return DEFAULT_MAX_TOKENS
        return max(limit - len(prompt.ids), 1)

    # ---- the engine, and the answer out -------------------------------------------------------

    async def serve(
        self, request: SamplingRequest, raw: Request, prompt: Prompt, chat: bool
    ) -> Response:
        params = self.sampling_params(request, prompt, chat)
        eos = None if request.ignore_eos else self.model.codec.eos_token_ids
        try:
            stream = self.llm.add_request(prompt.ids, params, eos)
        except RequestError as exc:
            raise openai_error(exc, prompt.field) from None
        answer = Answer(self.model, protocol.new_id("chatcmpl" if chat else "cmpl"), chat, prompt)
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            events = answer.events(stream, usage)
            # The abort runs after the response, whatever ended it (a no-op for a finished
            # request): also when the client left before the first event was sent.
            done = BackgroundTask(self.llm.abort, stream)
            return StreamingResponse(events, media_type="text/event-stream", background=done)
        try:
            final = await until_disconnected(raw, last_output(stream))
        finally:
            self.llm.abort(stream)  # a no-op unless the client left first
        if final is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
        return JSONResponse(answer.whole(final))


class Answer:
    """One request's answer, whole or as events, in either endpoint's shape."""

    def __init__(self, model: ServedModel, request_id: str, chat: bool, prompt: Prompt) -> None:
        self.model = model
        self.request_id = request_id
        self.chat = chat
        self.prompt = prompt

    def whole(self, final: RequestOutput) -> dict[str, Any]:
        if final.finish_reason == "abort":
            raise OpenAIError(503, "the request was aborted: the server is shutting down")
        text = self.model.codec.decode(answer_ids(final))
        if self.chat:
            kind, choice = "chat.completion", protocol.message_choice(text, final.finish_reason)
        else:
            kind, choice = "text_completion", protocol.text_choice(text, final.finish_reason)
        return protocol.completion(
            kind, self.request_id, self.model.name, choice, self.usage(final)
        )

    async def events(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of text, the last with the finish reason,
        the usage if asked for, then ``[DONE]``."""
        detokenizer = IncrementalDetokenizer(self.model.codec.decode)
        if self.chat:  # OpenAI's first chunk names the role
            yield self.event("", None, role="assistant")
        final = None
        try:
            async for final in stream:
                ids = answer_ids(final)
                piece = detokenizer.finish(ids) if final.finished else detokenizer.update(ids)
                if piece or final.finished:
                    yield self.event(piece, final.finish_reason)
        except Exception as exc:  # the engine failed: say so in the stream, then end it
            yield sse(OpenAIError(500, str(exc)).body())
        else:
            if include_usage and final is not None:
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                usage = self.usage(final)
                yield sse(protocol.completion(kind, self.request_id, self.model.name, {}, usage))
        yield "data: [DONE]\n\n"

    def event(self, piece: str, finish_reason: str | None, role: str | None = None) -> str:
        if self.chat:
            delta = {"role": role, "content": piece} if role else {"content": piece}
            kind, choice = "chat.completion.chunk", protocol.delta_choice(delta, finish_reason)
        else:
            kind, choice = "text_completion", protocol.text_choice(piece, finish_reason)
        return sse(protocol.completion(kind, self.request_id, self.model.name, choice))

    def usage(self, final: RequestOutput) -> dict[str, Any]:
        return protocol.usage(len(self.prompt.ids), len(final.token_ids), final.num_cached_tokens)


# ---- helpers ---------------------------------------------------------------------------------

# The engine's parameter names, as the request calls them (None: not the client's field).
ENGINE_PARAMS = {"max_new_tokens": "max_tokens", "eos_token_id": None, "sampling_params": None}


def openai_error(exc: RequestError, prompt_field: str) -> OpenAIError:
    """The engine's refusal as a 400 that names the request's field."""
    if isinstance(exc, ContextLengthError):
        return OpenAIError(
            400,
            f"this model's maximum context length is {exc.max_model_len} tokens, and the "
            f"request asks for {exc.prompt_tokens + exc.max_tokens}: {exc.prompt_tokens} in "
            f"the {prompt_field} and {exc.max_tokens} max_tokens. Shorten the {prompt_field} "
            "or lower max_tokens",
            param=prompt_field,
            code="context_length_exceeded",
        )
    param = prompt_field if exc.param == "prompt_ids" else ENGINE_PARAMS.get(exc.param, exc.param)
    return OpenAIError(400, one_line(exc), param=param)


def text_only(message: Any, number: int) -> Any:
    """A message whose content is a list of parts (OpenAI's newer form) with its text parts
    joined; any other part is refused: this model reads text only."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message {number}: only text parts are supported, got {kind!r}")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}


async def last_output(stream: RequestStream) -> RequestOutput:
    """The request's final output (a non-streamed answer needs only that one)."""
    outputs = [output async for output in stream if output.finished]
    return outputs[-1]


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client disconnected first (``work`` is cancelled
    then: nobody is left to answer)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
    return None if gone else task.result()


async def wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
