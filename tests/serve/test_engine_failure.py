"""When the engine's ``step()`` raises, every request in flight gets an error and none hangs:
a whole answer is a 500 in OpenAI's shape, a stream ends with an error event and
``[DONE]``, later requests get a 500 too, and ``/health`` says 503. The app in-process
(Starlette's ``TestClient``), step14_7's engine made to fail at its third round."""

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

BODY = {"prompt": "The weather is nice today", "max_tokens": 50, "temperature": 0}


@pytest.fixture
def failing_app(chat_checkpoint: Path) -> Iterator[TestClient]:
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(chat_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    real_step, rounds = engine.step, [0]

    def failing_step() -> list:
        rounds[0] += 1
        if rounds[0] == 3:
            raise RuntimeError("the model failed")
        return real_step()

    engine.step = failing_step
    served = ServedModel("toy", TextCodec.load(chat_checkpoint), 2048, {"temperature": 1.0})
    with TestClient(served_app(lambda: engine, model.cfg, served)) as client:
        yield client


def test_a_whole_answer_in_flight_gets_a_500_and_so_does_every_later_one(
    failing_app: TestClient,
) -> None:
    assert failing_app.get("/health").status_code == 200
    for _ in range(2):  # in flight when the engine failed, then after
        whole = failing_app.post("/v1/completions", json=BODY)
        assert whole.status_code == 500
        error = whole.json()["error"]
        assert "the model failed" in error["message"] and error["type"] == "server_error"
    assert failing_app.get("/health").status_code == 503


def test_a_stream_in_flight_ends_with_the_error(failing_app: TestClient) -> None:
    streamed = failing_app.post("/v1/completions", json={**BODY, "stream": True})
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "the model failed" in events[-2] and events[-1] == "data: [DONE]"
