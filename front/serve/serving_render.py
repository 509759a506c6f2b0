"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` (vLLM's
``serve/render``): a request's prompt as the token ids the engine would get, without running it.

A router that routes by prefix needs the request's tokens. ``vllm-router``'s ``cache_aware``
and ``kv_aware`` do not tokenize an HTTP worker's requests themselves: before routing, they ask
a worker to render the request (then ``/tokenize``). Without these endpoints every request
reached the router's policy without tokens (its metric
``vllm_router_prefix_routing_decisions_total{outcome="missing_tokens"}``), so ``cache_aware``
fell back to the least loaded worker, and did no better than round robin (docs/scale-out.md).

The answer is vLLM's shape: a completion renders to a list of ``GenerateRequest``s (one per
prompt), a chat to one; of their fields this server fills ``request_id``, ``token_ids`` and
``model``. The ids are exactly what ``/v1/completions`` and ``/v1/chat/completions`` give the
engine for the same body: the same ``engine_prompt`` makes both.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from . import protocol
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving_engine import OpenAIServing


def add_render_routes(router: APIRouter, completion: OpenAIServing, chat: OpenAIServing) -> None:
    """The two routes, on ``router`` (``/v1``, behind the API key like the rest)."""

    @router.post("/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        return [await generate_request(completion, body)]

    @router.post("/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return await generate_request(chat, body)


async def generate_request(serving: OpenAIServing, request: Any) -> dict[str, Any]:
    """The request's prompt, checked and tokenized (off the event loop) as its endpoint does."""
    serving.check_model(request)
    prompt = await asyncio.to_thread(serving.engine_prompt, request)
    return {
        "request_id": protocol.new_id(serving.id_prefix),
        "token_ids": prompt.ids,
        "model": serving.model.name,
    }
