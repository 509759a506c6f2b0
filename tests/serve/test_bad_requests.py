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
    ("n 2", CHAT, chat(n=2), KEY, 400, "n", "not supported"),
    ("stop strings", CHAT, chat(stop=["\n"]), KEY, 400, "stop", "not supported"),
    ("prompt a number", COMPLETIONS, {"prompt": 3}, KEY, 400, "prompt", "prompt"),
    ("prompt ids outside", COMPLETIONS, {"prompt": [1, OUTSIDE]}, KEY, 400, "prompt", "vocab"),
    ("empty prompt", COMPLETIONS, {"prompt": []}, KEY, 400, "prompt", "empty"),
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


def test_only_v1_is_behind_the_key(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=KEY).status_code == 200
