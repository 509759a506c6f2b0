"""The rules the serving handlers apply to a request before the engine sees it, checked directly:
what ``max_tokens`` is when a request gives none, and which sampling a request gets when it
leaves fields out (vLLM's rules both)."""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from front.serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from front.serve.serving_chat import OpenAIServingChat
from front.serve.serving_completion import OpenAIServingCompletion
from front.serve.serving_engine import DEFAULT_MAX_TOKENS, EnginePrompt, OpenAIServing, ServedModel

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
    with pytest.raises(OpenAIError) as info:
        serving().sampling_params(CompletionRequest(prompt="x", top_k=-5), PROMPT)
    assert info.value.status == 400 and info.value.param == "top_k"
