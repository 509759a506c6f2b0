"""``python -m <step>.serve --model DIR``: the OpenAI-compatible server of any step.

``main`` reads the flags (``options.py``: one ``error:`` line and exit 2 for one it cannot
use), checks that the server's packages are installed, and makes one call, ``launch.py``'s
``run_server``, which checks the rest before the slow part and serves until a signal.
"""

from __future__ import annotations

import importlib.util

from common.errors import MissingPackageError

from ..exits import report_user_errors
from .options import ServeOptions, parse_args

PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def main(step_name: str, argv: list[str] | None = None) -> int:
    """The server, until Ctrl-C or SIGTERM. A problem with what was given is one ``error:``
    line and status 1."""
    prog = f"python -m {step_name}.serve"
    options = parse_args(prog, argv, step_name)
    return report_user_errors(prog, lambda: start(step_name, options, prog))


def start(step_name: str, options: ServeOptions, prog: str) -> int:
    require_packages()
    from .launch import run_server  # imports the packages just checked

    return run_server(step_name, options, prog)


def require_packages() -> None:
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"the server needs {', '.join(missing)}: pip install -e '.[serve]'"
        )
