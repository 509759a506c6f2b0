"""The OpenAI API's shapes: what a request may hold, what an answer and an error look like
(vLLM's ``vllm/entrypoints/openai/protocol.py``, the part this server speaks).

Requests are pydantic models in strict mode, so ``"max_tokens": true`` or ``"temperature":
"hot"`` is refused rather than read as 1 or as an error deeper down. Fields the API has and
this server does not implement (``n``, ``logprobs``, ``tools``, stop strings...) are refused
when they ask for something (``unsupported_field``), instead of being silently ignored;
fields nobody knows are ignored, as vLLM and OpenAI do.

Answers are plain dicts: a few keys each, written where they are built.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict


class OpenAIError(Exception):
    """An error as OpenAI's API answers it: the HTTP status and
    ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False  # a last chunk with the usage, as OpenAI sends it


class SamplingRequest(BaseModel):
    """The fields both endpoints share: the model, the sampling, streaming."""

    model_config = ConfigDict(strict=True, extra="allow")  # extra fields: unsupported_field
    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = None
    temperature: float | None = None  # None: the checkpoint's generation_config, else 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; 0 or -1: all tokens
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks use it)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: Any  # a string, or token ids (checked by the server, with a clearer message)


class ChatCompletionRequest(SamplingRequest):
    messages: list[Any]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def max_tokens_asked(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# Fields of the OpenAI API that this server does not implement, and the values that ask for
# nothing (a client may send them anyway).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "stop": (None, [], ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


def unsupported_field(request: SamplingRequest) -> OpenAIError | None:
    """A 400 for the first field that asks for what this server does not do, or None."""
    for name, value in (request.model_extra or {}).items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            return OpenAIError(
                400,
                f"{name}={value!r} is not supported by this server (docs/serving.md: what it "
                "leaves out)",
                param=name,
            )
    return None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """pydantic's (or FastAPI's) list of errors as one 400 that names the field."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}")
    if not loc:
        return OpenAIError(400, f"the body must be a JSON object: {first.get('msg')}")
    return OpenAIError(400, f"{'.'.join(loc)}: {first.get('msg')}", param=loc[0])


# ---- answers -------------------------------------------------------------------------------


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
    kind: str, request_id: str, model: str, choice: dict[str, Any], usage: dict | None = None
) -> dict[str, Any]:
    """An answer or a streamed chunk of either endpoint: ``kind`` is its ``object``
    (``text_completion``, ``chat.completion``, ``chat.completion.chunk``)."""
    answer: dict[str, Any] = {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if choice else [],
    }
    if usage is not None:
        answer["usage"] = usage
    return answer


def text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def message_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}


def delta_choice(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
