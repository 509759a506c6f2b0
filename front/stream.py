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

Stop strings (``StopStrings``, vLLM's ``stop``) are a rule about text, so they live here, once,
for ``generate_text``, the chat loop and the server alike: the detokenizer ends the text at the
first one, and holds back text that could still become one (a stream never shows what it
would have to take back).

``StreamPrinter`` prints the answers of several requests, served together, without mixing
them: in the order of the prompts, the first unfinished answer grows on the screen as its
tokens come; the requests behind it are served at the same time (continuous batching), and
what they produced meanwhile is printed at once when their turn comes, after which they grow
live too. Each answer ends with why it stopped, as a non-streamed answer does: stdout is the
same with and without ``--stream``, only sooner.

The detokenizer is primed with the prompt's last ids, as vLLM primes its own (a
``tokenizers.DecodeStream`` fed the prompt's tail first): the answer's text is what its ids add
to the prompt's, not what they make on their own. The difference is a space. A SentencePiece
tokenizer (Metaspace: Llama 2, TinyLlama, Mistral) writes a word's space as ``▁`` on the word's
own token, and its decoder drops the ``▁`` of the first token it decodes: ``▁Paris`` alone is
``Paris``, after ``▁is`` it is `` Paris``. Decoded on its own, an answer would lose its first
space (``"The capital of France isParis"`` with echo). The prompt's tail is vLLM's: the shortest
end of at least 4 ids that decodes to whole characters (``priming_ids``). Byte-level BPE
(GPT-2, Llama 3, SmolLM2) keeps the space in the token (``Ġ``), so priming changes nothing there.

Decoding the tail and all the answer's ids each round costs O(n) per token, O(n^2) per answer:
microseconds for the answers of a tutorial (the Rust tokenizer decodes millions of tokens a
second). vLLM keeps offsets into the ids to decode a short window instead; the whole decode is
the one whose pieces provably add up to the final text.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from common.errors import RequestError
from common.sampling_params import RequestOutput

from .cli import plural
from .codec import Decode, Prompt

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character


@dataclass(frozen=True)
class StopStrings:
    """Stop strings, applied to the text (vLLM's ``stop`` and ``include_stop_str_in_output``):
    the answer ends where one of ``stop`` first appears, before it (or after it, with
    ``include_stop_str_in_output``), and its ``stop_reason`` is that string.

    vLLM applies them where the text is made, in its detokenizer (the engine sees only token
    ids), and then aborts the request in the engine: so do ``generate_text`` and the server.
    As in vLLM, a stop string is looked for only in the text of the tokens after the first
    ``min_tokens`` (it may begin in theirs), and the token that completes it counts as
    generated."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop strings must be non-empty strings, got {self.stop!r}", "stop")

    def find(self, text: str, searched: int) -> tuple[int, str] | None:
        """The first stop string in ``text`` that ends past ``searched`` (what an earlier
        look covered): (where it begins, which), or None."""
        found = [
            (at, s) for s in self.stop if (at := text.find(s, max(searched - len(s) + 1, 0))) != -1
        ]
        return min(found, key=lambda hit: hit[0]) if found else None

    def partial(self, text: str) -> int:
        """How many characters at the end of ``text`` could still become a stop string (the
        longest end that begins one): a stream holds them back, since it could not take them
        back. vLLM holds back the longest stop string's length less one, whatever the text."""
        if self.include_stop_str_in_output:
            return 0  # a stop string found is shown: nothing shown is ever taken back
        longest = max((len(s) - 1 for s in self.stop), default=0)
        for size in range(min(longest, len(text)), 0, -1):
            if any(s.startswith(text[-size:]) for s in self.stop):
                return size
        return 0


NO_STOP = StopStrings()


PRIMING_MIN = 4  # vLLM's: the prompt's last ids the detokenizer starts from, at least
PRIMING_MAX = 23  # ... and at most, looking for an end that decodes to whole characters


def priming_ids(decode: Decode, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's last ids that an answer's text is decoded after (vLLM's
    ``FastIncrementalDetokenizer``): the shortest end of ``PRIMING_MIN`` ids or more that
    decodes to whole characters (no U+FFFD); a prompt of ``PRIMING_MIN`` ids or fewer whole.
    Where no end up to ``PRIMING_MAX`` ids decodes whole, vLLM takes the whole prompt; this
    takes those ``PRIMING_MAX`` (each round decodes them again: a long prompt would cost it)."""
    ids = list(prompt_ids)
    if len(ids) <= PRIMING_MIN:
        return ids
    for size in range(PRIMING_MIN, min(len(ids), PRIMING_MAX) + 1):
        if REPLACEMENT_CHAR not in decode(ids[-size:]):
            return ids[-size:]
    return ids[-PRIMING_MAX:]


class IncrementalDetokenizer:
    """One request's text, handed out piece by piece as its token ids grow: ``update(ids)``
    the text all the ids so far add, ``finish(ids)`` the rest, the end included (a U+FFFD
    that no later token completes is what the final answer shows too).

    With stop strings, the text ends at the first one (``stop_reason`` then says which, and
    ``num_tokens`` how many tokens the answer took: those after it are not the answer's), and
    text that could still become one is held back until it cannot.

    ``prompt_ids``: the request's prompt, whose last ids (``priming_ids``) the answer is
    decoded after, so that its first word keeps its space with every tokenizer."""

    def __init__(
        self, decode: Decode, stop: StopStrings = NO_STOP, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._decode = decode
        self._stop = stop
        self._priming = priming_ids(decode, prompt_ids)
        self._primed = decode(self._priming) if self._priming else ""  # the priming's own text
        self.text = ""  # the answer's text so far (up to a stop string, once one is found)
        self.printed = ""  # the text handed out so far
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.num_tokens = 0  # the answer's tokens decoded so far (up to the stop string's)
        self._searched = 0  # how much of ``text`` was looked at for stop strings

    def update(self, token_ids: Sequence[int]) -> str:
        self._read(token_ids, final=False)
        return self._hand_out(len(self.text) - self._stop.partial(self.text))

    def finish(self, token_ids: Sequence[int]) -> str:
        self._read(token_ids, final=True)
        return self._hand_out(len(self.text))

    def _read(self, token_ids: Sequence[int], final: bool) -> None:
        """The new tokens one at a time (as vLLM's detokenizer reads them), so that a stop
        string is pinned on the token that completes it; at the end, the whole text."""
        for end in range(self.num_tokens + 1, len(token_ids) + 1):
            if self.stop_reason is not None:
                return
            self.num_tokens = end
            self._decode_to(token_ids[:end], final=False)
        if final and self.stop_reason is None:
            self._decode_to(token_ids, final=True)

    def _decode_to(self, token_ids: Sequence[int], final: bool) -> None:
        text = self._after_priming(self._decode(self._priming + list(token_ids)))
        if not final and text.endswith(REPLACEMENT_CHAR):
            return  # a character cut between tokens: wait for its last bytes
        if not text.startswith(self.printed):
            return  # printed text cannot be taken back: wait until the text agrees again
        self.text = text
        if len(token_ids) <= self._stop.min_tokens:
            self._searched = len(text)  # vLLM: no stop string ends in the first min_tokens
            return
        hit = self._stop.find(text, self._searched)
        self._searched = len(text)
        if hit is not None:
            at, self.stop_reason = hit
            self.text = text[: at + len(hit[1]) if self._stop.include_stop_str_in_output else at]

    def _after_priming(self, text: str) -> str:
        """What the answer's ids add to the priming's text (where the two part, should the
        answer's first bytes complete a character the priming cut)."""
        if text.startswith(self._primed):
            return text[len(self._primed) :]
        same = next((i for i, (a, b) in enumerate(zip(text, self._primed)) if a != b), None)
        return text[min(len(text), len(self._primed)) if same is None else same :]

    def _hand_out(self, end: int) -> str:
        end = len(self.text) if self.stop_reason is not None else end
        piece = self.text[len(self.printed) : end]
        self.printed += piece
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
    ``sys.stdout`` at each write) is flushed after every piece: a pipe sees the text at once.
    ``stop``: the stop strings the requests were served with (an answer ends at one);
    ``prompt_ids``: each request's prompt ids, which its answer is decoded after
    (``IncrementalDetokenizer``); None: none."""

    def __init__(
        self,
        decode: Decode,
        prompts: Sequence[Prompt],
        out: TextIO | None = None,
        stop: StopStrings = NO_STOP,
        prompt_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._prompts = list(prompts)
        primes = prompt_ids if prompt_ids is not None else [()] * len(self._prompts)
        self._answers = [_Answer(IncrementalDetokenizer(decode, stop, ids)) for ids in primes]
        self._shown = 0  # the answer that has the screen
        self._out = out

    def __call__(self, index: int, output: RequestOutput) -> None:
        answer = self._answers[index]
        if answer.tail is not None:
            return  # ended by a stop string: what the engine says after is not the answer's
        ids = answer_ids(output)
        detokenizer = answer.detokenizer
        answer.unprinted += detokenizer.finish(ids) if output.finished else detokenizer.update(ids)
        if detokenizer.stop_reason is not None:
            answer.tail = answer_tail(detokenizer.num_tokens, "stop")
        elif output.finished:
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
