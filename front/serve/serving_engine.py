"""What the generating endpoints share (vLLM's ``serving_engine.py``): ``OpenAIServing``, the
base of ``serving_completion.py``, ``serving_chat.py`` and ``serving_tokenization.py``.

A generating endpoint does the same things. Check the model's name. Turn the prompts into
token ids (the subclass's ``engine_prompts``: a completion may bring several). Make each
prompt's ``SamplingParams``, with the checkpoint's ``generation_config.json`` filling what the
request leaves out, as vLLM does. Queue ``n`` requests per prompt on the ``AsyncLLM``. Then
hand back the endpoint's response (``responses.py``: ``response_class``, ``chunk_class``), with
the choices the answer builds (``output_processor.py``): whole, or an ``EventStream`` of
chunks.

Nothing slow runs on the event loop, where every client's stream is written: tokenizing, the
chat template and the core's checks (they read every token) run on a thread of their own
(``run``), as vLLM runs its tokenizer on a one-thread executor (``make_async`` over
``_tokenizer_executor``); detokenizing runs on another (``detokenizer_thread``), so that a stream's
text never waits behind a long prompt. (vLLM detokenizes in its output handler, a task on the
loop that yields between chunks of outputs.) The Rust tokenizer lets go of the GIL
(``TextCodec.encode_text``), so a 1 MB prompt being tokenized stalls nobody.

The core's checks run there once: the checked requests (``common.inputs.Request``) are what
the engine core queues, unchecked again (the engine's ``add_checked_request``).

``n`` choices of one prompt are ``n`` requests of their own, as vLLM's ``ParentRequest`` makes
them: with a ``seed``, choice ``i`` gets ``seed + i`` (so the same request gives the same ``n``
answers every time); the first computes the prompt and the others adopt its blocks through the
prefix cache (requests that start together leapfrog through a shared prefix).

No HTTP here: the routes (``api_server.py``) write the response as JSON or the chunks as
server-sent events, watch for a client that leaves, and turn ``OpenAIError`` into its status.
Every refusal is an ``OpenAIError`` naming the field. The engine's own checks raise
``RequestError`` with the engine's parameter name in ``param``; ``ENGINE_PARAMS`` maps it onto
the request's field, so no message text is ever parsed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from common.errors import ContextLengthError, RequestError, one_line
from common.inputs import Request
from common.sampling_params import SamplingParams

from .async_llm import AsyncLLM
from .output_processor import Answer
from .protocol import OpenAIError, SamplingRequest
from .responses import AnswerEnvelope, new_id
from .serving_models import EnginePrompt, ServedModel

DEFAULT_MAX_TOKENS = 16  # a completion's, when the request gives none (OpenAI's and vLLM's)
LONG_PROMPT = 2**16  # tokens: past it, what tokenizing freed is handed back at once
T = TypeVar("T")


@dataclass(frozen=True)
class EventStream:
    """A streamed answer: its chunks as they come, and ``close``, which the route calls once
    the response ends, however it ended (a client gone before the first chunk too)."""

    chunks: AsyncIterator[BaseModel]  # the endpoint's chunks (or, last, an ErrorResponse)
    close: Callable[[], None]


class OpenAIServing:
    """One endpoint over one ``AsyncLLM``: what a subclass leaves to this base."""

    id_prefix = ""  # the answers' ids: "cmpl-...", "chatcmpl-..."
    response_class: type[AnswerEnvelope]  # a whole answer (``responses.py``)
    chunk_class: type[AnswerEnvelope]  # a streamed chunk

    def __init__(self, llm: AsyncLLM, model: ServedModel) -> None:
        self.llm = llm
        self.model = model
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.detokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="detokenizer")

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the tokenizer's thread: the event loop serves everyone meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, work, *args)

    def tokenized(self, request: Any) -> list[EnginePrompt]:
        """``engine_prompts``, on the tokenizer's thread; after a long prompt, the memory its
        tokenizing freed is handed back to the system (``release_freed_memory``)."""
        prompts = self.engine_prompts(request)
        if sum(len(prompt.ids) for prompt in prompts) > LONG_PROMPT:
            release_freed_memory()
        return prompts

    # ---- what each endpoint says for itself -------------------------------------------------

    def engine_prompts(self, request: Any) -> list[EnginePrompt]:
        """The request's prompts as token ids (on the worker thread)."""
        raise NotImplementedError

    def default_max_tokens(self, prompt: EnginePrompt) -> int:
        return DEFAULT_MAX_TOKENS

    # ---- the request in -----------------------------------------------------------------------

    async def create(self, request: SamplingRequest) -> AnswerEnvelope | EventStream:
        """The response to ``request``: whole, or an ``EventStream`` when it asks to stream. A
        whole answer waited for and then abandoned (the client left) is aborted."""
        self.check_model(request)
        check_best_of(request)
        logprobs = request.logprobs_asked()  # type: ignore[attr-defined]
        prompts = await self.run(self.tokenized, request)
        requests = await self.requests_for(request, prompts, logprobs)
        answer = Answer(self.llm, self.model, request, prompts, logprobs, self.detokenizer_thread)
        try:
            answer.start(requests)
        except BaseException:  # the engine failed half-way: what was queued goes
            answer.abort()
            raise
        request_id = new_id(self.id_prefix)
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            return EventStream(self.chunks(request_id, answer, usage), answer.abort)
        try:
            choices = await answer.whole()
        finally:
            answer.abort()  # a no-op unless the wait was cancelled: the client left
        name = self.model.name
        return self.response_class(id=request_id, model=name, choices=choices, usage=answer.usage())

    async def chunks(
        self, request_id: str, answer: Answer, include_usage: bool
    ) -> AsyncIterator[BaseModel]:
        """A chunk per streamed choice, then the usage if asked for; an engine that fails ends
        the chunks with an error."""
        name = self.model.name
        try:
            async with aclosing(answer.streamed()) as choices:
                async for choice in choices:
                    yield self.chunk_class(id=request_id, model=name, choices=[choice])
        except Exception as exc:  # the engine failed: say so in the stream
            yield OpenAIError(500, str(exc)).response()
            return
        if include_usage:
            yield self.chunk_class(id=request_id, model=name, choices=[], usage=answer.usage())

    async def requests_for(
        self, request: SamplingRequest, prompts: list[EnginePrompt], logprobs: int | None
    ) -> list[list[Request]]:
        """Each prompt's ``n`` requests, every prompt checked by the core (on the worker
        thread) before any is queued: a bad one leaves the engine untouched. The ``n``
        differ in their seeds alone, which the checks do not read."""
        eos = None if request.ignore_eos else self.model.codec.eos_token_ids
        per_prompt = []
        for prompt in prompts:
            params = self.sampling_params(request, prompt, logprobs)
            try:
                checked = await self.run(self.llm.check, prompt.ids, params, eos)
            except RequestError as exc:
                raise openai_error(exc, prompt.field) from None
            children = [child_params(params, i) for i in range(request.n)]
            per_prompt.append([replace(checked, sampling_params=p) for p in children])
        return per_prompt

    def check_model(self, request: Any) -> None:
        if request.model is not None and request.model != self.model.name:
            raise OpenAIError(
                404,
                f"the model {request.model!r} does not exist: this server serves "
                f"{self.model.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self, request: SamplingRequest, prompt: EnginePrompt, logprobs: int | None = None
    ) -> SamplingParams:
        """The request's fields over the checkpoint's defaults; ``logprobs``: alternatives per
        token to report (None: none), and the prompt's too when it is echoed."""
        max_tokens = request.max_tokens_asked()
        if max_tokens is None:
            max_tokens = self.default_max_tokens(prompt)
        elif max_tokens == 0:  # echo alone (``Answer.echo_only``): the engine makes one token
            max_tokens = 1  # that nobody sees, as vLLM's echo_without_generation does
        given = {name: getattr(request, name) for name in SAMPLING_FIELDS}
        given["logprobs"] = logprobs
        if logprobs is not None and request.echo:
            given["prompt_logprobs"] = logprobs  # vLLM's: echo with logprobs scores the prompt
        chosen = {name: value for name, value in given.items() if value is not None}
        try:
            return SamplingParams(
                max_tokens=max_tokens, **{**self.model.sampling_defaults, **chosen}
            )
        except RequestError as exc:
            raise openai_error(exc, prompt.field) from None


# The request's fields that are ``SamplingParams``' own, under the same names (vLLM's).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens",
)  # fmt: skip


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s params, as vLLM's ``ParentRequest`` derives them: with a seed, its
    own ``seed + index``; without, the engine gives each child a seed of its own."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)


def check_best_of(request: SamplingRequest) -> None:
    """``best_of`` ranks candidates by their likelihood and answers the best ``n``; this server
    ranks nothing, so it takes ``best_of`` only as ``n`` (vLLM's newer engine takes none)."""
    if request.best_of is not None and request.best_of != request.n:
        raise OpenAIError(
            400,
            f"best_of={request.best_of} is supported only equal to n ({request.n}): this "
            "server does not rank candidates",
            param="best_of",
        )


def release_freed_memory() -> None:
    """glibc keeps what a thread freed in that thread's arena, for its next allocations: after
    a prompt of a million characters, a hundred MiB or more that the tokenizer no longer uses
    (the server grew by that much per long prompt). ``malloc_trim`` hands it back to the
    system; elsewhere than glibc, nothing is done."""
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


# ---- errors --------------------------------------------------------------------------------------

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
