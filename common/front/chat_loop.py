"""``python -m <step>.run --model DIR --chat``: a conversation with the checkpoint, turn after
turn, through one engine.

Every turn sends the whole conversation so far, written in the checkpoint's chat template. Its
beginning is the previous turn's prompt and answer, whose full blocks the engine cached when it
computed them, so each turn computes little more than its new message: the line after each
answer says how many prompt tokens came from the prefix cache (vLLM's ``num_cached_tokens``).
(An answer's text, tokenized again as part of the next prompt, may split into other tokens
than were generated; the cache then serves the conversation up to there.)

The answer streams as the engine makes it (``stream.IncrementalDetokenizer``). Ctrl-C stops
the answer, not the session: the engine finishes its round, the request is aborted (its blocks
go back, the full ones stay cached), and what was shown stays in the conversation. ``/reset``
starts the conversation over (the cache keeps what it holds: a restart of the same
conversation hits it); ``/exit`` or the end of the input leaves.

``ChatSession`` is the loop's engine-facing half, with no terminal in it: ``turn(text)``
streams one answer to ``out`` and returns its figures.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from ..errors import RequestError, one_line
from ..sampling import RequestOutput, SamplingParams
from .cli import plural
from .stream import IncrementalDetokenizer, answer_ids

RESET, EXIT = "/reset", "/exit"


@dataclass(frozen=True)
class Turn:
    """What one turn cost and gave."""

    prompt_tokens: int
    cached_tokens: int  # of those, served by the prefix cache
    new_tokens: int
    finish_reason: str | None  # "stop", "length", or "abort" when Ctrl-C stopped it

    def summary(self) -> str:
        return (
            f"  ({plural(self.prompt_tokens, 'prompt token')}, {self.cached_tokens} from the "
            f"prefix cache; {plural(self.new_tokens, 'new token')}, "
            f"finish_reason={self.finish_reason})"
        )


class ChatSession:
    """One conversation with one engine: ``codec`` writes it in the chat template
    (``chat_ids``), decodes answers (``decode``) and knows the eos ids (``eos_token_ids``)."""

    def __init__(
        self,
        engine: Any,
        codec: Any,
        params: SamplingParams,
        system: str | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.params = params
        self.system = system
        self.out = out
        self.stop = threading.Event()  # set (by Ctrl-C) to stop the answer being streamed
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def turn(self, text: str) -> Turn:
        """The user's ``text``, then the assistant's answer, streamed. A request the engine
        refuses (too long for the context, ...) raises ``RequestError``, and the conversation
        stays as it was."""
        conversation = [*self.messages, {"role": "user", "content": text}]
        ids = self.codec.chat_ids(conversation)
        request_id = self.engine.add_request(
            ids, None, self.codec.eos_token_ids, sampling_params=self.params
        )
        self.stop.clear()
        final = self._stream(request_id)
        answer = self.codec.decode(answer_ids(final))
        self.messages = [*conversation, {"role": "assistant", "content": answer}]
        return Turn(len(ids), final.num_cached_tokens, len(final.token_ids), final.finish_reason)

    def _stream(self, request_id: int) -> RequestOutput:
        """Rounds until the request ends, its text written as it grows; ``stop`` aborts it
        between two rounds."""
        detokenizer = IncrementalDetokenizer(self.codec.decode)
        out = self.out or sys.stdout
        aborted = False
        while True:
            if self.stop.is_set() and not aborted:
                self.engine.abort(request_id)  # the next round reports it: "abort"
                aborted = True
            for output in self.engine.step():
                if output.request_id != request_id:
                    continue
                ids = answer_ids(output)
                piece = detokenizer.finish(ids) if output.finished else detokenizer.update(ids)
                out.write(piece)
                out.flush()
                if output.finished:
                    out.write("\n")
                    return output


@contextmanager
def ctrl_c_sets(event: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C sets ``event`` instead of raising ``KeyboardInterrupt`` in the
    middle of a round (which would leave the engine half-way through it)."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def chat(session: ChatSession, lines: TextIO, out: TextIO) -> None:
    """The loop: read a line, answer it, say what the cache did; until ``/exit`` or the end of
    ``lines``. Ctrl-C at the prompt only clears it."""
    echo = not lines.isatty()  # piped in: show what was typed, as a terminal would have
    while True:
        out.write("\n> ")
        out.flush()
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            out.write(f"\n(Ctrl-C stops an answer; {EXIT} or Ctrl-D leaves)")
            continue
        if not line or line.strip() == EXIT:
            out.write("\n" if not line else line if echo else "")
            return
        text = line.strip()
        if echo:
            out.write(line)
        if text == RESET:
            session.reset()
            out.write("(a new conversation)\n")
        elif text:
            answer(session, text, out)


def answer(session: ChatSession, text: str, out: TextIO) -> None:
    try:
        with ctrl_c_sets(session.stop), torch.inference_mode():
            turn = session.turn(text)
    except RequestError as exc:
        out.write(f"error: {one_line(exc)}\n")
        return
    out.write(turn.summary() + "\n")
