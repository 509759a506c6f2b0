"""The OpenAI-compatible server over this step's engine: ``python -m <this step>.serve --model
DIR`` (``--help``).

The server is the same for every step, so it lives in ``front/serve/``; only the engine
it drives, this step's, differs.
"""

from __future__ import annotations

import sys

from front.serve import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(__package__, argv)


if __name__ == "__main__":
    sys.exit(main())
