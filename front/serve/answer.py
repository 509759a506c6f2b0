"""One request's answer as it grows (vLLM's output processor, the part a server needs): its
choices, each a request in the engine, read from their streams; the text made on the worker
thread; stop strings applied; the answer whole or chunk by chunk, in its endpoint's shape.

A choice whose text reaches a stop string ends there: its request is aborted in the engine
(as vLLM's detokenizer finds the string and its output processor aborts the request), so no
block is held for tokens nobody reads, and ``/metrics`` counts it as "stop". The tokens it
counts are those up to the one that completed the string, as in vLLM.

``usage`` counts each prompt once, however many choices it has (OpenAI's rule), and so its
``cached_tokens``: what the prefix cache served the prompt's choices, averaged over them. The
``n`` choices of a new prompt compute each of its full blocks once between them and adopt it
``n - 1`` times: ``(n - 1) / n`` of them shows as cached. (vLLM reports one choice's.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from common.sampling_params import RequestOutput, SamplingParams

from ..stream import IncrementalDetokenizer, StopStrings, answer_ids
from . import responses
from .async_llm import AsyncLLM, RequestStream
from .protocol import OpenAIError, SamplingRequest
from .serving_models import EnginePrompt, ServedModel

T = TypeVar("T")


class Endpoint(Protocol):
    """What an answer asks of its endpoint (``serving_engine.OpenAIServing`` is one): the
    engine and the model, where to run work off the loop, and the endpoint's shapes."""

    llm: AsyncLLM
    model: ServedModel
    id_prefix: str
    whole_object: str
    chunk_object: str

    async def run_output(self, work: Callable[..., T], *args: Any) -> T: ...

    def whole_choice(self, answer: Answer, choice: Choice) -> dict[str, Any]: ...

    def chunk_choice(
        self, answer: Answer, choice: Choice, piece: str, ids: list[int], entries: list[Any]
    ) -> dict[str, Any]: ...

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]: ...


class Choice:
    """One choice: its request's stream, its text so far, its tokens' log-probabilities."""

    def __init__(
        self, index: int, prompt: EnginePrompt, stream: RequestStream, text: IncrementalDetokenizer
    ) -> None:
        self.index = index  # OpenAI's: prompt i's choice j is i * n + j
        self.prompt = prompt
        self.stream = stream
        self.text = text
        self.output: RequestOutput | None = None
        self.entries: list[Any] = []  # TokenLogprobs, one per generated token (when asked)
        self.prompt_entries: list[Any] | None = None  # the prompt's (echo with logprobs)
        self.sent = 0  # entries already streamed
        self.echoed = False  # the prompt already streamed (echo)
        self.text_offset = 0  # where the next streamed token's text begins (logprobs)

    @property
    def stop_reason(self) -> str | None:
        return self.text.stop_reason

    @property
    def done(self) -> bool:
        return self.stop_reason is not None or bool(self.output and self.output.finished)

    @property
    def finish_reason(self) -> str | None:
        if self.stop_reason is not None:
            return "stop"
        return self.output.finish_reason if self.output is not None else None

    @property
    def num_tokens(self) -> int:
        """Tokens generated, the eos included, up to the one that completed a stop string."""
        if self.output is None:
            return 0
        return self.text.num_tokens if self.stop_reason else len(self.output.token_ids)

    @property
    def token_ids(self) -> list[int]:
        return [] if self.output is None else list(self.output.token_ids[: self.num_tokens])

    def read(self, output: RequestOutput, logprobs: bool, prompt_logprobs: bool) -> str:
        """Take one output (on the worker thread): the text it adds."""
        self.output = output
        if logprobs:
            self.entries.extend(output.logprobs or ())
        if prompt_logprobs and output.prompt_logprobs is not None:
            self.prompt_entries = list(output.prompt_logprobs)
        ids = answer_ids(output)
        return self.text.finish(ids) if output.finished else self.text.update(ids)

    def new_entries(self) -> tuple[list[int], list[Any]]:
        """The tokens (and their log-probabilities) not streamed yet."""
        end = self.num_tokens
        ids, entries = self.token_ids[self.sent : end], self.entries[self.sent : end]
        self.sent = end
        return ids, entries


class Answer:
    """A request's choices, whole or as chunks, in its endpoint's shape."""

    def __init__(
        self,
        serving: Endpoint,
        request: SamplingRequest,
        prompts: list[EnginePrompt],
        logprobs: int | None,
    ) -> None:
        self.serving = serving
        self.request = request
        self.prompts = prompts
        self.logprobs = logprobs is not None
        self.echo = request.echo
        self.request_id = responses.new_id(serving.id_prefix)
        self.choices: list[Choice] = []

    def start(self, params: list[list[SamplingParams]]) -> None:
        """Queue every choice's request (prompt by prompt, each prompt's ``n`` together)."""
        llm, model = self.serving.llm, self.serving.model
        eos = None if self.request.ignore_eos else model.codec.eos_token_ids
        stop = StopStrings(
            self.request.stop_strings(),
            self.request.include_stop_str_in_output,
            self.request.min_tokens or 0,
        )
        for prompt, children in zip(self.prompts, params, strict=True):
            for child in children:
                stream = llm.add_checked(prompt.ids, child, eos)
                text = IncrementalDetokenizer(model.codec.decode, stop)
                self.choices.append(Choice(len(self.choices), prompt, stream, text))

    def abort(self) -> None:
        """Every choice's request that is still running, aborted (a no-op for the others)."""
        for choice in self.choices:
            self.serving.llm.abort(choice.stream)

    async def read(self, choice: Choice, output: RequestOutput) -> str:
        """``output`` taken in by its choice, off the event loop; a stop string reached ends
        the choice's request in the engine."""
        prompt_logprobs = self.logprobs and self.echo
        piece = await self.serving.run_output(choice.read, output, self.logprobs, prompt_logprobs)
        if choice.stop_reason is not None and not output.finished:
            self.serving.llm.abort(choice.stream, finish_reason="stop")
        return piece

    async def follow(self, choice: Choice) -> AsyncIterator[str]:
        """The pieces of text of one choice, until it is done."""
        async for output in choice.stream:
            yield await self.read(choice, output)
            if choice.done:
                return

    # ---- whole --------------------------------------------------------------------------------

    async def whole(self) -> dict[str, Any]:
        async def drain(choice: Choice) -> None:
            async for _ in self.follow(choice):
                pass

        await asyncio.gather(*(drain(choice) for choice in self.choices))
        if any(choice.finish_reason == "abort" for choice in self.choices):
            raise OpenAIError(503, "the request was aborted: the server is shutting down")
        shaped = [self.serving.whole_choice(self, choice) for choice in self.choices]
        return self.completion(self.serving.whole_object, shaped, self.usage())

    # ---- streamed -----------------------------------------------------------------------------

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """A chunk per piece of text of any choice (the last of each with its finish reason),
        then the usage if asked for; an engine that fails ends the chunks with an error."""
        for shaped in self.serving.first_chunks(len(self.choices)):
            yield self.completion(self.serving.chunk_object, [shaped])
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self.pump(choice, queue)) for choice in self.choices]
        try:
            for _ in self.choices:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        yield OpenAIError(500, str(item)).body()
                        return
                    yield self.completion(self.serving.chunk_object, [item])
            if include_usage:
                yield self.completion(self.serving.chunk_object, [], self.usage())
        finally:
            for task in tasks:
                task.cancel()

    async def pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        """One choice's chunks into ``queue``, then None (or the engine's failure)."""
        try:
            async for piece in self.follow(choice):
                ids, entries = choice.new_entries()
                if piece or entries or choice.done:
                    queue.put_nowait(self.serving.chunk_choice(self, choice, piece, ids, entries))
        except Exception as exc:  # the engine failed: say so in the stream
            queue.put_nowait(exc)
        queue.put_nowait(None)

    # ---- shared -------------------------------------------------------------------------------

    def completion(
        self, kind: str, choices: list[dict], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        model = self.serving.model.name
        return responses.completion(kind, self.request_id, model, choices, usage)

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (OpenAI's rule), and so its cached tokens: what the cache
        served its choices, averaged over them (rounded down)."""
        prompt_tokens = sum(len(prompt.ids) for prompt in self.prompts)
        completion_tokens = sum(choice.num_tokens for choice in self.choices)
        n = len(self.choices) // len(self.prompts)
        served = sum(c.output.num_cached_tokens for c in self.choices if c.output is not None)
        return responses.usage(prompt_tokens, completion_tokens, served // n)

    def echoed_prompt(self, choice: Choice) -> tuple[str, list[int], list[Any]]:
        """The prompt's text, ids and log-probabilities (the first None) before a choice's
        answer, once: nothing when the request does not echo, or it was already sent."""
        if not self.echo or choice.echoed:
            return "", [], []
        choice.echoed = True
        prompt = choice.prompt
        text = (
            prompt.text if prompt.text is not None else self.serving.model.codec.decode(prompt.ids)
        )
        entries = choice.prompt_entries if self.logprobs else None
        return text, prompt.ids, list(entries or [None] * len(prompt.ids))
