"""The server's life, in order (vLLM's ``run_server``): the socket bound, the checkpoint
checked, the engine built and started, uvicorn serving until a signal, the engine stopped,
a line as the stop begins and one as it ends.

What can be checked before the slow part is: the address (the socket is bound before the
model loads, so a port in use costs a second), the checkpoint's config, tokenizer, chat
template and weight shapes, and that the KV pool holds one request as long as the context
(vLLM refuses to start otherwise). Then ``build_async_engine_client`` owns the engine's life:
it builds and starts it, and whatever ends the serving, aborts what is in flight and stops it.
A signal (Ctrl-C, SIGTERM) ends the serving: a line says so as the stop begins, one at its end
says whether every block came back to the pool, and the process ends by that signal.

Imported once the packages are known to be there (``cli.require_packages``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from common.checkpoint import GENERATION_CONFIG_FILE, read_json
from common.config import ModelConfig
from common.errors import CheckpointError, RequestError, UserError
from common.inputs import check_fits_pool, long_context_warning
from common.sampling_params import SamplingParams

from ..build import EngineBuilder, ModelSource
from ..codec import TextCodec
from ..exits import end_by_signal, say
from .api_server import build_app
from .async_llm import AsyncLLM, build_async_engine_client
from .kv_events_config import KVEventsConfig
from .metrics import Metrics
from .options import ServeOptions
from .serving_models import ServedModel

# generation_config.json's fields that vLLM takes as a request's defaults (those this engine
# has); HF's own default temperature, 1.0, when the file has none.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
STOP_GRACE_S = 5  # the longest a stop waits for the answers in flight to end


def run_server(step_name: str, options: ServeOptions, prog: str) -> int:
    """Check, bind, serve until a signal; then end by that signal, as a program it stops
    does (status 0 if the serving ended otherwise)."""
    listener = bind(options.host, options.port)
    served, builder = load_served_model(step_name, options)
    stopped_by = asyncio.run(run_server_worker(builder, served, options, listener, prog))
    return end_by_signal(stopped_by) if stopped_by is not None else 0


async def run_server_worker(
    builder: EngineBuilder,
    served: ServedModel,
    options: ServeOptions,
    listener: socket.socket,
    prog: str,
) -> int | None:
    """The engine built where it runs and started, the app served on ``listener`` until a
    signal, the engine stopped and the stop said in one line. Returns the signal that
    stopped it (None: none did)."""
    cfg, in_thread = builder.source.cfg, options.engine_in_thread
    metrics = Metrics(served.name, cfg.total_blocks)
    make_engine, make_publisher = with_kv_events(builder, options.kv_events)
    start = time.perf_counter()
    async with build_async_engine_client(
        cfg, make_engine, in_thread, metrics.record, make_publisher
    ) as llm:
        print(f"{prog}: {served.name!r} loaded in {time.perf_counter() - start:.1f} s", flush=True)
        app = build_app(
            llm, served, metrics, options.api_key, options.max_request_bytes, options.kv_events
        )
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=STOP_GRACE_S
        )
        server = EngineServer(config, llm, prog)
        await server.serve(sockets=[listener])
    say(stop_line(prog, server.stopped_by, llm.pool_problems))
    return server.stopped_by


def with_kv_events(
    builder: EngineBuilder, config: KVEventsConfig | None
) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """What builds the engine, and what builds the publisher of its KV cache events (None:
    events off): picklable both, they run where the engine runs."""
    if config is None or not config.enable_kv_cache_events:
        return builder, None
    from .kv_events import make_publisher  # pyzmq and msgspec: checked by cli.start

    return partial(builder, enable_kv_cache_events=True), partial(make_publisher, config)


def stop_line(prog: str, stopped_by: int | None, pool_problems: list[str] | None) -> str:
    """What a stop says at its end: why, and whether every block is back (free, or cached
    alone)."""
    pool = "every block is back in the pool" if pool_problems == [] else f"pool: {pool_problems}"
    return f"{prog}: stopped by {why(stopped_by)}; {pool}"


def why(stopped_by: int | None) -> str:
    return signal.Signals(stopped_by).name if stopped_by is not None else "request"


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


def load_served_model(step_name: str, options: ServeOptions) -> tuple[ServedModel, EngineBuilder]:
    """Everything about the checkpoint but its weights, checked: the config with the flags,
    the text side (tokenizer, chat template, eos ids), the sampling defaults, the weights'
    names and shapes. Returns what the API serves and what builds the engine."""
    source = ModelSource.open(options.model, options.engine)
    assert source.checkpoint is not None  # --model DIR is a folder (checked at parse)
    check_pool_holds_context(source.cfg)
    warning = long_context_warning(source.cfg)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    codec = TextCodec.of(source.checkpoint)
    source.checkpoint.check_shapes(source.cfg)
    name = options.served_model_name or options.model
    defaults = sampling_defaults(source.checkpoint.folder)
    served = ServedModel(name, codec, source.cfg.max_model_len, defaults)
    return served, EngineBuilder(step_name, source, options.engine)


def sampling_defaults(folder: Path) -> dict[str, Any]:
    """What a request leaves out: ``generation_config.json``'s temperature, top_p and top_k
    when it has them (vLLM's ``--generation-config auto``), else a temperature of 1.0."""
    path = folder / GENERATION_CONFIG_FILE
    config = read_json(path) if path.is_file() else {}
    defaults = {"temperature": 1.0}
    defaults.update({k: config[k] for k in SAMPLING_DEFAULTS if config.get(k) is not None})
    try:
        SamplingParams(**defaults)
    except RequestError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return defaults


def check_pool_holds_context(cfg: ModelConfig) -> None:
    """vLLM's rule: the KV pool must hold one request as long as the context, or a request
    the model accepts could never run."""
    if cfg.max_model_len is None:
        return
    try:
        check_fits_pool(cfg.max_model_len - 1, 1, cfg)  # the longest: one token left to make
    except RequestError as exc:
        raise UserError(
            f"the KV pool cannot hold one request as long as the context ({cfg.max_model_len} "
            f"tokens): {exc}, or lower --max-model-len"
        ) from None


class EngineServer(uvicorn.Server):
    """uvicorn's server, whose stop aborts every request in flight before it waits for the
    connections to close (a stream would otherwise run to its last token), says so as it
    begins, and remembers the signal that stopped it (uvicorn would raise it again at once;
    the engine is stopped and the pool's line said first)."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, prog: str) -> None:
        super().__init__(config)
        self.llm = llm
        self.prog = prog
        self.stopped_by: int | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for listener in sockets or []:
            host, port = listener.getsockname()[:2]
            print(
                f"{self.prog}: serving on http://{host}:{port} (the OpenAI API under /v1); "
                "Ctrl-C stops it",
                flush=True,
            )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM stop the serving (``handle_exit``) while it lasts."""
        stops = (signal.SIGINT, signal.SIGTERM)
        before = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The stop begins: every request in flight aborted, the stop's first line said (by
        the event loop as soon as this handler returns: said here, it could find stderr in
        the middle of a write), and uvicorn told to stop (at its next tick: no new
        connection, each open one closed once its answer, aborted, has ended)."""
        if self.stopped_by is None:
            self.stopped_by = sig
            line = f"{self.prog}: stopping on {why(sig)}; what is in flight is aborted"
            asyncio.get_running_loop().call_soon_threadsafe(say, line)
        self.llm.abort_all()
        super().handle_exit(sig, frame)
