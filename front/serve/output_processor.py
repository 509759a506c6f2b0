"""One request's answer as it grows (vLLM's output processor, the part a server needs): its
choices, each a request in the engine, read from their streams; the text made on the
detokenizer's thread; stop strings applied; and each choice built in its endpoint's shape,
whole or streamed, in one place (``Answer.choice``). The endpoint (``serving_engine.py``)
starts the answer and puts its choices in the endpoint's response: the flow goes one way.

A choice whose text reaches a stop string ends there: its request is aborted in the engine
(as vLLM's detokenizer finds the string and its output processor aborts the request), so no
block is held for tokens nobody reads, and ``/metrics`` counts it as "stop" (the first abort
decides why a request ended: the answer's own abort at its end changes nothing). The answer
ends once the engine has let the request go, a round later. The tokens it counts are those
up to the one that completed the string, as in vLLM.

A completion with ``echo`` and ``max_tokens: 0`` is the prompt alone (vLLM's
``echo_without_generation``), with its log-probabilities when ``logprobs`` asks: the engine,
which needs ``max_tokens`` of at least 1, computes them while it makes one token, as vLLM's
does, and the answer drops that token: no text, ``completion_tokens`` 0 (vLLM counts the
dropped token there), ``finish_reason`` "length" (``max_tokens`` reached at once).

``usage`` counts each prompt once, however many choices it has (OpenAI's rule), and so its
``cached_tokens``: what the prefix cache served the prompt's choices, averaged over them. The
``n`` choices of a new prompt compute each of its full blocks once between them and adopt it
``n - 1`` times: ``(n - 1) / n`` of them shows as cached. (vLLM reports one choice's.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from common.inputs import Request
from common.sampling_params import RequestOutput

from ..stream import IncrementalDetokenizer, StopStrings, answer_ids
from .async_llm import AsyncLLM, EngineDeadError, RequestStream
from .protocol import ChatCompletionRequest, OpenAIError, SamplingRequest
from .responses import (
    ChatChoice,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    DeltaMessage,
    Usage,
    chat_logprobs,
    completion_logprobs,
)
from .serving_models import EnginePrompt, ServedModel

# One choice of either endpoint, whole or streamed.
AnyChoice = CompletionChoice | ChatChoice | ChatStreamChoice


class Choice:
    """One choice: its request's stream, its text so far, its tokens' log-probabilities."""

    def __init__(
        self,
        index: int,
        prompt: EnginePrompt,
        stream: RequestStream,
        text: IncrementalDetokenizer,
        echo_only: bool = False,
    ) -> None:
        self.index = index  # OpenAI's: prompt i's choice j is i * n + j
        self.prompt = prompt
        self.echo_only = echo_only  # echo with max_tokens 0: the engine's one token dropped
        self.stream = stream
        self.text = text
        self.output: RequestOutput | None = None
        self.entries: list[Any] = []  # TokenLogprobs, one per generated token (when asked)
        self.prompt_entries: list[Any] | None = None  # the prompt's (echo with logprobs)
        self.sent = 0  # entries already streamed
        self.echoed = False  # the prompt already streamed (echo)
        self.named = False  # a chat stream's first chunk sent: the one naming the role
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
        if self.echo_only and self.done:
            return "length"
        return self.output.finish_reason if self.output is not None else None

    @property
    def num_tokens(self) -> int:
        """Tokens generated, the eos included, up to the one that completed a stop string."""
        if self.output is None or self.echo_only:
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
        if self.echo_only:
            return ""
        ids = answer_ids(output)
        return self.text.finish(ids) if output.finished else self.text.update(ids)

    def new_entries(self) -> tuple[list[int], list[Any]]:
        """The tokens (and their log-probabilities) not streamed yet."""
        end = self.num_tokens
        ids, entries = self.token_ids[self.sent : end], self.entries[self.sent : end]
        self.sent = end
        return ids, entries


class Answer:
    """A request's choices in its endpoint's shape: a chat's (``message`` or ``delta``, the
    chat's log-probabilities) or a completion's (``text``, the legacy log-probabilities)."""

    def __init__(
        self,
        llm: AsyncLLM,
        model: ServedModel,
        request: SamplingRequest,
        prompts: list[EnginePrompt],
        logprobs: int | None,
        detokenizer: Executor,
    ) -> None:
        self.llm = llm
        self.model = model
        self.prompts = prompts
        self.chat = isinstance(request, ChatCompletionRequest)
        self.logprobs = logprobs is not None
        self.echo = request.echo
        self.echo_only = request.echo and request.max_tokens == 0
        self.stop = StopStrings(
            request.stop_strings(), request.include_stop_str_in_output, request.min_tokens or 0
        )
        self.detokenizer = detokenizer  # where text is made: off the event loop
        self.choices: list[Choice] = []

    def start(self, requests: list[list[Request]]) -> None:
        """Queue every choice's request (prompt by prompt, each prompt's ``n`` together), each
        one that ``check_request`` passed."""
        for prompt, children in zip(self.prompts, requests, strict=True):
            for request in children:
                stream = self.llm.add_checked(request)
                text = IncrementalDetokenizer(self.model.codec.decode, self.stop, prompt.ids)
                choice = Choice(len(self.choices), prompt, stream, text, self.echo_only)
                self.choices.append(choice)

    def abort(self) -> None:
        """Every choice's request that is still running, aborted (a no-op for the others)."""
        for choice in self.choices:
            self.llm.abort(choice.stream)

    async def read(self, choice: Choice, output: RequestOutput) -> str:
        """``output`` taken in by its choice, on the detokenizer's thread; a stop string
        reached ends the choice's request in the engine."""
        prompt_logprobs = self.logprobs and self.echo
        loop = asyncio.get_running_loop()
        piece = await loop.run_in_executor(
            self.detokenizer, choice.read, output, self.logprobs, prompt_logprobs
        )
        if choice.stop_reason is not None and not output.finished:
            self.llm.abort(choice.stream, finish_reason="stop")
        return piece

    async def follow(self, choice: Choice) -> AsyncIterator[str]:
        """The pieces of text of one choice, until it is done; one that a stop string ended
        then waits for the engine's word that its request ended (the round after the abort,
        whose tokens nobody reads): once the answer is out, the request no longer runs, its
        blocks are back and ``/metrics`` has counted its end."""
        async for output in choice.stream:
            yield await self.read(choice, output)
            if choice.done:
                break
        try:
            async for _ in choice.stream:  # nothing left unless a stop string ended it
                pass
        except EngineDeadError:
            pass  # the engine is gone, and the request with it: the answer stands

    # ---- whole --------------------------------------------------------------------------------

    async def whole(self) -> list[AnyChoice]:
        """Every choice, once all are done."""

        async def drain(choice: Choice) -> None:
            async for _ in self.follow(choice):
                pass

        await asyncio.gather(*(drain(choice) for choice in self.choices))
        if any(choice.finish_reason == "abort" for choice in self.choices):
            raise OpenAIError(503, "the request was aborted: the server is shutting down")
        return [
            self.choice(c, c.text.text, c.token_ids, c.entries[: c.num_tokens], whole=True)
            for c in self.choices
        ]

    # ---- streamed -----------------------------------------------------------------------------

    async def streamed(self) -> AsyncIterator[AnyChoice]:
        """A choice per piece of text of any choice, as they come (the last of each with its
        finish reason); a chat's first name the role, one per choice, as OpenAI's do. An
        engine that fails raises its error here."""
        if self.chat:
            for choice in self.choices:
                yield self.choice(choice, "", [], [], whole=False)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self.pump(choice, queue)) for choice in self.choices]
        try:
            for _ in self.choices:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        """One choice's streamed choices into ``queue``, then None (or the engine's failure)."""
        try:
            async for piece in self.follow(choice):
                ids, entries = choice.new_entries()
                if piece or entries or choice.done:
                    queue.put_nowait(self.choice(choice, piece, ids, entries, whole=False))
        except Exception as exc:  # the engine failed: the stream says so
            queue.put_nowait(exc)
        queue.put_nowait(None)

    # ---- the one place a choice is made -------------------------------------------------------

    def choice(
        self, choice: Choice, text: str, ids: list[int], entries: list[Any], whole: bool
    ) -> AnyChoice:
        """``choice`` in its endpoint's shape, ``whole`` or a streamed piece: its ``text``
        (and its tokens ``ids``, their log-probabilities ``entries``) held as a completion
        holds it (the echoed prompt first, once) or as a chat does (a ``message``, or a
        ``delta``: the first of a stream names the role and holds nothing); and once the
        choice is done, why it ended."""
        done = choice.done
        ending: dict[str, Any] = {
            "index": choice.index,
            "finish_reason": choice.finish_reason if done else None,
            "stop_reason": choice.stop_reason if done else None,
        }
        if not self.chat:
            prefix, prompt_ids, prompt_entries = self.echoed_prompt(choice)
            ids, entries = prompt_ids + ids, prompt_entries + entries
            logprobs = None
            if self.logprobs:
                token_text, offset = self.model.token_text, choice.text_offset
                logprobs = completion_logprobs(ids, entries, token_text, offset)
                choice.text_offset += sum(len(token) for token in logprobs.tokens)
            return CompletionChoice(text=prefix + text, logprobs=logprobs, **ending)
        if whole:
            message = ChatMessage(role="assistant", content=text)
            return ChatChoice(message=message, logprobs=self.chat_logprobs(entries), **ending)
        if not choice.named:
            choice.named = True
            delta = DeltaMessage(role="assistant", content=text)
            return ChatStreamChoice(delta=delta, logprobs=None, **ending)
        delta = DeltaMessage(content=text)
        return ChatStreamChoice(delta=delta, logprobs=self.chat_logprobs(entries), **ending)

    def chat_logprobs(self, entries: list[Any]) -> ChatLogprobs | None:
        return chat_logprobs(entries, self.model.token_text) if self.logprobs else None

    def echoed_prompt(self, choice: Choice) -> tuple[str, list[int], list[Any]]:
        """The prompt's text, ids and log-probabilities (the first None) before a choice's
        answer, once: nothing when the request does not echo, or it was already sent."""
        if not self.echo or choice.echoed:
            return "", [], []
        choice.echoed = True
        prompt = choice.prompt
        text = prompt.text if prompt.text is not None else self.model.codec.decode(prompt.ids)
        entries = choice.prompt_entries if self.logprobs else None
        return text, prompt.ids, list(entries or [None] * len(prompt.ids))

    def usage(self) -> Usage:
        """Each prompt counted once (OpenAI's rule), and so its cached tokens: what the cache
        served its choices, averaged over them (rounded down)."""
        prompt_tokens = sum(len(prompt.ids) for prompt in self.prompts)
        completion_tokens = sum(choice.num_tokens for choice in self.choices)
        n = len(self.choices) // len(self.prompts)
        served = sum(c.output.num_cached_tokens for c in self.choices if c.output is not None)
        return Usage.of(prompt_tokens, completion_tokens, served // n)
