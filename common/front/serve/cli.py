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
from types import ModuleType
from typing import Any

import torch

from ...errors import MissingPackageError, UserError, end_as_interrupted, report_user_errors
from ..cli import (
    HelpFormatter,
    add_dtype_flag,
    add_memory_check_flag,
    device_name,
    dtype_value,
    int_range,
    non_negative_int,
    positive_int,
    seed_int,
)
from ..steps import load_step
from ..text import model_dir_arg

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
    """The command line, checked."""

    model: str
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    device: str
    dtype: str
    block_size: int
    total_blocks: int
    max_running: int
    max_model_len: int | None
    threads: int
    seed: int

    def overrides(self) -> dict[str, Any]:
        """``from_pretrained``'s keyword arguments."""
        given = {
            "device": self.device,
            "dtype": dtype_value(self.dtype),
            "block_size": self.block_size,
            "total_blocks": self.total_blocks,
            "max_model_len": self.max_model_len,
        }
        return {name: value for name, value in given.items() if value is not None}


def parse_args(step_name: str, argv: list[str] | None) -> ServeOptions:
    p = argparse.ArgumentParser(
        prog=f"python -m {step_name}.serve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--model",
        type=model_dir_arg,
        required=True,
        metavar="DIR",
        help="a local Hugging Face Llama checkpoint directory",
    )
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
        help="the model's name in the API (default: the --model argument)",
    )
    add_engine_flags(p)
    args = p.parse_args(argv)
    return ServeOptions(**{name: getattr(args, name) for name in ServeOptions.__annotations__})


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags, as ``run.py --model`` takes them."""
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or cuda:N")
    add_dtype_flag(p)
    p.add_argument(
        "--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block"
    )
    p.add_argument(
        "--total-blocks", type=positive_int, default=512, metavar="N", help="KV blocks in the pool"
    )
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=16,
        metavar="N",
        help="requests batched at once (more wait in the queue)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        metavar="N",
        help="the longest request, prompt + max_tokens (default: the checkpoint's "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        metavar="N",
        help="torch CPU threads (0: torch's default, one per core)",
    )
    p.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        metavar="N",
        help="seeds the requests that bring no seed of their own",
    )
    add_memory_check_flag(p)


def main(step_name: str, argv: list[str] | None = None) -> int:
    """The server, until Ctrl-C or SIGTERM. A problem with what was given is one ``error:``
    line and status 1."""
    options = parse_args(step_name, argv)
    prog = f"python -m {step_name}.serve"
    return report_user_errors(prog, lambda: serve(load_step(step_name), options, prog))


def serve(step: ModuleType, options: ServeOptions, prog: str) -> int:
    from .launch import build_server, load_served_model  # the packages are checked first

    require_packages()
    listener = bind(options.host, options.port)
    served = load_served_model(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    start = time.perf_counter()
    model = step.TinyTransformerPaged.from_pretrained(options.model, **options.overrides())
    engine = step.PagedPrefixCacheEngine(model, max_running=options.max_running, seed=options.seed)
    print(f"{prog}: {served.name!r} loaded in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        build_server(engine, served, options, prog).run(sockets=[listener])
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
