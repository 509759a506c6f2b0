"""Streamed text: answers printed while the engine produces them (``run.py --model DIR --stream``).

Two parts. ``IncrementalDetokenizer`` turns a request's token ids, one round at a time, into the
text they add. A token is not a piece of text: byte-level BPE (GPT-2, Llama 3, SmolLM2) splits a
Chinese character or an emoji into two to four tokens of one byte each, and a SentencePiece
tokenizer falls back to byte tokens for what its vocabulary lacks. Decoding one token at a time
would print half a character as U+FFFD, the replacement character, and the streamed text would
not be the answer. So the detokenizer decodes all the ids so far, exactly as the final answer is
decoded (``chat.text_decoder``), and hands out only the text that extends what it already handed
out, holding it back while it ends in U+FFFD (a character still missing its last bytes). The
pieces therefore add up to the final text, character for character.

``StreamPrinter`` prints the answers of several requests, served together, without mixing
them: in the order of the prompts, the first unfinished answer grows on the screen as its
tokens come; the requests behind it are served at the same time (continuous batching), and
what they produced meanwhile is printed at once when their turn comes, after which they grow
live too. Each answer ends with why it stopped, as a non-streamed answer does: stdout is the
same with and without ``--stream``, only sooner.

Decoding all the ids each round costs O(n) per token, O(n^2) per answer: microseconds for the
answers of a tutorial (the Rust tokenizer decodes millions of tokens a second). vLLM keeps
offsets into the ids to decode a short window instead; the whole decode is the one whose
pieces provably add up to the final text.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from common.sampling import RequestOutput

from .cli import plural
from .codec import Decode, Prompt

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character


class IncrementalDetokenizer:
    """One request's text, handed out piece by piece as its token ids grow: ``update(ids)``
    the text all the ids so far add, ``finish(ids)`` the rest, the end included (a U+FFFD
    that no later token completes is what the final answer shows too)."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.printed = ""  # the text handed out so far

    def update(self, token_ids: Sequence[int]) -> str:
        text = self._decode(list(token_ids))
        if text.endswith(REPLACEMENT_CHAR):
            return ""  # a character cut between tokens: wait for its last bytes
        return self._extend(text)

    def finish(self, token_ids: Sequence[int]) -> str:
        return self._extend(self._decode(list(token_ids)))

    def _extend(self, text: str) -> str:
        if not text.startswith(self.printed):
            return ""  # printed text cannot be taken back: wait until the text agrees again
        piece = text[len(self.printed) :]
        self.printed = text
        return piece


def answer_ids(output: RequestOutput) -> list[int]:
    """A request's generated ids without the eos (or stop id) that ended it: the answer."""
    ids = list(output.token_ids)
    return ids[:-1] if output.finish_reason == "stop" and ids else ids


# ---- how an answer is laid out, streamed or not --------------------------------------------

ECHO_EDGE = 60  # a long prompt is echoed as its first and last ECHO_EDGE characters


def shorten(text: str, edge: int = ECHO_EDGE) -> str:
    """``text`` on one line, cut in the middle when long, so that it does not bury the answers."""
    text = text.replace("\r\n", "\n").replace("\n", " ⏎ ")
    if len(text) <= 2 * edge + 20:  # cutting would save less than the marker costs
        return text
    return f"{text[:edge]} … ({len(text)} chars) … {text[-edge:]}"


def echo_prompt(prompt: Prompt) -> str:
    """A request above its answer: the prompt, or a conversation's size and last message."""
    if isinstance(prompt, str):
        return shorten(prompt)
    last = prompt[-1]
    return f"({plural(len(prompt), 'message')}) {last['role']}: {shorten(last['content'])}"


def answer_head(number: int, prompt: Prompt) -> str:
    """What comes before answer ``number`` (from 1): a blank line, the prompt, the arrow."""
    return f"\n[{number}] {echo_prompt(prompt)}\n  -> "


def answer_tail(num_tokens: int, finish_reason: str | None) -> str:
    """What ends an answer: how many tokens, and why it stopped (vLLM's ``finish_reason``)."""
    return f"  ({plural(num_tokens, 'token')}, finish_reason={finish_reason})\n"


# ---- several answers on one screen ---------------------------------------------------------


@dataclass
class _Answer:
    detokenizer: IncrementalDetokenizer
    unprinted: str = ""  # produced while another answer had the screen
    tail: str | None = None  # set once the request finished
    started: bool = False  # its head is printed


class StreamPrinter:
    """``--stream``: ``printer(index, output)`` for each ``RequestOutput`` of request
    ``index`` (in the order of ``prompts``), as ``step()`` hands them out. ``out`` (None:
    ``sys.stdout`` at each write) is flushed after every piece: a pipe sees the text at once."""

    def __init__(
        self, decode: Decode, prompts: Sequence[Prompt], out: TextIO | None = None
    ) -> None:
        self._prompts = list(prompts)
        self._answers = [_Answer(IncrementalDetokenizer(decode)) for _ in self._prompts]
        self._shown = 0  # the answer that has the screen
        self._out = out

    def __call__(self, index: int, output: RequestOutput) -> None:
        answer = self._answers[index]
        ids = answer_ids(output)
        detokenizer = answer.detokenizer
        answer.unprinted += detokenizer.finish(ids) if output.finished else detokenizer.update(ids)
        if output.finished:
            answer.tail = answer_tail(len(ids), output.finish_reason)
        self._show()

    @property
    def texts(self) -> list[str]:
        """Each answer's text as handed out so far (printed or waiting for its turn)."""
        return [a.detokenizer.printed for a in self._answers]

    def _show(self) -> None:
        """Print what the answer on screen has, and move on while answers are complete."""
        out = self._out or sys.stdout
        while self._shown < len(self._answers):
            answer = self._answers[self._shown]
            if not answer.started:
                out.write(answer_head(self._shown + 1, self._prompts[self._shown]))
                answer.started = True
            out.write(answer.unprinted)
            answer.unprinted = ""
            if answer.tail is None:
                break
            out.write(answer.tail)
            self._shown += 1
        out.flush()
