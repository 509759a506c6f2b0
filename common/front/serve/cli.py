"""``python -m <step>.serve --model DIR``: the OpenAI-compatible server of any step.

What can be checked before the slow part is: the flags (argparse: one ``error:`` line, exit
2), the packages, the address (the socket is bound before the model loads, so a port in use
costs a second), the checkpoint's config, tokenizer, chat template and weight shapes, and
that the KV pool holds one request as long as the context (vLLM refuses to start otherwise).
Then the weights load, the engine starts, and uvicorn serves on the bound socket until Ctrl-C
or SIGTERM: what is in flight is aborted, the pool is checked, and one line says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import time
from dataclasses import dataclass

from ...errors import MissingPackageError, UserError, end_as_interrupted, report_user_errors
from ..cli import EngineOptions, HelpFormatter, add_engine_flags, add_model_flag, int_range

DESCRIPTION = """\
An OpenAI-compatible server (vLLM's endpoints and metric names) over this step's engine. The
engine lives as long as the server, so the prefix cache serves every later request what an
earlier one computed: a shared system prompt, a conversation's history.

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}]}'

docs/serving.md: the openai client, streaming, /metrics, and the map onto vllm serve."""

PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


@dataclass(frozen=True)
class ServeOptions:
    """The command line, checked: the checkpoint, where to listen, the API's names, and the
    engine flags every command shares."""

    model: str
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    engine: EngineOptions
    engine_in_thread: bool = False  # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0


def parse_args(step_name: str, argv: list[str] | None) -> ServeOptions:
    p = argparse.ArgumentParser(
        prog=f"python -m {step_name}.serve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_model_flag(p, "a local Hugging Face Llama checkpoint directory")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (0.0.0.0: every interface; mind --api-key)",
    )
    p.add_argument(
        "--port",
        type=int_range(0, 65535),
        default=8000,
        help="the port (0: any free one, printed at start)",
    )
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the API (None: the --model argument)",
    )
    add_engine_flags(p)
    p.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine on a thread of the server's process, not in a process of its own "
        "(vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0): one process, but the engine shares Python's "
        "GIL with the HTTP side, slower under load (docs/serving.md)",
    )
    args = p.parse_args(argv)
    return ServeOptions(
        args.model,
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        EngineOptions.from_args(args),
        args.engine_in_thread,
    )


def main(step_name: str, argv: list[str] | None = None) -> int:
    """The server, until Ctrl-C or SIGTERM. A problem with what was given is one ``error:``
    line and status 1."""
    options = parse_args(step_name, argv)
    prog = f"python -m {step_name}.serve"
    return report_user_errors(prog, lambda: serve(step_name, options, prog))


def serve(step_name: str, options: ServeOptions, prog: str) -> int:
    """Check, bind, start the engine, serve until stopped."""
    require_packages()
    from .launch import build_server, load_served_model, start_engine  # needs the packages

    listener = bind(options.host, options.port)
    served, cfg, folder = load_served_model(options)
    start = time.perf_counter()
    llm, metrics = start_engine(step_name, served, cfg, folder, options)
    print(f"{prog}: {served.name!r} loaded in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        build_server(llm, metrics, served, options, prog).run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn raises again the Ctrl-C it stopped on, once stopped
        return end_as_interrupted()  # its line is said: end by SIGINT, as Ctrl-C ends a program
    return 0


def require_packages() -> None:
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"the server needs {', '.join(missing)}: pip install -e '.[serve]'"
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use or a host that is not this machine's
    is refused before the model loads. uvicorn serves on it later."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()  # connections wait in the backlog until uvicorn takes them
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return listener
