"""Each request field vLLM's server takes does what vLLM says, through the real ``openai`` client
against each step's server, compared with ``generate_text`` on the same request (or with a
plain reference sampler written here, over the dense reference model):

- ``stop``: the text ends before the first stop string (after it, with
  ``include_stop_str_in_output``), ``finish_reason`` "stop" and ``stop_reason`` the string, the
  tokens counted up to the one that completed it; streamed, the same text;
- ``n``: choice ``i`` is ``generate_text``'s answer with ``seed + i``; the prompt is counted
  once, computed once, and adopted by the other choices (``cached_tokens``, ``/metrics``);
- a list of prompts: one choice each (``n`` each), numbered as OpenAI numbers them;
- ``logprobs`` (completions) and ``logprobs`` + ``top_logprobs`` (chat), in OpenAI's shapes,
  the dense reference's raw log-probabilities; ``echo`` with ``logprobs`` scores the prompt;
- penalties, ``min_p`` and ``min_tokens``: the reference sampler's tokens;
- ``tool_choice: "auto"`` without tools asks for nothing.
"""

from __future__ import annotations

import uuid
from functools import cache, partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from common.reference import ReferenceModel
from common.sampling_params import SamplingParams
from front.text import TextOptions, generate_text
from tests.serve.server_process import (
    API_KEY,
    ENGINE,
    SERVED_NAME,
    ServerProcess,
    metric,
)
from tests.serve.test_openai_api import chat, client, offline, wait_until_idle

PROMPT = "The weather is nice today and the cat"
SAMPLED = {"temperature": 1.0, "seed": 5}
BLOCK = 4  # the test servers' --block-size
# The most rounds the engine may run past a stop string before its abort lands (it lands
# about a round after it is sent; docs/serving.md measures the same for a disconnect).
ROUNDS_AHEAD = 16


def completion_text(server: ServerProcess, checkpoint: Path, **options: Any) -> Any:
    """``generate_text``'s answers to plain completions (no chat template), on the server's
    engine options."""
    prompts = options.pop("prompts", [PROMPT])
    text_options = TextOptions(chat_template=False, engine=ENGINE, **options)
    return generate_text(server.step_name, checkpoint, prompts, text_options)


def stop_string_of(text: str) -> str:
    """Two characters from the middle of ``text`` that do not occur before: a stop string the
    answer really reaches, half-way."""
    for at in range(len(text) // 3, len(text) - 2):
        candidate = text[at : at + 2]
        if candidate.strip() and candidate not in text[: at + 1]:
            return candidate
    raise AssertionError(f"no stop string to pick in {text!r}")


# ---- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True], ids=["before", "included"])
def test_a_stop_string_ends_the_text_as_generate_text_ends_it(
    server: ServerProcess, chat_checkpoint: Path, include: bool
) -> None:
    api = client(server)
    free = api.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=24, **SAMPLED)
    stop = stop_string_of(free.choices[0].text)
    extra = {"include_stop_str_in_output": include}
    asked = {"prompt": PROMPT, "max_tokens": 24, "stop": [stop], "extra_body": extra, **SAMPLED}
    whole = api.completions.create(model=SERVED_NAME, **asked)
    chunks = list(api.completions.create(model=SERVED_NAME, stream=True, **asked))
    offline_answer = completion_text(
        server,
        chat_checkpoint,
        sampling_params=SamplingParams(max_tokens=24, **SAMPLED),
        stop=stop,
        include_stop_str_in_output=include,
    )
    choice = whole.choices[0]
    assert choice.text == offline_answer.outputs[0]
    assert choice.text == free.choices[0].text.split(stop)[0] + (stop if include else "")
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    assert whole.usage.completion_tokens == len(offline_answer.output_ids[0]) < 24
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_never_shows_what_a_stop_string_takes_back(server: ServerProcess) -> None:
    """Each chunk's text so far is a beginning of the final text: nothing shown is retracted."""
    api = client(server)
    free = api.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=24, **SAMPLED)
    stop = stop_string_of(free.choices[0].text)
    stream = api.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=24, stop=stop, stream=True, **SAMPLED
    )
    shown = ""
    for chunk in stream:
        shown += chunk.choices[0].text
        assert stop not in shown
        assert free.choices[0].text.startswith(shown)


LONG = 400  # max_tokens far past the stop string: a request left running would show


def stopped_answer(server: ServerProcess, endpoint: str, stream: bool) -> tuple[str, int]:
    """A completion or a chat, whole or streamed, that a stop string ends half-way (its
    string picked from a first, free answer), with ``LONG`` tokens allowed: its finish reason
    and its ``completion_tokens``. ``/metrics`` before it, read once the server is idle."""
    api = client(server)
    if endpoint == "chat":
        create: Any = partial(api.chat.completions.create, messages=chat("Is the cat happy?"))
        free = create(model=SERVED_NAME, max_tokens=24, **SAMPLED).choices[0].message.content
    else:
        create = partial(api.completions.create, prompt=PROMPT)
        free = create(model=SERVED_NAME, max_tokens=24, **SAMPLED).choices[0].text
    asked = {"model": SERVED_NAME, "max_tokens": LONG, "stop": [stop_string_of(free)], **SAMPLED}
    if not stream:
        answer = create(**asked)
        return answer.choices[0].finish_reason, answer.usage.completion_tokens
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **asked))
    return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stop_string_ends_the_engines_request(
    server: ServerProcess, endpoint: str, stream: bool
) -> None:
    """Once the answer is out, its request no longer runs (``/metrics`` says so at once, not
    after polling), the engine generated the answer's tokens and not ``max_tokens`` of them
    (a few more at most: the rounds that ran before the abort landed), and the request is
    counted as ended by "stop", whole or streamed alike (a whole answer's end, which aborts
    what is left of it, once overwrote that with "abort")."""
    before = wait_until_idle(server)
    finish_reason, completion_tokens = stopped_answer(server, endpoint, stream)
    after = httpx.get(server.url + "/metrics").text

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert finish_reason == "stop" and completion_tokens < 24
    assert metric(after, "vllm:num_requests_running") == 0
    generated = grew("vllm:generation_tokens_total") - 24  # the free answer's, first
    assert completion_tokens <= generated < completion_tokens + ROUNDS_AHEAD
    assert grew("vllm:request_success_total", finished_reason="stop") == 1
    assert grew("vllm:request_success_total", finished_reason="abort") == 0


# ---- n choices -------------------------------------------------------------------------------


def test_n_choices_are_generate_texts_answers_with_seed_plus_i(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    api = client(server)
    whole = api.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=10, n=3, **SAMPLED)
    streamed = api.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=10, n=3, stream=True, **SAMPLED
    )
    pieces = ["", "", ""]
    for chunk in streamed:
        for piece in chunk.choices:
            pieces[piece.index] += piece.text
    seeds = [SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i) for i in range(3)]
    offline_answer = completion_text(
        server, chat_checkpoint, prompts=[PROMPT] * 3, sampling_params=seeds
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == offline_answer.outputs == pieces
    assert len(set(pieces)) == 3  # three draws, not one answer three times
    assert whole.usage.prompt_tokens == len(offline_answer.prompt_ids[0])  # counted once
    assert whole.usage.completion_tokens == 30


def test_n_choices_adopt_the_prompts_blocks(server: ServerProcess) -> None:
    """A prompt never seen, with four choices: each full block of it is computed once, and
    the three other choices adopt it (the last, partial block each computes); the usage,
    which counts the prompt once, shows the average choice's share: three quarters."""
    prompt = f"{uuid.uuid4().hex} {PROMPT}"
    hits_before = metric(wait_until_idle(server), "vllm:prefix_cache_hits_total")
    answer = client(server).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=3, n=4, temperature=0
    )
    full_blocks = (answer.usage.prompt_tokens - 1) // BLOCK * BLOCK
    hits = metric(wait_until_idle(server), "vllm:prefix_cache_hits_total") - hits_before
    assert full_blocks > 0
    assert hits == 3 * full_blocks
    assert answer.usage.prompt_tokens_details.cached_tokens == 3 * full_blocks // 4
    assert len({c.text for c in answer.choices}) == 1  # greedy: the same answer four times


def test_a_list_of_prompts_gets_n_choices_each_numbered_as_openai_does(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    prompts = [PROMPT, "Grüße aus München"]
    codec = offline(server.step_name, chat_checkpoint)[1]
    for sent in (prompts, [codec.completion_ids(p) for p in prompts]):
        answer = client(server).completions.create(
            model=SERVED_NAME, prompt=sent, max_tokens=6, n=2, temperature=0
        )
        greedy = completion_text(
            server, chat_checkpoint, prompts=prompts, sampling_params=SamplingParams(max_tokens=6)
        )
        expected = [text for text in greedy.outputs for _ in range(2)]  # prompt i: 2i, 2i + 1
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text for c in answer.choices] == expected
        assert answer.usage.prompt_tokens == sum(len(ids) for ids in greedy.prompt_ids)


# ---- log-probabilities -------------------------------------------------------------------------


@cache
def reference(step_name: str, checkpoint: Path) -> ReferenceModel:
    """The dense reference model with the server's weights."""
    engine, _ = offline(step_name, checkpoint)
    model = engine.model
    dense = ReferenceModel(model.cfg)
    dense.load_state_dict(model.state_dict(), assign=True)  # its cfg builds on "meta"
    return dense


def log_probs(server: ServerProcess, checkpoint: Path, ids: list[int]) -> torch.Tensor:
    """The reference's raw log-probabilities of the token after each of ``ids``."""
    logits = reference(server.step_name, checkpoint)(ids)
    return torch.log_softmax(logits.double(), dim=-1)


def test_completion_logprobs_are_the_references_in_openais_shape(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    api = client(server)
    answer = api.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=6, logprobs=3, **SAMPLED
    )
    codec = offline(server.step_name, chat_checkpoint)[1]
    prompt_ids = codec.completion_ids(PROMPT)
    logprobs = answer.choices[0].logprobs
    ids = answer_ids(server, chat_checkpoint, prompt_ids, 6)
    expected = log_probs(server, chat_checkpoint, prompt_ids + ids)[len(prompt_ids) - 1 : -1]
    assert len(logprobs.tokens) == 6
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]

    def text(token_id: int) -> str:  # a token's own text, special tokens shown
        return codec.tokenizer.decode([token_id], skip_special_tokens=False)

    for i, token_id in enumerate(ids):
        chosen = expected[i, token_id].item()
        assert logprobs.token_logprobs[i] == pytest.approx(chosen, abs=1e-9)
        top = expected[i].topk(3)  # the three best, and the token drawn (byte tokens may share
        alternatives = {text(t): v.item() for t, v in zip(top.indices.tolist(), top.values)}
        alternatives[text(token_id)] = chosen  # a text: one entry then)
        assert logprobs.top_logprobs[i] == pytest.approx(alternatives, abs=1e-9)


def test_a_streams_logprobs_join_into_the_whole_answers(server: ServerProcess) -> None:
    """Piece by piece, with the prompt echoed first: each piece's ``text_offset`` goes on from
    where the piece before it ended, so the pieces joined are the whole answer's."""
    api = client(server)
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "echo": True}
    whole = api.completions.create(**body, **SAMPLED).choices[0]
    pieces = [chunk.choices[0] for chunk in api.completions.create(**body, **SAMPLED, stream=True)]
    joined = [p.logprobs for p in pieces if p.logprobs is not None]
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for piece in joined for t in piece.tokens] == whole.logprobs.tokens
    assert [o for piece in joined for o in piece.text_offset] == whole.logprobs.text_offset
    streamed = [lp for piece in joined for lp in piece.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-9)


def answer_ids(server: ServerProcess, checkpoint: Path, prompt_ids: list[int], n: int) -> list[int]:
    engine, _ = offline(server.step_name, checkpoint)
    params = SamplingParams(max_tokens=n, **SAMPLED)
    return engine.generate([prompt_ids], sampling_params=params)[0]


def test_chat_logprobs_and_top_logprobs_in_openais_chat_shape(server: ServerProcess) -> None:
    answer = client(server).chat.completions.create(
        model=SERVED_NAME,
        messages=chat("Is the cat happy?"),
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **SAMPLED,
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 5
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.logprob - 20
        assert entry.logprob <= 0


def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess, chat_checkpoint: Path) -> None:
    """What an evaluation harness sends: the prompt's own log-probabilities, the first null."""
    answer = client(server).completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    codec = offline(server.step_name, chat_checkpoint)[1]
    prompt_ids = codec.completion_ids(PROMPT)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = log_probs(server, chat_checkpoint, prompt_ids)
    for i in range(1, len(prompt_ids)):
        value = expected[i - 1, prompt_ids[i]].item()
        assert logprobs.token_logprobs[i] == pytest.approx(value, abs=1e-9)


# ---- penalties, min_p, min_tokens ----------------------------------------------------------------


def reference_sample(
    server: ServerProcess,
    checkpoint: Path,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    min_p: float = 0.0,
    temperature: float = 0.0,
    seed: int = 0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """vLLM's penalties, written plainly over the dense reference's logits: the repetition
    penalty on every token of the prompt and the answer so far (a positive logit divided by
    it, a negative one multiplied), the frequency and presence penalties on the answer's
    tokens (minus ``frequency`` per time seen, minus ``presence`` once seen); stop ids out of
    reach until ``min_tokens``; greedy, or the engine's seeded draw over what ``min_p`` keeps."""
    from common.sampler import exponentials  # the engine's draw: the k-th token's race

    dense = reference(server.step_name, checkpoint)
    out: list[int] = []
    for k in range(max_tokens):
        logits = dense(prompt_ids + out)[-1].double().clone()
        seen = torch.tensor(sorted(set(prompt_ids + out)))
        logits[seen] = torch.where(
            logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition
        )
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())
        logits -= frequency * counts + presence * (counts > 0)
        if k < min_tokens and stop_ids:
            logits[list(stop_ids)] = -torch.inf
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            probs[probs < min_p * probs.max()] = 0
            token = int((probs / exponentials(seed, k, probs.numel())).argmax())
        out.append(token)
        if token in stop_ids and k + 1 >= min_tokens:
            break
    return out


def test_penalties_give_the_reference_samplers_tokens(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    codec = offline(server.step_name, chat_checkpoint)[1]
    prompt_ids = codec.completion_ids(PROMPT)
    drawn = {"temperature": 1.0, "seed": 3}
    penalties = {"presence": 0.5, "frequency": 0.7, "repetition": 1.8}
    expected = reference_sample(server, chat_checkpoint, prompt_ids, 16, **penalties, **drawn)
    plain = reference_sample(server, chat_checkpoint, prompt_ids, 16, **drawn)
    answer = client(server).completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.0,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        extra_body={"repetition_penalty": 1.8},
    )
    assert expected != plain  # else the penalties would not be seen at work
    assert answer.choices[0].text == codec.decode(expected)


def test_min_p_and_min_tokens_give_the_reference_samplers_tokens(
    server: ServerProcess, chat_checkpoint: Path
) -> None:
    codec = offline(server.step_name, chat_checkpoint)[1]
    prompt_ids = codec.completion_ids(PROMPT)
    free = reference_sample(server, chat_checkpoint, prompt_ids, 12, temperature=1.0, seed=9)
    stop = free[2]  # the free run would stop at its third token
    kept = {"min_p": 0.2, "temperature": 1.0, "seed": 9, "stop_ids": (stop,), "min_tokens": 6}
    expected = reference_sample(server, chat_checkpoint, prompt_ids, 12, **kept)
    answer = client(server).completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=9,
        extra_body={"min_p": 0.2, "min_tokens": 6, "stop_token_ids": [stop]},
    )
    assert len(expected) >= 6
    assert answer.usage.completion_tokens == len(expected)
    ended_by_stop = expected[-1] == stop
    text_ids = expected[:-1] if ended_by_stop else expected
    assert answer.choices[0].text == codec.decode(text_ids)


# ---- fields that ask for nothing ---------------------------------------------------------------


def test_tool_choice_without_tools_asks_for_nothing(server: ServerProcess) -> None:
    for tool_choice in ("auto", "none"):
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"messages": chat("Hi"), "max_tokens": 2, "tool_choice": tool_choice},
        )
        assert answer.status_code == 200, answer.text


def test_a_client_that_sends_several_prompts_gets_them_all(server: ServerProcess) -> None:
    """``openai.OpenAI().completions`` with a list, as LangChain's ``OpenAI`` always sends."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    answer = api.completions.create(model=SERVED_NAME, prompt=["Hello"], max_tokens=2)
    assert len(answer.choices) == 1 and answer.usage.completion_tokens == 2
