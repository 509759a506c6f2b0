"""``/tokenize`` and ``/detokenize``, as vLLM serves them: a prompt's ids are the ids
``/v1/completions`` computes for it, a conversation's those ``/v1/chat/completions`` computes
(the usage's ``prompt_tokens`` says so), with vLLM's defaults for special tokens (a prompt
gets the tokenizer's BOS unless ``add_special_tokens: false``, a conversation only what its
template writes), and the ids come back to their text. The app in-process (Starlette's
``TestClient``), on a checkpoint whose tokenizer adds a BOS, as Llama's does: with one that
adds none, both settings give the same ids and the default would go unchecked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from front.codec import TextCodec
from front.serve.serving_models import ServedModel
from front.steps import load_step
from tests.helpers import STEP_NAMES
from tests.serve.conftest import BOS
from tests.serve.in_process import served_app
from tests.serve.server_process import ENGINE_OVERRIDES

PROMPT = "Grüße aus München! The weather is nice"
MESSAGES = [{"role": "user", "content": "Is the cat happy?"}]


@pytest.fixture(scope="module")
def client(bos_checkpoint: Path) -> Iterator[TestClient]:
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(bos_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    served = ServedModel("toy", TextCodec.load(bos_checkpoint), 2048, {"temperature": 1.0})
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


def test_a_prompt_gets_the_bos_by_default_and_only_it_goes_without(client: TestClient) -> None:
    """The default is the tokenizer's special tokens, as ``/v1/completions`` feeds the engine:
    the BOS first; ``add_special_tokens: false`` drops exactly it."""
    default = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    bare = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert default["token_strs"][0] == BOS
    assert default["tokens"][1:] == bare["tokens"] and bare["count"] == default["count"] - 1
    explicit = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": True})
    assert explicit.json()["tokens"] == default["tokens"]


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
    special = client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True})
    assert special.json()["tokens"][1:] == tokens["tokens"]  # the BOS on top of the template's
