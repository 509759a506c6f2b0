"""What a request may hold, and what an error looks like (vLLM's
``vllm/entrypoints/openai/protocol.py``, the part this server speaks; the answers' shapes are in
``responses.py``, the error's here).

Requests are pydantic models in strict mode, so ``"max_tokens": true`` or ``"temperature":
"hot"`` is refused rather than read as 1 or as an error deeper down, and every bound a field has
is declared on it: the published schema (``/openapi.json``) says what the server takes. An
integer may be written as a float with no fractional part (``"max_tokens": 2.0``, a seed as
``5819723.0``, token ids): JSON Schema counts it an integer, and so do vLLM's models (pydantic's
lax mode); ``2.5`` is refused, as vLLM refuses it. vLLM's lax mode also reads ``"2"`` and
``true`` as integers, and ``0`` as a boolean: this server refuses them, as its schema says. A field
of the OpenAI API that this server does not do is declared too, with only the values that ask
for nothing (``tools: []``, ``tool_choice: "auto"`` without tools, ``suffix: ""``...); any other
value is refused with a 400 that names it (``REFUSED``). Fields nobody knows are ignored, as
vLLM and OpenAI do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

from common.sampling_params import MAX_SEED

MAX_N = 128  # the most choices one request may ask for (OpenAI's limit)
MAX_LOGPROBS = 20  # the most alternatives per token (vLLM's default --max-logprobs)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


class OpenAIError(Exception):
    """An error as OpenAI's API answers it: the HTTP status and an ``ErrorResponse``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        body = ErrorBody(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=body)


# ---- the pieces of a request ---------------------------------------------------------------


def integral(value: Any) -> Any:
    """A float with no fractional part (``2.0``) as the integer it is: JSON Schema's "integer"
    takes it, and so does vLLM's lax pydantic. Anything else is left to the strict check."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def exact_bool(value: Any) -> Any:
    """A boolean only: a ``Literal[True]`` or ``Literal[False]`` alone takes ``1`` and ``0`` (and
    ``1.0``), which equal them in Python, and the schema does not."""
    if type(value) is not bool:
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


def integer(**bounds: int) -> Any:
    """An integer field's type, written 2 or 2.0 (``integral``), within ``bounds`` (``ge``,
    ``le``, ...: declared before the conversion, so that the schema says ``minimum``...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(integral)]


TokenId = integer(ge=0)
OnlyTrue = Annotated[Literal[True], BeforeValidator(exact_bool)]
OnlyFalse = Annotated[Literal[False], BeforeValidator(exact_bool)]
StopString = Annotated[str, Field(min_length=1)]
TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]},
    },
    "required": ["role", "content"],
}
# A conversation, checked by the chat template's side (``codec.check_messages``), whose
# messages name the message that is wrong; the schema says the same.
Messages = Annotated[list[Any], WithJsonSchema({"type": "array", "items": MESSAGE, "minItems": 1})]
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
        },
    ]
}
Prompts = list[str] | list[list[int]]  # a completion's prompts, one or more


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False  # a last chunk with the usage, as OpenAI sends it


class TextFormat(BaseModel):
    type: Literal["text"]  # the only ``response_format`` that asks for nothing


# Fields of the OpenAI API (and vLLM's) that this server does not do: declared with only the
# values that ask for nothing, so that any other is refused by name.
REFUSED = (
    "suffix", "tools", "tool_choice", "functions", "function_call", "response_format",
    "logit_bias", "modalities", "audio", "prediction", "echo", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs", "use_beam_search", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "skip_special_tokens",
    "add_special_tokens", "max_completion_tokens",
)  # fmt: skip


# pydantic's errors for a refused field's value of the right type (a non-empty list, ...).
ASKING_SOMETHING = ("literal_error", "none_required", "too_long")


class SamplingRequest(BaseModel):
    """The fields both generating endpoints share: the model, the sampling, the stop
    conditions, the number of choices, streaming."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: ignored
    model: str | None = None  # None: the one model this server serves
    max_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0)  # None: generation_config's, else 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None  # vLLM's extension; 0 or -1: all tokens
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension
    seed: integer(ge=0, lt=MAX_SEED) | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    min_tokens: integer(ge=0) | None = None  # vLLM's extension
    stop: StopString | list[StopString] | None = None
    include_stop_str_in_output: bool = False  # vLLM's extension
    stop_token_ids: list[TokenId] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks use it)
    n: integer(ge=1, le=MAX_N) = 1
    best_of: integer(ge=1, le=MAX_N) | None = None  # only as n: this server ranks nothing
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False  # the prompt before the answer (with logprobs: the prompt's too)
    # asked for nothing only (``REFUSED``)
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none", "auto"] | None = None
    functions: list[Any] | None = Field(None, max_length=0)
    function_call: Literal["none", "auto"] | None = None
    response_format: TextFormat | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    prediction: None = None
    guided_json: None = None
    guided_regex: None = None
    guided_choice: None = None
    guided_grammar: None = None
    structured_outputs: None = None
    use_beam_search: OnlyFalse = False
    prompt_logprobs: None = None  # completions: echo with logprobs gives them
    allowed_token_ids: None = None
    bad_words: list[Any] | None = Field(None, max_length=0)
    truncate_prompt_tokens: None = None
    skip_special_tokens: OnlyTrue = True

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt (or several) continued."""

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # alternatives per token
    # 0: with echo only, the prompt (and with logprobs its log-probabilities) and no answer:
    # vLLM's ``echo_without_generation``, how older scoring scripts ask
    max_tokens: integer(ge=0) | None = None
    suffix: Literal[""] | None = None
    add_special_tokens: OnlyTrue = True  # vLLM's: a string prompt gets its BOS
    # chat's name for max_tokens, which vLLM's completions do not take (they ignore it)
    max_completion_tokens: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Prompts:
        return as_prompts(prompt)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def max_tokens_asked(self) -> int | None:
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                400,
                "max_tokens=0 asks for no answer: it is taken with echo only (the prompt, and "
                "with logprobs its log-probabilities)",
                param="max_tokens",
            )
        return self.max_tokens


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation answered."""

    messages: Messages
    max_completion_tokens: integer(ge=1) | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # with logprobs: true
    echo: OnlyFalse = False  # vLLM's: the last message echoed; not done here
    add_special_tokens: OnlyFalse = False  # the template writes them

    def max_tokens_asked(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or a conversation in the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None  # None: a prompt's yes, a conversation's no
    add_generation_prompt: bool = True  # a conversation ends with the assistant's header
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[TokenId]


def as_prompts(prompt: Any) -> Prompts:
    """A completion's ``prompt`` as a list of prompts: a string, a list of strings, token ids
    or a list of token-id lists (OpenAI's four forms); anything else, or an empty one, is
    refused, saying which form was meant. A token id may be written ``5.0`` (``integral``)."""
    forms = "a string, a list of strings, token ids or a list of token-id lists"
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        got = "an empty list" if prompt == [] else type(prompt).__name__
        raise ValueError(f"prompt must be {forms}, got {got}")
    prompt = [[integral(t) for t in p] if isinstance(p, list) else integral(p) for p in prompt]
    if all(type(t) is int for t in prompt):
        prompt = [prompt]
    if all(isinstance(p, str) for p in prompt):
        if "" in prompt:
            raise ValueError(f"prompt {prompt.index('') + 1} is empty: give it some text")
        return prompt
    for i, ids in enumerate(prompt, 1):
        if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError(f"prompt {i} is not a non-empty list of token ids (ints >= 0)")
    return prompt


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """pydantic's (or FastAPI's) list of errors as one 400 that names the field; a field this
    server does not do says so."""
    first = errors[0]
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    first = max(same_field, key=lambda e: len(e.get("loc", ())))  # a union's deepest: its item
    loc = [str(part) for part in first.get("loc", ()) if is_name(part)]
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {message}")
    if not loc:
        return OpenAIError(400, f"the body must be a JSON object: {message}")
    if loc[0] in REFUSED and first.get("type") in ASKING_SOMETHING:
        value = first.get("input")
        return OpenAIError(
            400,
            f"{loc[0]}={value!r} is not supported by this server (docs/serving.md: the fields)",
            param=loc[0],
        )
    return OpenAIError(400, f"{'.'.join(loc)}: {message}", param=loc[0])


TYPE_TAGS = (
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
)  # how pydantic names a union's arm


def is_name(part: object) -> bool:
    """A part of an error's location that names a field or an index (not a union's arm)."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text not in TYPE_TAGS and not any(c in text for c in "[-")
