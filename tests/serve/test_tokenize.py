"""``/tokenize`` and ``/detokenize``, as vLLM serves them: a prompt's ids are the ids
``/v1/completions`` computes for it, a conversation's those ``/v1/chat/completions`` computes
(the usage's ``prompt_tokens`` says so), with vLLM's defaults for special tokens, and the ids
come back to their text. The app in-process (Starlette's ``TestClient``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from front.codec import TextCodec
from front.serve.serving_models import ServedModel
from front.steps import load_step
from tests.helpers import STEP_NAMES
from tests.serve.in_process import served_app
from tests.serve.server_process import ENGINE_OVERRIDES

PROMPT = "Grüße aus München! The weather is nice"
MESSAGES = [{"role": "user", "content": "Is the cat happy?"}]


@pytest.fixture(scope="module")
def client(chat_checkpoint: Path) -> Iterator[TestClient]:
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(chat_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    served = ServedModel("toy", TextCodec.load(chat_checkpoint), 2048, {"temperature": 1.0})
    with TestClient(served_app(lambda: engine, model.cfg, served)) as test_client:
        yield test_client


def test_a_prompt_tokenizes_as_a_completion_and_comes_back(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    completion = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] == 2048
    assert "".join(tokens["token_strs"]).endswith("nice")
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": PROMPT
    }


def test_a_conversation_tokenizes_as_a_chat(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert tokens["count"] == chat.json()["usage"]["prompt_tokens"]
    assert tokens["token_strs"] is None
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    header = tokens["tokens"][bare.json()["count"] :]  # the assistant's header, and only it
    assert tokens["tokens"][: bare.json()["count"]] == bare.json()["tokens"] and header
    text = client.post("/detokenize", json={"tokens": header}).json()["prompt"]
    assert "assistant" in text
