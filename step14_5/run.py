"""The chapter's demo with this step's engine: ``python -m <this step>.run`` (``--help``).

The demo is the same for every step, so it lives in ``common/front/demo.py``; only the engine it
drives, this step's, differs.
"""

from __future__ import annotations

import sys

from common.front import demo


def main(argv: list[str] | None = None) -> int:
    return demo.main(__package__, argv)


if __name__ == "__main__":
    sys.exit(main())
