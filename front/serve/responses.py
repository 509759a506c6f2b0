"""What the answers look like: OpenAI's shapes, each described once, as a pydantic model. The
server builds its answers from these models, and the published schema (``/openapi.json``) is
derived from them, which the suite holds the answers to (a schema fuzzer checks every answer
against its model).

A whole answer and a streamed chunk share their envelope (``id``, ``object``, ``created``,
``model``, ``choices``, ``usage``); a chunk has a ``usage`` only when it is the last one of a
stream that asked for it (``stream_options.include_usage``), and a chat's ``delta`` a ``role``
only in the first chunk of each choice: a field that is None there is left out, as OpenAI
leaves it out (``exclude_if``). Every other field is always written, ``null`` or not.

Log-probabilities come in two shapes. A completion's (OpenAI's legacy one): four parallel
lists, ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per token: its alternatives
and itself) and ``text_offset`` (where each token's text begins in the choice's text). A
chat's: ``content``, one object per token with its ``top_logprobs`` as a list. Each token is
shown as its own text (``token_text``), as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenText = Callable[[int], str]  # one token id's text, special tokens included
FinishReason = Literal["stop", "length", "abort"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def left_out(value: Any) -> bool:
    """Whether a field that OpenAI leaves out when it has nothing to say is written (None: no)."""
    return value is None


class OpenAIBaseModel(BaseModel):
    """vLLM's base of its answers. The published schema says that every field with a default
    is written all the same (``object``, ``created``), except those left out when None."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int  # the prompt tokens the prefix cache served


class Usage(OpenAIBaseModel):
    """OpenAI's ``usage``: every prompt counted once, however many choices it has."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AnswerEnvelope(OpenAIBaseModel):
    """What every answer and chunk of either endpoint holds around its choices; ``object``
    says which it is (``text_completion``, ``chat.completion``, ``chat.completion.chunk``)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage | None = Field(None, exclude_if=left_out)  # a stream's last chunk, if asked


# ---- log-probabilities -------------------------------------------------------------------------


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Any | None],
    token_text: TokenText,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI's legacy shape: each token's text, log-probability, alternatives (with itself)
    and where its text begins, counted from ``text_offset``. An entry (``TokenLogprobs``) is
    None for the prompt's first token, which nothing before it predicts (OpenAI's ``null``)."""
    tokens: list[str] = []
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = token_text(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        top = {token_text(t): logprob for t, logprob in entry.top}
        logprobs.append(entry.logprob)
        tops.append({**top, token: entry.logprob})
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
    )


def chat_logprobs(entries: Sequence[Any], token_text: TokenText) -> ChatLogprobs:
    """A chat's shape: one object per token, its alternatives as a list."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        TokenLogprob(**one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
        for e in entries
    ]
    return ChatLogprobs(content=content)


# ---- completions ---------------------------------------------------------------------------------


class CompletionChoice(OpenAIBaseModel):
    """A completion's choice, whole or streamed (the same shape): its ``text``; why it ended
    (vLLM's ``stop_reason``: the stop string, if one did), once it did."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | None


class CompletionResponse(AnswerEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(AnswerEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ---- chat completions ----------------------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(OpenAIBaseModel):
    """A whole chat answer's choice: its ``message``."""

    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | None


class ChatCompletionResponse(AnswerEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(OpenAIBaseModel):
    """What a chunk adds to a chat answer's message: the role, in the first chunk only."""

    role: Literal["assistant"] | None = Field(None, exclude_if=left_out)
    content: str


class ChatStreamChoice(OpenAIBaseModel):
    """A streamed chat choice: its ``delta`` (vLLM's ``ChatCompletionResponseStreamChoice``)."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | None


class ChatCompletionStreamResponse(AnswerEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


# ---- the other routes ----------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GenerateRequest(OpenAIBaseModel):
    """A prompt rendered (``/render``): what the engine would be given, vLLM's fields that
    this server fills."""

    request_id: str
    token_ids: list[int]
    model: str


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
