"""The server assembled: the checkpoint's text side, the engine behind an ``AsyncLLM``, the
app, and uvicorn with a stop that aborts what is in flight first.

Imported once the packages are known to be there (``cli.require_packages``).
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from ...checkpoint import GENERATION_CONFIG_FILE, Checkpoint, read_json
from ...config import ModelConfig
from ...errors import CheckpointError, RequestError, UserError
from ...inputs import check_fits_pool
from ...sampling import SamplingParams
from ..cli import EngineOptions
from ..steps import load_step
from ..text import TextCodec, long_context_warning
from .api_server import build_app
from .async_llm import AsyncLLM
from .cli import ServeOptions
from .metrics import Metrics
from .serving import OpenAIServing, ServedModel

# generation_config.json's fields that vLLM takes as a request's defaults (the ones this
# engine has); HF's own default temperature, 1.0, when the file has none.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")
STOP_GRACE_S = 5  # the longest a stop waits for the answers in flight to end


def load_served_model(options: ServeOptions) -> tuple[ServedModel, ModelConfig, Path]:
    """Everything about the checkpoint but its weights, checked: the config with the flags,
    the text side (tokenizer, chat template, eos ids), the sampling defaults, the weights'
    names and shapes. Returns the config the model is to be built with, and its folder."""
    checkpoint = Checkpoint.open(options.model)
    cfg = checkpoint.model_config(**options.engine.model_overrides())
    check_pool_holds_context(cfg)
    warning = long_context_warning(cfg)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    codec = TextCodec.of(checkpoint)
    checkpoint.check_shapes(cfg)
    name = options.served_model_name or options.model
    defaults = sampling_defaults(checkpoint.folder)
    return ServedModel(name, codec, cfg.max_model_len, defaults), cfg, checkpoint.folder


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
    connections to close (a stream would otherwise run to its last token), and ends with one
    line: the signal, and whether every block came back to the pool."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, app: Any, prog: str) -> None:
        super().__init__(config)
        self.llm = llm
        self.app = app
        self.prog = prog
        self.stopped_by: str | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for listener in sockets or []:
            host, port = listener.getsockname()[:2]
            print(
                f"{self.prog}: serving on http://{host}:{port} (the OpenAI API under /v1); "
                "Ctrl-C stops it",
                flush=True,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        self.llm.abort_all()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        await super().shutdown(sockets)
        problems = self.app.state.pool_problems
        pool = "every block is back in the pool" if problems == [] else f"pool: {problems}"
        print(f"{self.prog}: stopped by {self.stopped_by or 'request'}; {pool}", file=sys.stderr)


@dataclass(frozen=True)
class EngineFactory:
    """What builds the engine where it runs (in the engine process: picklable, so plain
    fields): the step, the checkpoint and its config, the engine's options."""

    step_name: str
    folder: Path
    cfg: ModelConfig
    engine: EngineOptions

    def __call__(self) -> Any:
        self.engine.set_threads()
        step = load_step(self.step_name)
        model = step.TinyTransformerPaged.from_pretrained(self.folder, config=self.cfg)
        return step.PagedPrefixCacheEngine(
            model, max_running=self.engine.max_running, seed=self.engine.seed
        )


def start_engine(
    step_name: str, served: ServedModel, cfg: ModelConfig, folder: Path, options: ServeOptions
) -> tuple[AsyncLLM, Metrics]:
    """The engine, built and running (in a process of its own, unless
    ``--engine-in-thread``), and the metrics it feeds."""
    metrics = Metrics(served.name, cfg.total_blocks)
    make_engine = EngineFactory(step_name, folder, cfg, options.engine)
    if options.engine_in_thread:
        llm = AsyncLLM.in_thread(make_engine(), on_round=metrics.record)
    else:
        llm = AsyncLLM.in_process(make_engine, cfg, on_round=metrics.record)
    llm.start_core()
    return llm, metrics


def build_server(
    llm: AsyncLLM, metrics: Metrics, served: ServedModel, options: ServeOptions, prog: str
) -> EngineServer:
    app = build_app(llm, OpenAIServing(llm, served), metrics, options.api_key)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=STOP_GRACE_S
    )
    return EngineServer(config, llm, app, prog)
