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

from typing import Any

from .responses import GenerateRequest, new_id
from .serving_engine import OpenAIServing


class OpenAIServingRender:
    """The render twins of the two generating endpoints: each prompt as its endpoint would
    queue it, checked and tokenized the same way (on its tokenizer's thread)."""

    def __init__(self, completion: OpenAIServing, chat: OpenAIServing) -> None:
        self.completion = completion
        self.chat = chat

    async def render_completion(self, request: Any) -> list[GenerateRequest]:
        """One ``GenerateRequest`` per prompt (a completion may bring several)."""
        return await rendered(self.completion, request)

    async def render_chat(self, request: Any) -> GenerateRequest:
        [one] = await rendered(self.chat, request)
        return one


async def rendered(serving: OpenAIServing, request: Any) -> list[GenerateRequest]:
    serving.check_model(request)
    prompts = await serving.run(serving.tokenized, request)
    name = serving.model.name
    return [
        GenerateRequest(request_id=new_id(serving.id_prefix), token_ids=p.ids, model=name)
        for p in prompts
    ]
