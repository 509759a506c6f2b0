"""``python -m <this step>.run``: the chapter's demo with this step's engine, or, with ``--model
DIR``, a checkpoint's text (``--help``, and ``--model DIR --help``).

The front ends are the same for every step, so they live in ``front/``; only the engine
they drive, this step's, differs.
"""

from __future__ import annotations

import sys

from front import main as front_ends


def main(argv: list[str] | None = None) -> int:
    return front_ends.main(__package__, argv)


if __name__ == "__main__":
    sys.exit(front_ends.run_command(__package__))
