"""``POST /v1/completions/render`` and ``/v1/chat/completions/render`` (``serving_render.py``),
every step's server: the token ids the generating endpoint would give the engine for the same
body, in vLLM's shape (a list for a completion, one object for a chat), behind the API key,
refusing what the generating endpoint refuses. A prefix-aware router routes by these ids."""

from __future__ import annotations

from pathlib import Path

import httpx

from front.codec import TextCodec
from tests.serve.server_process import API_KEY, SERVED_NAME, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The weather is nice today and the cat"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, cat!"},
]


def render(server: ServerProcess, path: str, body: dict, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}/render", json=body, headers=headers, timeout=60)


def test_a_completion_renders_to_the_ids_it_runs_on(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    codec = TextCodec.load(chat_checkpoint)
    answer = render(
        server, "completions", {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3}
    )
    assert answer.status_code == 200
    [rendered] = answer.json()
    assert rendered["token_ids"] == codec.completion_ids(PROMPT)
    assert rendered["model"] == SERVED_NAME and rendered["request_id"].startswith("cmpl-")
    usage = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers=AUTH,
        timeout=60,
    ).json()["usage"]
    assert usage["prompt_tokens"] == len(rendered["token_ids"])
    ids = [5, 6, 7]
    assert render(server, "completions", {"prompt": ids}).json()[0]["token_ids"] == ids


def test_a_chat_renders_to_its_template(server: ServerProcess, chat_checkpoint: Path) -> None:
    answer = render(server, "chat/completions", {"model": SERVED_NAME, "messages": MESSAGES})
    assert answer.status_code == 200
    assert answer.json()["token_ids"] == TextCodec.load(chat_checkpoint).chat_ids(MESSAGES)


def test_render_refuses_what_the_endpoint_refuses(server: ServerProcess) -> None:
    assert render(server, "completions", {"prompt": PROMPT}, headers={}).status_code == 401
    unknown = render(server, "completions", {"model": "gpt-9", "prompt": PROMPT})
    assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
    bad = render(server, "completions", {"prompt": [1, "two"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
