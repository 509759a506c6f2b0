"""The published schema is what the server does: a schema fuzzer (schemathesis, in its ASGI
mode: the app in this process) sends each route requests made from ``/openapi.json``, valid
and not, and checks every answer with every default check: no 500, only documented statuses,
media types and headers, answers that match their models, valid requests accepted and invalid
ones refused, the key enforced where the schema says, ``Allow`` on a 405.

A few rules no JSON Schema can state are taught to the fuzzer (``filter_body``), so that it
does not count their refusals as the schema's lies: the prompt and the answer must fit the
context together, token ids must be in the vocabulary, a conversation must not end with the
assistant's turn, ``top_logprobs`` needs ``logprobs``, ``best_of`` equals ``n``, ``min_tokens``
at most ``max_tokens``, ``max_tokens: 0`` needs ``echo``, and ``/tokenize`` takes a prompt or
messages, not both. An integer written ``2.0`` is one, to JSON Schema and to the server alike
(``protocol.integral``): nothing is filtered for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("schemathesis")

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from starlette.testclient import TestClient

from front.codec import TextCodec
from front.serve.protocol import ChatCompletionRequest, CompletionRequest
from front.serve.serving_chat import OpenAIServingChat
from front.serve.serving_completion import OpenAIServingCompletion
from front.serve.serving_models import ServedModel
from front.steps import load_step
from tests.helpers import STEP_NAMES
from tests.serve.in_process import served_app
from tests.serve.server_process import ENGINE_OVERRIDES

CONTEXT = 48  # short answers: each request costs milliseconds
KEY = "fuzz-key"


@pytest.fixture(scope="module")
def app(chat_checkpoint: Path) -> Iterator[Any]:
    step = load_step(STEP_NAMES[-1])
    overrides = {**ENGINE_OVERRIDES, "max_model_len": CONTEXT}
    model = step.TinyTransformerPaged.from_pretrained(chat_checkpoint, **overrides)
    served = ServedModel("toy", TextCodec.load(chat_checkpoint), CONTEXT, {"temperature": 1.0})
    engine = step.PagedPrefixCacheEngine(model)
    yield served_app(lambda: engine, model.cfg, served, api_key=KEY), served, model.cfg
    schemathesis.python.asgi.shutdown_lifespans()


def fits(served: ServedModel, vocab: int, path: str, body: Any) -> bool:
    """Whether ``body`` passes the rules the schema cannot state."""
    if not isinstance(body, dict):
        return True
    prompt = body.get("prompt")
    nested = prompt if isinstance(prompt, list) else []
    lists = [body.get("stop_token_ids"), body.get("tokens"), prompt, *nested]
    ids = [t for ids in lists if isinstance(ids, list) for t in ids]
    if any(type(t) in (int, float) and t >= vocab for t in ids):
        return False
    if body.get("top_logprobs") and not body.get("logprobs"):
        return False
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        return False
    min_tokens, max_tokens = body.get("min_tokens"), body.get("max_tokens")
    top = max_tokens if type(max_tokens) in (int, float) else CONTEXT
    if type(min_tokens) in (int, float) and min_tokens > top:
        return False
    if type(max_tokens) in (int, float) and max_tokens == 0 and body.get("echo") is not True:
        return False
    if path == "/tokenize":
        given = [body.get(field) is not None for field in ("prompt", "messages")]
        return given[0] != given[1] and fits_prompt(served, vocab, body)
    return fits_prompt(served, vocab, body)


def fits_prompt(served: ServedModel, vocab: int, body: dict[str, Any]) -> bool:
    """Every prompt in the vocabulary, and with its answer within the context; a
    conversation ending with the user's (or any but the assistant's) turn."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":  # a negative case: any JSON
        return False
    try:
        if "prompt" in body:
            request = CompletionRequest.model_validate({"max_tokens": 1, **body})
            prompts = OpenAIServingCompletion(None, served).engine_prompts(request)  # type: ignore[arg-type]
        else:
            request = ChatCompletionRequest.model_validate({"max_tokens": 1, **body})
            prompts = OpenAIServingChat(None, served).engine_prompts(request)  # type: ignore[arg-type]
    except Exception:  # the server refuses it too, as the schema says
        return True
    asked = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    return all(all(t < vocab for t in p.ids) and len(p.ids) + asked <= CONTEXT for p in prompts)


def test_the_server_answers_as_its_schema_says(app: Any) -> None:
    asgi_app, served, cfg = app
    schema = schemathesis.openapi.from_asgi("/openapi.json", asgi_app)

    @schema.hook
    def filter_body(context: Any, body: Any) -> bool:
        return fits(served, cfg.vocab_size, context.operation.path, body)

    headers = {"Authorization": f"Bearer {KEY}"}
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        for mode in modes if operation.body else modes[:1]:  # nothing to get wrong otherwise

            @settings(
                max_examples=15,
                deadline=None,
                derandomize=True,  # the same requests every run: CI is not a lottery
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            @given(case=operation.as_strategy(mode))
            def check(case: Any) -> None:
                case.call_and_validate(headers=headers)

            try:
                check()
            except Exception as exc:  # every operation is tried, then all failures shown
                failures.append(f"{operation.label} ({mode}): {exc}")
    assert not failures, "\n\n".join(failures)


def test_405_names_the_methods_the_path_takes(app: Any) -> None:
    asgi_app = app[0]
    with TestClient(asgi_app) as client:
        answer = client.get("/v1/completions")
        assert answer.status_code == 405 and answer.headers["allow"] == "POST"
        schema = client.get("/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]
    assert "422" not in completions["responses"]
    assert {"400", "401", "404", "413"} <= set(completions["responses"])
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    health = schema["paths"]["/health"]["get"]["responses"]["200"]
    assert "content" not in health or not health["content"]
