"""The checkpoint's eos ends an answer ("stop", the eos left out of the text), and vLLM's
``ignore_eos`` runs it to ``max_tokens``: the app in-process (Starlette's ``TestClient``), over
step14_7's engine on the server's checkpoint, with an eos picked from a free run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from common.sampling_params import SamplingParams
from front.codec import TextCodec
from front.serve.serving_models import ServedModel
from front.steps import load_step
from tests.helpers import STEP_NAMES
from tests.serve.in_process import served_app
from tests.serve.server_process import ENGINE_OVERRIDES

PROMPT = "The weather is nice today"
NEW_TOKENS = 12


@dataclass
class WithEos:
    client: TestClient
    free: list[int]  # the greedy answer with no eos
    at: int  # where the eos is in it, the first time
    codec: TextCodec


@pytest.fixture
def with_eos(chat_checkpoint: Path) -> Iterator[WithEos]:
    """The app, whose checkpoint's eos is a token of the greedy answer to ``PROMPT`` (its 4th
    or later, the first time it comes)."""
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(chat_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    codec = TextCodec.load(chat_checkpoint)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    free = engine.generate([codec.completion_ids(PROMPT)], sampling_params=params)[0]
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    codec = TextCodec(codec.tokenizer, codec.template, [eos])
    served = ServedModel("toy", codec, model.cfg.max_model_len, {"temperature": 1.0})
    with TestClient(served_app(lambda: engine, model.cfg, served)) as client:
        yield WithEos(client, free, free.index(eos), codec)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_eos_stops_an_answer_unless_it_is_ignored(with_eos: WithEos, stream: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    free, at, decode = with_eos.free, with_eos.at, with_eos.codec.decode
    assert finish(with_eos.client, body, stream) == ("stop", at + 1, decode(free[:at]))
    ignored = finish(with_eos.client, {**body, "ignore_eos": True}, stream)
    assert ignored == ("length", NEW_TOKENS, decode(free))


def finish(client: TestClient, body: dict, stream: bool) -> tuple[str, int, str]:
    """(finish_reason, completion_tokens, text) of a completion, whole or streamed."""
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    if not stream:
        data = answer.json()
        choice = data["choices"][0]
        return choice["finish_reason"], data["usage"]["completion_tokens"], choice["text"]
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line[6:7] == "{"]
    choices = [event["choices"][0] for event in events if event["choices"]]
    text = "".join(choice["text"] for choice in choices)
    return choices[-1]["finish_reason"], events[-1]["usage"]["completion_tokens"], text
