"""What the answers look like: OpenAI's shapes, built as plain dicts where they are made, and
described once as pydantic models for the published schema (``/openapi.json``), which the
suite holds the answers to (a schema fuzzer checks every answer against its model).

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

from pydantic import BaseModel

TokenText = Callable[[int], str]  # one token id's text, special tokens included


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens``: the prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(
    kind: str, request_id: str, model: str, choices: list[dict], usage: dict | None = None
) -> dict[str, Any]:
    """An answer or a streamed chunk of either endpoint: ``kind`` is its ``object``
    (``text_completion``, ``chat.completion``, ``chat.completion.chunk``)."""
    answer: dict[str, Any] = {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        answer["usage"] = usage
    return answer


def choice(index: int, finish_reason: str | None, stop_reason: str | None, **rest: Any) -> dict:
    """One choice: its ``index``, what it holds (``text``, ``message`` or ``delta``, and
    ``logprobs``), and why it ended (vLLM's ``stop_reason``: the stop string, if one did)."""
    return {"index": index, **rest, "finish_reason": finish_reason, "stop_reason": stop_reason}


# ---- log-probabilities -------------------------------------------------------------------------


COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Any | None],
    token_text: TokenText,
    text_offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's legacy shape: each token's text, log-probability, alternatives (with itself)
    and where its text begins, counted from ``text_offset``. An entry (``TokenLogprobs``) is
    None for the prompt's first token, which nothing before it predicts (OpenAI's ``null``)."""
    shaped: dict[str, list] = {key: [] for key in COMPLETION_LOGPROBS}
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = token_text(token_id)
        shaped["tokens"].append(token)
        shaped["text_offset"].append(text_offset)
        text_offset += len(token)
        if entry is None:
            shaped["token_logprobs"].append(None)
            shaped["top_logprobs"].append(None)
            continue
        top = {token_text(t): logprob for t, logprob in entry.top}
        shaped["token_logprobs"].append(entry.logprob)
        shaped["top_logprobs"].append({**top, token: entry.logprob})
    return shaped


def chat_logprobs(entries: Sequence[Any], token_text: TokenText) -> dict[str, Any]:
    """A chat's shape: one object per token, its alternatives as a list."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


# ---- the schema's models (documentation: the answers above are dicts) ---------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class GenerateRequest(BaseModel):
    """A prompt rendered (``/render``): what the engine would be given, vLLM's fields that
    this server fills."""

    request_id: str
    token_ids: list[int]
    model: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str
