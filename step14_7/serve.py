"""The OpenAI-compatible server over this step's engine: ``python -m <this step>.serve --model
DIR`` (``--help``).

The server is the same for every step, so it lives in ``front/serve/``; only the engine
it drives, this step's, differs. ``main`` imports it, and with it torch, once ``run_command``
holds Ctrl-C: from then on, one line whenever it comes (``front/exits.py``).
"""

from __future__ import annotations

import sys

from front.exits import run_command


def main(argv: list[str] | None = None) -> int:
    from front.serve import cli

    return cli.main(__package__, argv)


if __name__ == "__main__":
    sys.exit(run_command(f"python -m {__package__}.serve", main))
