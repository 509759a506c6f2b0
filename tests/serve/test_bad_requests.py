"""A bad request gets its 4xx in OpenAI's shape, with a message that names the field, and the
server goes on serving: never a 500, never a traceback.

Each row of ``BAD`` is sent to each step's server, raw (``httpx``), and a good request follows
it. The API key guards ``/v1/*`` only: ``/health`` and ``/metrics`` answer without it.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serve.server_process import API_KEY, CONTEXT, SERVED_NAME, ServerProcess

KEY = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": HELLO, "max_tokens": 4, **fields}


IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
OUTSIDE = 10**6  # a token id past any vocabulary here

# (name, path, body (a dict is sent as JSON, bytes as they are), headers, status, the field
# the error names (its ``param``), what its message must say)
BAD: list[tuple[str, str, Any, dict[str, str], int, str | None, str]] = [
    ("malformed JSON", CHAT, b'{"messages": [', KEY, 400, None, "not valid JSON"),
    ("not an object", CHAT, b"[1, 2]", KEY, 400, None, "JSON object"),
    ("no messages", CHAT, {"model": SERVED_NAME}, KEY, 400, "messages", "messages"),
    ("empty messages", CHAT, chat(messages=[]), KEY, 400, "messages", "empty"),
    ("message without role", CHAT, chat(messages=[{"content": "x"}]), KEY, 400, "messages", "role"),
    ("image part", CHAT, chat(messages=IMAGE), KEY, 400, "messages", "text parts"),
    ("temperature -1", CHAT, chat(temperature=-1), KEY, 400, "temperature", "temperature"),
    ("temperature a string", CHAT, chat(temperature="hot"), KEY, 400, "temperature", "number"),
    ("top_p 0", CHAT, chat(top_p=0), KEY, 400, "top_p", "top_p"),
    ("top_k -2", CHAT, chat(top_k=-2), KEY, 400, "top_k", "top_k"),
    ("max_tokens 0", CHAT, chat(max_tokens=0), KEY, 400, "max_tokens", "max_tokens"),
    ("max_tokens true", CHAT, chat(max_tokens=True), KEY, 400, "max_tokens", "integer"),
    ("seed -1", CHAT, chat(seed=-1), KEY, 400, "seed", "seed"),
    ("stop id outside", CHAT, chat(stop_token_ids=[OUTSIDE]), KEY, 400, "stop_token_ids", "vocab"),
    ("past the context", CHAT, chat(max_tokens=CONTEXT), KEY, 400, "messages", f"is {CONTEXT}"),
    ("n 0", CHAT, chat(n=0), KEY, 400, "n", "greater than or equal to 1"),
    ("an empty stop string", CHAT, chat(stop=[""]), KEY, 400, "stop", "at least 1"),
    ("best_of above n", COMPLETIONS, {"prompt": "x", "best_of": 3}, KEY, 400, "best_of", "n"),
    ("logprobs 21", COMPLETIONS, {"prompt": "x", "logprobs": 21}, KEY, 400, "logprobs", "20"),
    ("top_logprobs alone", CHAT, chat(top_logprobs=2), KEY, 400, "top_logprobs", "logprobs"),
    ("echo on chat", CHAT, chat(echo=True), KEY, 400, "echo", "not supported"),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), KEY, 400, "tools", "not supported"),
    (
        "tool_choice required",
        CHAT,
        chat(tool_choice="required"),
        KEY,
        400,
        "tool_choice",
        "not supported",
    ),
    (
        "response_format json",
        CHAT,
        chat(response_format={"type": "json_object"}),
        KEY,
        400,
        "response_format",
        "not supported",
    ),
    ("logit_bias", CHAT, chat(logit_bias={"5": 1}), KEY, 400, "logit_bias", "not supported"),
    (
        "max_completion_tokens on completions",
        COMPLETIONS,
        {"prompt": "x", "max_completion_tokens": 4},
        KEY,
        400,
        "max_completion_tokens",
        "not supported",
    ),
    (
        "repetition_penalty 0",
        CHAT,
        chat(repetition_penalty=0),
        KEY,
        400,
        "repetition_penalty",
        "greater than 0",
    ),
    ("presence_penalty 3", CHAT, chat(presence_penalty=3), KEY, 400, "presence_penalty", "2"),
    ("min_p 2", CHAT, chat(min_p=2), KEY, 400, "min_p", "1"),
    ("prompt a number", COMPLETIONS, {"prompt": 3}, KEY, 400, "prompt", "prompt"),
    ("prompt ids outside", COMPLETIONS, {"prompt": [1, OUTSIDE]}, KEY, 400, "prompt", "vocab"),
    ("empty prompt", COMPLETIONS, {"prompt": []}, KEY, 400, "prompt", "empty"),
    ("an empty prompt in a list", COMPLETIONS, {"prompt": ["a", ""]}, KEY, 400, "prompt", "empty"),
    ("tokenize nothing", "/tokenize", {}, KEY, 400, "prompt", "prompt or messages"),
    ("detokenize outside", "/detokenize", {"tokens": [OUTSIDE]}, KEY, 400, "tokens", "vocab"),
    ("reset without the key", "/reset_prefix_cache", {}, {}, 401, None, "API key"),
    ("tokenize without the key", "/tokenize", {"prompt": "x"}, {}, 401, None, "API key"),
    ("unknown model", CHAT, chat(model="gpt-4"), KEY, 404, "model", "gpt-4"),
    ("no API key", CHAT, chat(), {}, 401, None, "API key"),
    ("wrong API key", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None, "API key"),
    ("unknown path", "/v1/embeddings", chat(), KEY, 404, None, "Not Found"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param", "says"),
    [row[1:] for row in BAD],
    ids=[row[0] for row in BAD],
)
def test_a_bad_request_gets_its_4xx_and_the_next_one_is_served(
    server: ServerProcess,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    param: str | None,
    says: str,
) -> None:
    if isinstance(body, bytes):  # sent as it is, said to be JSON
        sent = {"content": body, "headers": {**headers, "Content-Type": "application/json"}}
    else:
        sent = {"json": body, "headers": headers}
    answer = httpx.post(server.url + path, **sent)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"], error
    assert "Traceback" not in answer.text
    good = httpx.post(server.url + CHAT, headers=KEY, json=chat())
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 4


def test_only_health_and_metrics_are_open(server: ServerProcess) -> None:
    """As in vLLM: a load balancer and Prometheus need no key; everything else does."""
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=KEY).status_code == 200


def test_curl_d_without_a_content_type_is_read_as_json(server: ServerProcess) -> None:
    """``curl -d`` says ``application/x-www-form-urlencoded``; the body is JSON all the same."""
    body = b'{"prompt": "hello", "max_tokens": 3}'
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {**KEY, **({"Content-Type": content_type} if content_type else {})}
        answer = httpx.post(server.url + COMPLETIONS, content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3


def test_a_method_a_path_does_not_take_is_405_with_allow(server: ServerProcess) -> None:
    answer = httpx.delete(server.url + COMPLETIONS, headers=KEY)
    assert answer.status_code == 405
    assert answer.headers["allow"] == "POST"
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
