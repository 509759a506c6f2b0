"""Ctrl-C at any moment of a command's start-up ends it in one line (``front/exits.py``).

A command is started as a terminal starts it, in a process group of its own, and SIGINT goes
to the whole group, as Ctrl-C does (a server's engine process gets it too). The moments are
counted in imports, not seconds, so that a busy machine shifts none of them: ``-X importtime``
reports each module as its import ends, and the signal goes once the command has reported so
many imports after a given module's. They start after ``front.exits``, the command's first
module (before it, Python itself is starting), and are densest where numpy loads, inside
torch's ``torch._C``: there an interrupt raised by Python's own handler was swallowed (the
demo ran on), or left numpy half-made (``ImportError: cannot load module more than once per
process``, a ``RecursionError``), or met pybind11 (an abort). The last comes once the command
is at work.

Each time: no traceback, no abort, no finished run; the process ends by SIGINT, with one line.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, STEP_NAMES

# (a module, so many imports after its own): the signal goes then; or a text: once the command
# printed it on stdout. A command that prints before it reached a moment is interrupted then.
Moment = tuple[str, int] | str
FIRST = "front.exits"  # the module of the command's handler: the first of the command's own
NUMPY = "numpy"  # its first module: numpy then loads in ~90 imports, torch._C ends ~10 later
NUMPY_MOMENTS = [(NUMPY, k) for k in range(0, 100, 12)]
RUN_MOMENTS = [(FIRST, 1), (FIRST, 10), (FIRST, 40), *NUMPY_MOMENTS, (FIRST, 400), (FIRST, 1000)]
# A server's engine process starts once its server has imported what starts it: from then on
# its imports are reported too, on the same stderr (its start is deaf to Ctrl-C).
ENGINE_START = "multiprocessing.popen_spawn_posix"
SERVE_MOMENTS = [
    (FIRST, 1),
    (FIRST, 40),
    *NUMPY_MOMENTS[::2],
    *((ENGINE_START, k) for k in (30, 150, 300, 500, 800, 1100)),
]
ENDS_WITHIN_S = 30  # after the signal: ending at once takes milliseconds; a stop, a second


@dataclass
class Interrupted:
    """What a command did with a Ctrl-C: its exit status and what it said."""

    returncode: int | None  # None: it ran on (it was killed 30 s later)
    stdout: str
    said: list[str]  # stderr, less -X importtime's lines and blank ones


def interrupt_at(args: list[str], moment: Moment) -> Interrupted:
    """Run ``python -m args``, send SIGINT to its group at ``moment``, and wait for its end."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job
    )
    now, err, out = threading.Event(), [], []
    after, count = (None, 0) if isinstance(moment, str) else moment
    counted = [-1]  # imports after the module's; -1 until it comes

    def read_err() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            err.append(line)
            if not line.startswith("import time:"):
                continue
            name = line.rpartition("|")[2].strip()
            if counted[0] >= 0:
                counted[0] += 1
            elif name == after or name.startswith(f"{after}."):
                counted[0] = 0
            if counted[0] == count:
                now.set()

    def read_out() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            out.append(line)
            if not isinstance(moment, str) or moment in line:
                now.set()

    readers = [threading.Thread(target=read, daemon=True) for read in (read_err, read_out)]
    for reader in readers:
        reader.start()
    try:
        assert now.wait(ENDS_WITHIN_S * 10), "it neither imported nor printed"
        os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(ENDS_WITHIN_S)
    finally:
        with_group_gone(process.pid)
    for reader in readers:
        reader.join(10)
    said = [line.strip() for line in err if line.strip() and not line.startswith("import time")]
    return Interrupted(
        process.returncode if process.returncode != -signal.SIGKILL else None, "".join(out), said
    )


def with_group_gone(pid: int) -> None:
    """Whatever is left of the command's group (an engine process, a hung one) is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def check_one_line(done: Interrupted, prog: str, stop_lines: list[str]) -> None:
    assert done.returncode is not None, f"it ran on: {done.said}"
    assert not any("Traceback" in line or "Error" in line for line in done.said), done.said
    assert done.returncode != -signal.SIGABRT, done.said  # an abort
    assert done.returncode == -signal.SIGINT, (done.returncode, done.said, done.stdout[-300:])
    assert done.said in ([f"{prog}: interrupted"], stop_lines), done.said


def moment_id(moment: Moment) -> str:
    return moment if isinstance(moment, str) else f"{moment[0]}+{moment[1]}"


@pytest.mark.parametrize("moment", [*RUN_MOMENTS, "Round 1"], ids=moment_id)
def test_ctrl_c_in_a_runs_start_up_is_one_line(moment: Moment) -> None:
    """The demo, interrupted while it imports or once it runs: one line."""
    step_name = STEP_NAMES[0]
    done = interrupt_at([f"{step_name}.run"], moment)
    check_one_line(done, f"python -m {step_name}.run", [])
    assert "✅" not in done.stdout  # not a finished run (its checks come last)


@pytest.mark.parametrize("moment", [*SERVE_MOMENTS, "serving on"], ids=moment_id)
def test_ctrl_c_in_a_servers_start_up_is_one_line(moment: Moment, toy_checkpoint: Path) -> None:
    """A server, interrupted while it or its engine process imports, while the engine is
    built: one line; once it serves, its stop's two (as it begins, as it ends)."""
    step_name = STEP_NAMES[-1]
    prog = f"python -m {step_name}.serve"
    args = [f"{step_name}.serve", "--model", str(toy_checkpoint), "--port", "0"]
    done = interrupt_at(args, moment)
    stop = [
        f"{prog}: stopping on SIGINT; what is in flight is aborted",
        f"{prog}: stopped by SIGINT; every block is back in the pool",
    ]
    check_one_line(done, prog, stop)


@pytest.mark.parametrize("moment", NUMPY_MOMENTS[2::3], ids=moment_id)
@pytest.mark.parametrize("command", ["bench", "front.toy_checkpoint"])
def test_ctrl_c_while_the_other_commands_import_is_one_line(
    command: str, moment: Moment, tmp_path: Path
) -> None:
    """``python -m bench`` and ``python -m front.toy_checkpoint`` run through the same
    ``run_command``: interrupted while numpy loads, one line."""
    args = {"bench": ["--no-hf", "--requests", "4", "--out", str(tmp_path / "out")]}
    done = interrupt_at([command, *args.get(command, [str(tmp_path / "toy")])], moment)
    check_one_line(done, f"python -m {command}", [])


class Writes(io.RawIOBase):
    """A file that keeps each write apart, as a pipe's reader sees them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_the_interrupted_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's engine process writes to the same stderr: a line written in two pieces (its
    text, then its newline, as ``print`` does on an unbuffered stream) can get the other
    process's output between them. ``say`` writes the line and its newline at once."""
    from front.exits import say

    raw = Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))
    say("\nprog: interrupted")
    assert raw.writes == [b"\nprog: interrupted\n"]
