"""What both generating endpoints share (vLLM's ``serving_engine.py``): ``OpenAIServing``, the
base of ``serving_completion.py`` and ``serving_chat.py``.

An endpoint does the same five things. Check the model's name and the fields this server does
not implement. Turn the prompt into token ids (the subclass's ``engine_prompt``). Make the
``SamplingParams``, with the checkpoint's ``generation_config.json`` filling what the request
leaves out, as vLLM does. Queue the request on the ``AsyncLLM``. Then hand back the answer:
whole, as a dict, or as an ``EventStream`` of chunks, each piece of text whole
(``IncrementalDetokenizer``). The subclass says how its choices look.

No HTTP here: the routes (``api_server.py``) write the dict as JSON or the chunks as
server-sent events, watch for a client that leaves, and turn ``OpenAIError`` into its status.

Every refusal is an ``OpenAIError`` naming the field. The engine's own checks raise
``RequestError`` with the engine's parameter name in ``param``; ``ENGINE_PARAMS`` maps it onto
the request's field, so no message text is ever parsed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from common.errors import ContextLengthError, RequestError, one_line
from common.sampling import RequestOutput, SamplingParams

from ..codec import TextCodec
from ..stream import IncrementalDetokenizer, answer_ids
from . import protocol
from .async_llm import AsyncLLM, RequestStream
from .protocol import OpenAIError, SamplingRequest

DEFAULT_MAX_TOKENS = 16  # a completion's, when the request gives none (OpenAI's and vLLM's)


@dataclass(frozen=True)
class ServedModel:
    """What the server knows of its checkpoint, loaded once: its name, its text side (the
    tokenizer, the chat template, the eos ids), and what a request falls back on."""

    name: str
    codec: TextCodec
    max_model_len: int | None
    sampling_defaults: dict[str, Any]  # generation_config.json's temperature, top_p, top_k


@dataclass(frozen=True)
class EnginePrompt:
    """A request's prompt as the engine takes it (vLLM's name): token ids, and the request's
    field they came from, for the errors to name."""

    ids: list[int]
    field: str  # "prompt" or "messages"


@dataclass(frozen=True)
class EventStream:
    """A streamed answer: its chunks as they come, and ``close``, which the route calls once
    the response ends, however it ended (a client gone before the first chunk too)."""

    chunks: AsyncIterator[dict[str, Any]]
    close: Callable[[], None]


class OpenAIServing:
    """One generating endpoint over one ``AsyncLLM``: what a subclass leaves to this base."""

    id_prefix = ""  # the answers' ids: "cmpl-...", "chatcmpl-..."
    whole_object = ""  # the ``object`` of a whole answer
    chunk_object = ""  # the ``object`` of a streamed chunk

    def __init__(self, llm: AsyncLLM, model: ServedModel) -> None:
        self.llm = llm
        self.model = model

    # ---- what each endpoint says for itself -------------------------------------------------

    def engine_prompt(self, request: Any) -> EnginePrompt:
        raise NotImplementedError

    def default_max_tokens(self, prompt: EnginePrompt) -> int:
        return DEFAULT_MAX_TOKENS

    def whole_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, piece: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any text (a chat's names the role)."""
        return []

    # ---- the request in -----------------------------------------------------------------------

    async def create(self, request: SamplingRequest) -> dict[str, Any] | EventStream:
        """The answer to ``request``: whole, or an ``EventStream`` when it asks to stream. A
        whole answer waited for and then abandoned (the client left) is aborted."""
        self.check_model(request)
        refused = protocol.unsupported_field(request)
        if refused is not None:
            raise refused
        prompt = self.engine_prompt(request)
        params = self.sampling_params(request, prompt)
        eos = None if request.ignore_eos else self.model.codec.eos_token_ids
        try:
            stream = self.llm.add_request(prompt.ids, params, eos)
        except RequestError as exc:
            raise openai_error(exc, prompt.field) from None
        answer = Answer(self, protocol.new_id(self.id_prefix), len(prompt.ids))
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            return EventStream(answer.chunks(stream, usage), lambda: self.llm.abort(stream))
        try:
            return answer.whole(await last_output(stream))
        finally:
            self.llm.abort(stream)  # a no-op unless the wait was cancelled: the client left

    def check_model(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model != self.model.name:
            raise OpenAIError(
                404,
                f"the model {request.model!r} does not exist: this server serves "
                f"{self.model.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, request: SamplingRequest, prompt: EnginePrompt) -> SamplingParams:
        """The request's fields over the checkpoint's defaults."""
        max_tokens = request.max_tokens_asked()
        if max_tokens is None:
            max_tokens = self.default_max_tokens(prompt)
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


class Answer:
    """One request's answer, whole or as chunks, in its endpoint's shape."""

    def __init__(self, serving: OpenAIServing, request_id: str, prompt_tokens: int) -> None:
        self.serving = serving
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens

    def whole(self, final: RequestOutput) -> dict[str, Any]:
        if final.finish_reason == "abort":
            raise OpenAIError(503, "the request was aborted: the server is shutting down")
        text = self.serving.model.codec.decode(answer_ids(final))
        choice = self.serving.whole_choice(text, final.finish_reason)
        return self.completion(self.serving.whole_object, choice, self.usage(final))

    async def chunks(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[dict]:
        """A chunk per piece of text, the last with the finish reason, then the usage if
        asked for; an engine that fails ends the chunks with an error."""
        for choice in self.serving.first_chunks():
            yield self.completion(self.serving.chunk_object, choice)
        detokenizer = IncrementalDetokenizer(self.serving.model.codec.decode)
        final = None
        try:
            async for final in stream:
                ids = answer_ids(final)
                piece = detokenizer.finish(ids) if final.finished else detokenizer.update(ids)
                if piece or final.finished:
                    choice = self.serving.chunk_choice(piece, final.finish_reason)
                    yield self.completion(self.serving.chunk_object, choice)
        except Exception as exc:  # the engine failed: say so in the stream, then end it
            yield OpenAIError(500, str(exc)).body()
            return
        if include_usage and final is not None:
            yield self.completion(self.serving.chunk_object, {}, self.usage(final))

    def completion(
        self, kind: str, choice: dict[str, Any], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return protocol.completion(kind, self.request_id, self.serving.model.name, choice, usage)

    def usage(self, final: RequestOutput) -> dict[str, Any]:
        return protocol.usage(self.prompt_tokens, len(final.token_ids), final.num_cached_tokens)


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


async def last_output(stream: RequestStream) -> RequestOutput:
    """The request's final output (a whole answer needs only that one)."""
    outputs = [output async for output in stream if output.finished]
    return outputs[-1]
