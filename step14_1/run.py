"""``python -m <this step>.run``: the chapter's demo with this step's engine, or, with ``--model
DIR``, a checkpoint's text (``--help``, and ``--model DIR --help``).

The front ends are the same for every step, so they live in ``front/``; only the engine
they drive, this step's, differs. ``main`` imports them, and with them torch, once
``run_command`` holds Ctrl-C: from then on, one line whenever it comes (``front/exits.py``).
"""

from __future__ import annotations

import sys

from front.exits import run_command


def main(argv: list[str] | None = None) -> int:
    from front import main as front_ends

    return front_ends.main(__package__, argv)


if __name__ == "__main__":
    sys.exit(run_command(f"python -m {__package__}.run", main))
