"""How a command ends: a user's mistake as one ``error:`` line and status 1, Ctrl-C as one
line and the end by SIGINT, anything else (a bug) with its traceback.

The core raises ``UserError`` (``common/errors.py``) and prints nothing; the commands that
people run (``run.py``, ``serve.py``, ``python -m bench``) turn it into a line here. Light on
purpose: it imports no torch, so a command answers Ctrl-C with one line from its first second.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from common.errors import UserError, one_line


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
    print(f"\n{prog}: interrupted", file=sys.stderr)
    return end_by_signal(signal.SIGINT)


def end_by_signal(sig: int) -> int:
    """End the way the signal ``sig`` (Ctrl-C's SIGINT, or SIGTERM) ends a program, by the
    signal itself, once every ``finally`` has run: the shell then reads 128 + the signal and a
    script that runs us stops too (what Python does for a KeyboardInterrupt nobody catches).
    Where a process cannot signal itself, that status is returned."""
    status = 128 + sig
    if os.name != "posix":
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    return status  # not reached: the signal ends the process
