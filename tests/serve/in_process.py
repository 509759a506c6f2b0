"""The server's app in this process, for Starlette's ``TestClient``: its engine on a thread,
started and stopped by ``build_async_engine_client`` as ``launch.py`` does it, inside the
client's event loop (an outer app's lifespan), with the app built over it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from common.config import ModelConfig
from front.serve.api_server import build_app
from front.serve.async_llm import build_async_engine_client
from front.serve.metrics import Metrics
from front.serve.serving_models import ServedModel


def served_app(
    make_engine: Callable[[], Any], cfg: ModelConfig, served: ServedModel, **app_args: Any
) -> FastAPI:
    """An app whose startup builds the engine and serves ``build_app``'s routes over it, and
    whose shutdown stops it."""
    metrics = Metrics(served.name, cfg.total_blocks)

    @asynccontextmanager
    async def lifespan(outer: FastAPI) -> AsyncIterator[None]:
        client = build_async_engine_client(cfg, make_engine, True, metrics.record)
        async with client as llm:
            outer.mount("/", build_app(llm, served, metrics, **app_args))
            yield

    # no schema of its own: /openapi.json is the served app's
    return FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
