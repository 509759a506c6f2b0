"""``python -m <step>.run --model DIR --chat`` (``front/chat_loop.py``): one engine, a
conversation turn after turn.

- driven through a pipe, in every step: turn 2 is served from the cache (its prompt begins
  with turn 1's prompt and answer); after ``/reset`` the same first message hits what the
  cache kept; ``/exit`` leaves with status 0;
- Ctrl-C (a real SIGINT) stops an answer (``finish_reason=abort``), and the session goes on;
- a message past the context is one ``error:`` line, and the next turn is served;
- a checkpoint without a chat template, or a flag of another front end, is one line.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from front import main
from front.chat_loop import ChatSession, chat
from front.codec import TextCodec
from front.steps import load_step
from tests.helpers import ROOT, STEP_NAMES, SUBPROCESS_TIMEOUT_S, usage_error
from tests.serve.server_process import CONTEXT, ENGINE_FLAGS, ENGINE_OVERRIDES

SUMMARY = re.compile(
    r"\((\d+) prompt tokens, (\d+) from the prefix cache; (\d+) new tokens?, "
    r"finish_reason=(\w+)\)"
)


class ChatProcess:
    """The chat loop in a subprocess: lines in, its output read as it comes."""

    def __init__(self, step_name: str, checkpoint: Path, *flags: str) -> None:
        command = [sys.executable, "-m", f"{step_name}.run", "--model", str(checkpoint), "--chat"]
        self.process = subprocess.Popen(
            [*command, *flags],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out = ""
        self._grew = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while char := self.process.stdout.read(1):  # type: ignore[union-attr]
            with self._grew:
                self.out += char
                self._grew.notify_all()

    def say(self, line: str) -> None:
        self.process.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]

    def wait_for(self, pattern: re.Pattern[str] | str, start: int) -> re.Match[str]:
        """The first match of ``pattern`` in the output after ``start`` (a hang fails)."""
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        with self._grew:
            while not (match := re.compile(pattern).search(self.out, start)):
                left = deadline - time.monotonic()
                assert left > 0 and self.process.poll() is None, self.out
                self._grew.wait(left)
        return match

    def turn(self, line: str) -> tuple[int, int, int, str]:
        """Say ``line``; the figures of its answer's summary."""
        start = len(self.out)
        self.say(line)
        figures = self.wait_for(SUMMARY, start).groups()
        return int(figures[0]), int(figures[1]), int(figures[2]), figures[3]


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_a_conversation_through_a_pipe(step_name: str, chat_checkpoint: Path) -> None:
    chat_loop = ChatProcess(step_name, chat_checkpoint, *ENGINE_FLAGS, "--max-new-tokens", "8")
    try:
        chat_loop.wait_for("Type a message", 0)
        first = chat_loop.turn("Is the cat happy?")
        assert first[1] == 0 and first[2:] == (8, "length")
        second = chat_loop.turn("And the weather?")
        assert second[0] > first[0] + 8 and second[1] >= first[0] - 4  # turn 1's full blocks
        chat_loop.say("/reset")
        again = chat_loop.turn("Is the cat happy?")
        assert again[0] == first[0] and again[1] >= first[0] - 4  # the cache kept turn 1
        chat_loop.say("/exit")
        assert chat_loop.process.wait(SUBPROCESS_TIMEOUT_S) == 0
    finally:
        chat_loop.process.kill()
    assert chat_loop.process.stderr.read() == ""  # type: ignore[union-attr]


def session_of(
    step_name: str, checkpoint: Path, max_tokens: int, **overrides: object
) -> ChatSession:
    step = load_step(step_name)
    model = step.TinyTransformerPaged.from_pretrained(
        checkpoint, **{**ENGINE_OVERRIDES, **overrides}
    )
    engine = step.PagedPrefixCacheEngine(model)
    params = SamplingParams(max_tokens=max_tokens)
    return ChatSession(engine, TextCodec.load(checkpoint), params, out=io.StringIO())


class CtrlCWhenWritten(io.StringIO):
    """The terminal: Ctrl-C (a real SIGINT, to this process) once ``after`` was written and
    then something more, once."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.after, self.sent = after, False

    def write(self, text: str) -> int:
        written = super().write(text)
        if not self.sent and self.after in self.getvalue().removesuffix(text) and text:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return written


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_ctrl_c_stops_the_answer_not_the_session(step_name: str, chat_checkpoint: Path) -> None:
    """Ctrl-C lands while an answer streams: the answer ends at the next round ("abort", far
    short of its 1500 tokens), the pool gets its blocks back, and the next turn is served."""
    session = session_of(step_name, chat_checkpoint, max_tokens=1500)
    session.out = terminal = CtrlCWhenWritten("a long story")
    lines = io.StringIO("Tell me a long story\nIs the cat happy?\n")
    chat(session, lines, terminal)
    stopped, answered = SUMMARY.findall(terminal.getvalue())
    assert stopped[3] == "abort" and int(stopped[2]) < 1500
    assert answered[3] == "length"
    assert session.engine.ref_count_problems() == []


class CtrlCAtThePrompt(io.StringIO):
    """Input, with a Ctrl-C (a real SIGINT) while the first line is awaited."""

    def readline(self, size: int = -1) -> str:
        if self.tell() == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().readline(size)


def test_ctrl_c_at_the_prompt_only_says_how_to_leave(chat_checkpoint: Path) -> None:
    session = session_of(STEP_NAMES[-1], chat_checkpoint, max_tokens=4)
    out = io.StringIO()
    chat(session, CtrlCAtThePrompt("Is the cat happy?\n"), out)
    assert "(Ctrl-C stops an answer; /exit or Ctrl-D leaves)" in out.getvalue()
    assert SUMMARY.search(out.getvalue()).group(4) == "length"


def test_an_answer_stops_where_the_context_ends(chat_checkpoint: Path) -> None:
    """Asked for more tokens than the context has left, an answer gets what is left (and
    ends with "length"), rather than an error."""
    session = session_of(STEP_NAMES[-1], chat_checkpoint, max_tokens=100, max_model_len=40)
    out = io.StringIO()
    chat(session, io.StringIO("Is the cat happy?\n"), out)
    prompt, _, new, reason = SUMMARY.search(out.getvalue()).groups()
    assert int(prompt) + int(new) == 40 and reason == "length"


def test_a_message_past_the_context_is_one_line_and_the_session_goes_on(
    chat_checkpoint: Path,
) -> None:
    session = session_of(STEP_NAMES[-1], chat_checkpoint, max_tokens=4)
    lines = io.StringIO(f"{'the cat ' * CONTEXT}\nIs the cat happy?\n")
    out = io.StringIO()
    chat(session, lines, out)
    errors = [line for line in out.getvalue().splitlines() if "error:" in line]
    assert len(errors) == 1 and f"context length of {CONTEXT} tokens" in errors[0]
    assert "(/reset starts over)" in errors[0]
    assert SUMMARY.search(out.getvalue()).group(3, 4) == ("4", "length")
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # not the long one


def test_a_checkpoint_without_a_chat_template_is_one_line(toy_checkpoint: Path) -> None:
    """The toy checkpoint of the other tests has a word-level tokenizer and no template."""
    chat_loop = ChatProcess(STEP_NAMES[-1], toy_checkpoint)
    assert chat_loop.process.wait(SUBPROCESS_TIMEOUT_S) == 1
    err = chat_loop.process.stderr.read()  # type: ignore[union-attr]
    assert err.count("\n") == 1 and "error:" in err and "no chat template" in err


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        (
            ["--stream"],
            "--stream is for --model DIR (a checkpoint's text): it does not go with --chat",
        ),
        (["--prompt", "hi"], "--prompt is for --model DIR (a checkpoint's text): it does not go"),
        (["--trace-round", "batched"], "--trace-round is for the demo's own requests"),
    ],
)
def test_a_flag_of_another_front_end_is_one_line(
    flag: list[str], says: str, chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(chat_checkpoint), "--chat", *flag]
    line = usage_error(lambda a: main.main(STEP_NAMES[-1], a), argv, capsys)
    assert says in line
