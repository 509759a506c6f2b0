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
EVENT_PACKAGES = ("zmq", "msgspec")  # pyzmq's module is zmq


def main(step_name: str, argv: list[str] | None = None) -> int:
    """The server, until Ctrl-C or SIGTERM. A problem with what was given is one ``error:``
    line and status 1."""
    prog = f"python -m {step_name}.serve"
    options = parse_args(prog, argv, step_name)
    return report_user_errors(prog, lambda: start(step_name, options, prog))


def start(step_name: str, options: ServeOptions, prog: str) -> int:
    require_packages(PACKAGES, "the server", "serve")
    if options.kv_events is not None and options.kv_events.publishes:
        require_packages(EVENT_PACKAGES, "--kv-events-config", "cluster")
    from .launch import run_server  # imports the packages just checked

    return run_server(step_name, options, prog)


def require_packages(packages: tuple[str, ...], who: str, extra: str) -> None:
    """One line naming what ``who`` needs that is not installed, and the extra that brings it."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(f"{who} needs {', '.join(missing)}: pip install -e '.[{extra}]'")
