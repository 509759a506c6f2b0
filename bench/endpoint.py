"""An OpenAI-compatible server as a way of serving (``--workload serving --endpoint URL``): the
same timed requests, sent over HTTP, to ``python -m step14_7.serve`` or to ``vllm serve`` alike.

Each request goes at its arrival time (the client sleeps until then: over HTTP nothing cuts the
idle waits) as ``POST /v1/completions``: the prompt's token ids, greedy, ``ignore_eos`` (vLLM's:
every answer runs to its ``max_tokens``, as in process), streamed. Its times are the client's:
when it was sent, the first event that carries text, the last one. Its token count and what the
prefix cache served come from the answer's ``usage``. The server's rounds are not visible from
here: an endpoint's run has no busy share, and its runs rank by their duration.

Every run starts from a cold cache, as in process: ``POST /reset_prefix_cache`` before it (vLLM
serves that endpoint only with ``VLLM_SERVER_DEV_MODE=1``; without it, the runs after the first
find the prefix cached, and the bench says so).

One event per token is what TPOT needs: a tokenizer whose every token decodes to text of its
own gives it (``python -m front.toy_checkpoint`` writes one); a byte-level one holds back the
bytes of a cut character, and its events then come fewer and later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from common.errors import MissingPackageError, UserError

from .latency import RequestTimes, RunFigures, Serve, TimedRequest


class EndpointError(UserError):
    """The server could not be reached, refused a request, or answered what this client
    cannot read: one ``error:`` line."""


@dataclass(frozen=True)
class Endpoint:
    """Where the requests go: ``url`` (``http://host:port``, the API under ``/v1``)."""

    url: str

    @property
    def cache(self) -> str:
        return "server's"  # the table's prefix cache column: whatever the server does


def endpoint_url(text: str) -> str:
    """``--endpoint``: ``http(s)://host[:port]``, the server's root (``/v1`` is added)."""
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a server's URL, e.g. http://127.0.0.1:8000"
        )
    return text.rstrip("/").removesuffix("/v1")


def httpx_module() -> Any:
    """``httpx``, the client (a dependency of the ``serve`` extra)."""
    try:
        import httpx
    except ImportError:
        raise MissingPackageError(
            "--endpoint needs the 'httpx' package: pip install -e '.[serve]'"
        ) from None
    return httpx


def check_reachable(url: str) -> None:
    """The server answers ``GET /v1/models`` with a model: said before any work."""
    httpx = httpx_module()
    try:
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise EndpointError(f"{url}/v1/models: no OpenAI-compatible server there ({exc})") from None
    if not models:
        raise EndpointError(f"{url}/v1/models lists no model")


def endpoint_serve(endpoint: Endpoint) -> Serve:
    """Serving by ``endpoint``: each call resets its prefix cache, then sends the requests at
    their arrival times and times the answers."""

    def serve(requests: list[TimedRequest]) -> RunFigures:
        return asyncio.run(send_all(endpoint.url, requests))

    return serve


def reset_prefix_cache(url: str) -> bool:
    """Empty the server's prefix cache; False when it has no such endpoint."""
    httpx = httpx_module()

    try:
        answer = httpx.post(url + "/reset_prefix_cache", timeout=60)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {exc}") from None
    return answer.status_code < 300


async def send_all(url: str, requests: list[TimedRequest]) -> RunFigures:
    httpx = httpx_module()

    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        try:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise EndpointError(f"{url}/v1/models does not name a model: {exc!r}") from None
        start = time.perf_counter()
        answers = await asyncio.gather(*(send(client, model, r, start) for r in requests))
    times = [t for t, _ in answers]
    stats = {
        "prompt_tokens": sum(usage["prompt_tokens"] for _, usage in answers),
        "cached_tokens": sum(cached_tokens(usage) for _, usage in answers),
    }
    duration = max(t.last_token for t in times) - min(t.arrival for t in times)
    return RunFigures(times, duration, stats)


async def send(
    client: Any, model: str, request: TimedRequest, start: float
) -> tuple[RequestTimes, dict[str, Any]]:
    """One request, sent at its arrival: its times (seconds since ``start``) and its usage."""
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, usage = RequestTimes(time.perf_counter() - start), None
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            text = (await answer.aread()).decode(errors="replace")
            raise EndpointError(f"the server answered {answer.status_code}: {text}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["choices"] and event["choices"][0].get("text"):
                times.record(time.perf_counter() - start, times.tokens + 1)
            usage = event.get("usage") or usage
    if usage is None:
        raise EndpointError("the stream ended without its usage (stream_options.include_usage)")
    times.tokens = usage["completion_tokens"]
    return times, usage


def cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens``, 0 when the server does not say."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
