"""The server answers as the engine does, whoever asks and however many at once.

Every test runs against each step's server (a real ``python -m <step>.serve`` in a
subprocess), driven by the real ``openai`` client or raw HTTP:

- a streamed answer is the whole answer, piece by piece, and both are what the step's engine
  gives offline for the same seed; ``temperature: 0`` is ``generate_text``'s answer; a request
  without a temperature samples at 1.0 (the checkpoint has no ``generation_config`` default);
- 16 seeded, sampled requests sent at once each get what they get alone: batching across HTTP
  requests changes nothing;
- the second turn of a chat reports ``cached_tokens > 0``, and ``/metrics``' hits grow;
- a stream the client drops after two chunks is aborted, the pool is left clean, and the next
  request is served;
- ``stop_token_ids``, token-id prompts, ``/v1/models``, ``/reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import time
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai

from common.sampling_params import SamplingParams
from front.codec import TextCodec
from front.steps import load_step
from front.text import TextOptions, generate_text
from tests.serve.server_process import (
    API_KEY,
    CONTEXT,
    ENGINE,
    ENGINE_OVERRIDES,
    SERVED_NAME,
    ServerProcess,
    metric,
    sse_events,
)

SYSTEM = "You are a helpful assistant. Answer briefly, politely and in plain words."
PROMPT = "The weather is nice today and the cat"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 5}
WAIT_S = 120  # the longest a test waits for the server to go idle: past it, something hangs


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def chat(*turns: str) -> list[dict[str, str]]:
    """A conversation behind the system prompt: user, assistant, user, ... turns."""
    roles = ["user", "assistant"]
    return [
        {"role": "system", "content": SYSTEM},
        *({"role": roles[i % 2], "content": text} for i, text in enumerate(turns)),
    ]


@cache
def offline(step_name: str, checkpoint: Path) -> tuple[Any, TextCodec]:
    """The step's engine on the server's weights, and the checkpoint's text side."""
    step = load_step(step_name)
    model = step.TinyTransformerPaged.from_pretrained(checkpoint, **ENGINE_OVERRIDES)
    return step.PagedPrefixCacheEngine(model), TextCodec.load(checkpoint)


def offline_text(server: ServerProcess, checkpoint: Path, prompt: Any, **params: Any) -> str:
    """What the step's engine answers, offline, to a prompt (a string or a conversation)."""
    engine, codec = offline(server.step_name, checkpoint)
    ids = codec.completion_ids(prompt) if isinstance(prompt, str) else codec.chat_ids(prompt)
    output = engine.generate([ids], sampling_params=SamplingParams(**params))[0]
    return codec.decode(output)


def metrics(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics").text


def wait_for(server: ServerProcess, running: int, waiting: int = 0) -> str:
    """``/metrics`` once that many requests run and wait (polled; a hang fails after
    ``WAIT_S``)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        text = metrics(server)
        queues = (
            metric(text, "vllm:num_requests_running"),
            metric(text, "vllm:num_requests_waiting"),
        )
        if queues == (running, waiting):
            return text
        time.sleep(0.02)
    raise AssertionError(f"not {running} running and {waiting} waiting after {WAIT_S} s")


def wait_until_idle(server: ServerProcess) -> str:
    return wait_for(server, running=0)


# ---- the answer is the engine's ---------------------------------------------------------------


def test_a_streamed_completion_is_the_whole_one_and_the_engines(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    api = client(server)
    params = {"max_tokens": 24, **SAMPLED}
    whole = api.completions.create(model=SERVED_NAME, prompt=PROMPT, **params)
    chunks = list(api.completions.create(model=SERVED_NAME, prompt=PROMPT, stream=True, **params))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.choices[0].text == offline_text(server, chat_checkpoint, PROMPT, **params)


def test_a_streamed_chat_is_the_whole_one_and_the_engines(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    api = client(server)
    messages = chat("Is the cat happy?")
    params = {"max_tokens": 20, "extra_body": {"top_k": 40}, **SAMPLED}
    whole = api.chat.completions.create(model=SERVED_NAME, messages=messages, **params)
    stream = api.chat.completions.create(
        model=SERVED_NAME, messages=messages, stream=True, **params
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    engine_params = {"max_tokens": 20, "top_k": 40, **SAMPLED}
    assert streamed == offline_text(server, chat_checkpoint, messages, **engine_params)


def test_temperature_0_is_generate_text(server: ServerProcess, chat_checkpoint: Path) -> None:
    messages = chat("Say something about the sun.")
    answer = client(server).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=16, temperature=0
    )
    options = TextOptions(max_new_tokens=16, engine=ENGINE)
    text = generate_text(server.step_name, chat_checkpoint, [messages], options)
    assert answer.choices[0].message.content == text.outputs[0]


def test_without_a_temperature_a_request_samples_at_1(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    """The checkpoint's generation_config has no temperature: vLLM's default, 1.0, applies
    (not the engine's own default, greedy)."""
    answer = client(server).completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=16, seed=11
    )
    expected = offline_text(
        server, chat_checkpoint, PROMPT, max_tokens=16, temperature=1.0, seed=11
    )
    assert answer.choices[0].text == expected
    greedy = offline_text(server, chat_checkpoint, PROMPT, max_tokens=16)
    assert expected != greedy  # else the test could not tell them apart


def test_sixteen_requests_at_once_each_get_what_they_get_alone(server: ServerProcess) -> None:
    """Seeded, sampled chat requests, batched by the engine across HTTP requests (and sharing
    the system prompt's blocks): each gets the text it gets sent alone."""

    async def ask(api: openai.AsyncOpenAI, i: int) -> str:
        answer = await api.chat.completions.create(
            model=SERVED_NAME,
            messages=chat(f"Question {i}: is the weather nice?"),
            max_tokens=12 + i,
            temperature=1.0,
            seed=100 + i,
        )
        return answer.choices[0].message.content

    async def together_then_alone() -> tuple[list[str], list[str]]:
        url = server.url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0) as api:
            together = await asyncio.gather(*(ask(api, i) for i in range(16)))
            return together, [await ask(api, i) for i in range(16)]

    together, alone = asyncio.run(together_then_alone())
    assert together == alone
    assert len(set(together)) == 16


def test_a_prompt_of_token_ids_is_the_same_as_its_text(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    _, codec = offline(server.step_name, chat_checkpoint)
    api = client(server)
    ids = codec.completion_ids(PROMPT)
    by_text = api.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, seed=3)
    by_ids = api.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=8, seed=3)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_a_stop_token_ends_the_answer_before_it(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    """The third token of a free run, given as a stop id, ends the answer there ("stop"); it
    counts as generated, and is not in the text."""
    engine, codec = offline(server.step_name, chat_checkpoint)
    ids = codec.completion_ids(PROMPT)
    free = engine.generate([ids], sampling_params=SamplingParams(max_tokens=12, seed=7))[0]
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    answer = client(server).completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        seed=7,
        extra_body={"stop_token_ids": [stop]},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == free.index(stop) + 1
    assert answer.choices[0].text == codec.decode(free[: free.index(stop)])


# ---- the prefix cache across requests ---------------------------------------------------------


def test_the_second_turn_of_a_chat_comes_from_the_cache(server: ServerProcess) -> None:
    """Turn 2 starts with turn 1's prompt and answer: the cache serves their full blocks,
    ``usage`` says how many tokens, and /metrics' hits grow by at least as many."""
    api = client(server)
    hits_before = metric(wait_until_idle(server), "vllm:prefix_cache_hits_total")
    first = api.chat.completions.create(
        model=SERVED_NAME, messages=chat("Tell me about the cat."), max_tokens=12, seed=1
    )
    reply = first.choices[0].message.content
    second = api.chat.completions.create(
        model=SERVED_NAME,
        messages=chat("Tell me about the cat.", reply, "And the weather?"),
        max_tokens=12,
        seed=2,
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 4  # all but the last, partial block
    hits = metric(wait_until_idle(server), "vllm:prefix_cache_hits_total")
    assert hits - hits_before >= cached > 0


def test_reset_prefix_cache_waits_for_the_requests_to_end(server: ServerProcess) -> None:
    """409 while a request runs (its blocks are in the cache); once idle, 200, and the next
    request hits nothing."""
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": CONTEXT // 2, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers):
        wait_for(server, running=1)
        refused = httpx.post(server.url + "/reset_prefix_cache", headers=headers)
        assert refused.status_code == 409, refused.text
        assert "running" in refused.json()["error"]["message"]
    wait_until_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401  # the key
    assert httpx.post(server.url + "/reset_prefix_cache", headers=headers).status_code == 200
    again = client(server).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


# ---- a client that goes away ------------------------------------------------------------------


def test_a_dropped_stream_is_aborted_and_the_pool_left_clean(server: ServerProcess) -> None:
    """The client reads two chunks of a long answer and hangs up: the request is aborted (not
    run to its end), no block stays held, and the next request is served."""
    before = wait_until_idle(server)
    aborted = metric(before, "vllm:request_success_total", finished_reason="abort")
    generated = metric(before, "vllm:generation_tokens_total")
    max_tokens = CONTEXT - 64
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
        events = sse_events(r.iter_lines())
        next(events), next(events)
    after = wait_until_idle(server)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(after, "vllm:generation_tokens_total") - generated < max_tokens
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    answer = client(server).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4)
    assert answer.usage.completion_tokens == 4


def test_a_client_that_leaves_before_a_whole_answer_is_aborted(server: ServerProcess) -> None:
    """Not streamed: the client gives up waiting (its timeout) and hangs up; the server sees it
    and aborts the request instead of computing an answer nobody reads."""
    before = wait_until_idle(server)
    aborted = metric(before, "vllm:request_success_total", finished_reason="abort")
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": CONTEXT - 64}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=0.2) as impatient:
        try:
            impatient.post(server.url + "/v1/completions", json=body, headers=headers)
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("the answer came within 0.2 s: it was meant to take longer")
    after = wait_until_idle(server)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_metrics_count_each_request_and_token_once(server: ServerProcess) -> None:
    """One request of 5 tokens: one time to first token, four gaps between tokens, one
    end-to-end latency, five generated tokens, its prompt's tokens, one "length"."""
    series = {
        "ttft": ("vllm:time_to_first_token_seconds_count", {}),
        "tpot": ("vllm:time_per_output_token_seconds_count", {}),
        "e2e": ("vllm:e2e_request_latency_seconds_count", {}),
        "generated": ("vllm:generation_tokens_total", {}),
        "prompt": ("vllm:prompt_tokens_total", {}),
        "queried": ("vllm:prefix_cache_queries_total", {}),
        "length": ("vllm:request_success_total", {"finished_reason": "length"}),
    }
    before = wait_until_idle(server)
    answer = client(server).completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5)
    after = wait_until_idle(server)
    grew = {
        key: metric(after, name, **labels) - metric(before, name, **labels)
        for key, (name, labels) in series.items()
    }
    prompt = answer.usage.prompt_tokens
    expected = {"ttft": 1, "tpot": 4, "e2e": 1, "generated": 5, "length": 1}
    assert grew == {**expected, "prompt": prompt, "queried": prompt}


def test_models_lists_the_served_name(server: ServerProcess) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
