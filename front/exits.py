"""How a command ends: a user's mistake as one ``error:`` line and status 1, Ctrl-C as one
line and the end by SIGINT, anything else (a bug) with its traceback.

The core raises ``UserError`` (``common/errors.py``) and prints nothing; the commands that
people run (``run.py``, ``serve.py``, ``python -m bench``, ``python -m front.toy_checkpoint``)
turn it into a line here. Each runs its ``main`` through ``run_command``, whose Ctrl-C handler
(``on_ctrl_c``) is in place before anything heavy is imported: this module is light on purpose
(no torch), and a command imports the rest inside its ``main``. Only Python's own start comes
before it (``site``, the package that holds the command, this module).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from importlib import _bootstrap
from types import FrameType

from common.errors import UserError, one_line

# What every import of a module not loaded yet runs, however it was asked for (``import``,
# ``importlib.import_module``, C code): a frame of it means a module is being loaded.
LOADING_A_MODULE = _bootstrap._find_and_load.__code__


def run_command(prog: str, main: Callable[[], int]) -> int:
    """What ``python -m <command>`` runs: ``main()``, its exit status, with Ctrl-C ending the
    command in one line whenever it comes, while modules are imported too (``on_ctrl_c``).
    ``asyncio.run`` then leaves Ctrl-C to that handler (it takes over Python's own only), as
    it did before Python 3.11: a ``KeyboardInterrupt`` out of the loop."""
    signal.signal(signal.SIGINT, partial(on_ctrl_c, prog))
    try:
        return main()
    except KeyboardInterrupt:
        return interrupted(prog)


def on_ctrl_c(prog: str, signum: int, frame: FrameType | None) -> None:
    """Ctrl-C while a command runs: a ``KeyboardInterrupt``, as Python's own handler raises it,
    except while a module is being imported, where it ends the process at once, with the same
    line.

    Raised inside an import, the interrupt lands wherever the module's loading is: torch's and
    numpy's extension modules call back into Python while they load, and there it was
    swallowed (the command ran on), left a module half-made (``ImportError: cannot load module
    more than once per process`` from numpy, a ``RecursionError`` in its ``__getattr__``), or
    met C++ that cannot pass an exception on (``terminate called after throwing an instance of
    'pybind11::error_already_set'``: an abort)."""
    while frame is not None:
        if frame.f_code is LOADING_A_MODULE:
            end_now(prog)
        frame = frame.f_back
    raise KeyboardInterrupt


def report_user_errors(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` and return its exit status; a ``UserError`` becomes one line on stderr,
    ``<prog>: error: <message>`` (argparse's form), and status 1; Ctrl-C becomes
    ``interrupted``'s one line. Other exceptions propagate with their traceback."""
    try:
        return body()
    except UserError as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted(prog)


def interrupted(prog: str) -> int:
    """What Ctrl-C ends a command with: ``<prog>: interrupted`` on stderr, on a line of its
    own, then the end of ``end_by_signal``."""
    say(f"\n{prog}: interrupted")
    return end_by_signal(signal.SIGINT)


def say(line: str) -> None:
    """``line`` on stderr, flushed now, in one write: the engine process shares the stream,
    and a line of its own between our text and its newline would split ours (``print``
    writes them apart when stderr is unbuffered). A reader gone meanwhile (a ``| tee`` that
    the same Ctrl-C ended) is not the command's error: what is ending goes on to its end."""
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def end_by_signal(sig: int) -> int:
    """End the way the signal ``sig`` (Ctrl-C's SIGINT, or SIGTERM) ends a program, by the
    signal itself, once every ``finally`` has run: the shell then reads 128 + the signal and a
    script that runs us stops too (what Python does for a KeyboardInterrupt nobody catches).
    Where a process cannot signal itself, that status is returned."""
    status = 128 + sig
    if os.name != "posix":
        return status
    with contextlib.suppress(OSError):  # a reader gone: ``say``
        sys.stdout.flush()
        sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    return status  # not reached: the signal ends the process


def end_now(prog: str) -> None:
    """``interrupted``'s line and end, from a signal handler, where ``print`` could find stderr
    in the middle of a write of the code the signal stopped: the line goes to the file itself."""
    with contextlib.suppress(Exception):  # in use (a RuntimeError), or a reader gone
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"\n{prog}: interrupted\n".encode())
    if os.name == "posix":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # where a process cannot signal itself
