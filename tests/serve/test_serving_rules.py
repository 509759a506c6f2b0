"""The rules the serving handlers apply to a request before the engine sees it, checked directly:
what ``max_tokens`` is when a request gives none, which sampling a request gets when it leaves
fields out (vLLM's rules both), each choice's seed, and the four forms of a prompt."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.sampling_params import SamplingParams
from front.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    validation_error,
)
from front.serve.serving_chat import OpenAIServingChat
from front.serve.serving_completion import OpenAIServingCompletion
from front.serve.serving_engine import DEFAULT_MAX_TOKENS, OpenAIServing, child_params
from front.serve.serving_models import EnginePrompt, ServedModel

DEFAULTS = {"temperature": 0.6, "top_p": 0.9}  # as a checkpoint's generation_config gives


def serving(max_model_len: int | None = 100, chat: bool = False) -> OpenAIServing:
    model = ServedModel("toy", codec=None, max_model_len=max_model_len, sampling_defaults=DEFAULTS)
    endpoint = OpenAIServingChat if chat else OpenAIServingCompletion
    return endpoint(llm=None, model=model)  # type: ignore[arg-type]


PROMPT = EnginePrompt([1] * 30, "messages")


def test_without_max_tokens_a_chat_answer_may_fill_the_context() -> None:
    chat = ChatCompletionRequest(messages=[])
    assert serving(chat=True).sampling_params(chat, PROMPT).max_tokens == 70
    assert serving(None, chat=True).sampling_params(chat, PROMPT).max_tokens == DEFAULT_MAX_TOKENS
    completion = CompletionRequest(prompt="x")
    assert serving().sampling_params(completion, PROMPT).max_tokens == 16
    newer = ChatCompletionRequest(messages=[], max_completion_tokens=5, max_tokens=9)
    assert serving(chat=True).sampling_params(newer, PROMPT).max_tokens == 5


def test_a_request_falls_back_on_the_checkpoints_sampling_field_by_field() -> None:
    request = CompletionRequest(prompt="x", max_tokens=3, top_p=0.5, seed=7)
    params = serving().sampling_params(request, PROMPT)
    assert params == SamplingParams(max_tokens=3, temperature=0.6, top_p=0.5, seed=7)
    greedy = CompletionRequest(prompt="x", temperature=0)
    assert serving().sampling_params(greedy, PROMPT).greedy


def test_a_bad_value_names_its_field() -> None:
    """Refused by the request's model (its bounds are the published schema's), and, past it,
    by the engine's own check: each names the field."""
    with pytest.raises(ValidationError) as schema:
        CompletionRequest.model_validate_json('{"prompt": "x", "top_k": -5}')
    assert validation_error(schema.value.errors()).param == "top_k"
    with pytest.raises(OpenAIError) as engine:
        past_schema = CompletionRequest.model_construct(prompt=["x"], top_k=-5)
        serving().sampling_params(past_schema, PROMPT)
    assert engine.value.status == 400 and engine.value.param == "top_k"


def test_n_choices_get_seed_plus_i_as_vllms_parent_request_gives_them() -> None:
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=40)
    assert [child_params(params, i).seed for i in range(3)] == [40, 41, 42]
    unseeded = SamplingParams(max_tokens=3, temperature=1.0)
    assert all(child_params(unseeded, i).seed is None for i in range(3))


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_a_prompt_comes_in_four_forms(prompt: object, expected: object) -> None:
    assert CompletionRequest(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [[1], []], [1, "a"], [[-1]], 3, True])
def test_an_empty_or_mixed_prompt_is_refused_by_name(prompt: object) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=prompt)
    assert validation_error(info.value.errors()).param == "prompt"
