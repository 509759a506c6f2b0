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

import argparse
import signal
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch

from common.errors import CheckpointError, RequestError, one_line
from common.sampling_params import RequestOutput, SamplingParams

from .build import EngineBuilder, ModelSource
from .cli import HelpFormatter, add_engine_flags, add_model_flag, plural, text_of
from .codec import TextCodec
from .exits import report_user_errors
from .options import EngineOptions
from .stream import IncrementalDetokenizer, answer_ids
from .text_cli import add_sampling_flags, sampling_params

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
    (``chat_ids``), decodes answers (``decode``) and knows the eos ids (``eos_token_ids``).

    An answer is at most ``params.max_tokens`` long, and at most what the context has left.
    """

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
        self.answering = False
        self._stop = False  # set by ``interrupt``: abort the answer at the next round
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def interrupt(self) -> bool:
        """Stop the answer being written (Ctrl-C); False when there is none."""
        self._stop = self.answering
        return self.answering

    def turn(self, text: str) -> Turn:
        """The user's ``text``, then the assistant's answer, streamed. A request the engine
        refuses (too long for the context, ...) raises ``RequestError``, and the conversation
        stays as it was."""
        conversation = [*self.messages, {"role": "user", "content": text}]
        ids = self.codec.chat_ids(conversation)
        eos = self.codec.eos_token_ids
        params = self.params_for(len(ids))
        request_id = self.engine.add_request(ids, None, eos, sampling_params=params)
        self.answering, self._stop = True, False
        try:
            final, answer = self._stream(request_id, ids)
        finally:
            self.answering = False
        self.messages = [*conversation, {"role": "assistant", "content": answer}]
        return Turn(len(ids), final.num_cached_tokens, len(final.token_ids), final.finish_reason)

    def params_for(self, prompt_len: int) -> SamplingParams:
        """The answer may not run past the context: ``max_tokens`` is cut to what is left (a
        prompt that fills it all is refused by the engine, with the numbers)."""
        limit = self.engine.model.cfg.max_model_len
        if limit is None or not 0 < limit - prompt_len < self.params.max_tokens:
            return self.params
        return replace(self.params, max_tokens=limit - prompt_len)

    def _stream(self, request_id: int, prompt_ids: list[int]) -> tuple[RequestOutput, str]:
        """Rounds until the request ends, its text written as it grows (decoded after the
        prompt, as the server decodes it); ``interrupt`` aborts it between two rounds. The
        last output, and the answer's text."""
        detokenizer = IncrementalDetokenizer(self.codec.decode, prompt_ids=prompt_ids)
        out = self.out or sys.stdout
        aborted = False
        while True:
            if self._stop and not aborted:
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
                    return output, detokenizer.text


def chat(session: ChatSession, lines: TextIO, out: TextIO) -> None:
    """The loop: read a line, answer it, say what the cache did; until ``/exit`` or the end of
    ``lines``.

    Ctrl-C is caught for the whole loop: during an answer it stops the answer (at the end of
    the round: a ``KeyboardInterrupt`` in the middle of one would leave the engine half-way
    through it); at the prompt it only says how to leave.
    """

    def on_ctrl_c(signum: int, frame: object) -> None:
        if not session.interrupt():
            out.write(f"\n(Ctrl-C stops an answer; {EXIT} or Ctrl-D leaves)\n> ")
            out.flush()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        with torch.inference_mode():
            loop(session, lines, out)
    finally:
        signal.signal(signal.SIGINT, previous)


def loop(session: ChatSession, lines: TextIO, out: TextIO) -> None:
    echo = not lines.isatty()  # piped in: show what was typed, as a terminal would have
    while True:
        out.write("\n> ")
        out.flush()
        line = lines.readline()
        if echo:
            out.write(line)
        text = line.strip()
        if not line or text == EXIT:
            out.write("" if line else "\n")
            return
        if text == RESET:
            session.reset()
            out.write("(a new conversation)\n")
        elif text:
            answer(session, text, out)


def answer(session: ChatSession, text: str, out: TextIO) -> None:
    try:
        turn = session.turn(text)
    except RequestError as exc:
        out.write(f"error: {one_line(exc)} ({RESET} starts over)\n")
        return
    out.write(turn.summary() + "\n")


# ---- the command line ------------------------------------------------------------------------

DESCRIPTION = """\
A conversation with a checkpoint, turn after turn, through this step's engine: each answer
streams as it is made, and after it a line says how many prompt tokens the prefix cache
served (the conversation so far: the engine computed it on the turns before). /reset starts
over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer."""
CHAT_MAX_NEW_TOKENS = 512  # an answer's default length: a conversation wants more than 16


@dataclass(frozen=True)
class ChatOptions:
    """``run.py --model DIR --chat``'s flags, read once."""

    model: str
    system: str | None
    sampling_params: SamplingParams
    engine: EngineOptions


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_model_flag(parser, "a local Hugging Face Llama checkpoint with a chat template")
    parser.add_argument(
        "--chat", action="store_true", help="talk with the model, turn after turn: this loop"
    )
    parser.add_argument(
        "--system",
        type=text_of("--system"),
        metavar="TEXT",
        help="the conversation's system message (kept by /reset)",
    )
    add_sampling_flags(parser, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    add_engine_flags(parser)
    return parser


def read_options(parser: argparse.ArgumentParser, argv: list[str]) -> ChatOptions:
    args = parser.parse_args(argv)
    params = sampling_params(parser, args)
    return ChatOptions(args.model, args.system, params, EngineOptions.from_args(args))


def run(step_name: str, options: ChatOptions) -> int:
    """Load, then the loop until ``/exit`` or the end of the input. A checkpoint it cannot use
    (no chat template, ...) is one ``error:`` line and status 1."""
    prog = f"python -m {step_name}.run"
    return report_user_errors(prog, lambda: start_chat(step_name, options))


def start_chat(step_name: str, options: ChatOptions) -> int:
    source = ModelSource.open(options.model, options.engine)
    assert source.checkpoint is not None  # --model DIR is a folder (checked at parse)
    codec = TextCodec.of(source.checkpoint)
    if codec.template is None:
        raise CheckpointError(
            f"{source.checkpoint.folder} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template): --chat writes the conversation in it; "
            "an instruct checkpoint has one"
        )
    start = time.perf_counter()
    engine = EngineBuilder(step_name, source, options.engine)()
    print(f"{step_name}: {options.model} (loaded in {time.perf_counter() - start:.1f} s)")
    print(f"Type a message. {RESET} starts over, {EXIT} or Ctrl-D leaves, Ctrl-C stops an answer.")
    session = ChatSession(engine, codec, options.sampling_params, options.system)
    chat(session, sys.stdin, sys.stdout)
    return 0
