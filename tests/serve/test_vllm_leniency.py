"""What vLLM's server does that a careful reader of the OpenAI API would not guess.

- Detokenizing primed with the prompt's last ids (vLLM's ``DecodeStream``): with a
  SentencePiece-style tokenizer (Metaspace, as Llama 2, TinyLlama and Mistral checkpoints
  have), the answer's first word keeps its space (``"The capital of France is" + " paris"``,
  never ``"isparis"``), in the server (whole, streamed, echoed, with a stop string, chat),
  the text run (whole and ``--stream``'s printer) and the chat loop. A byte-level BPE
  tokenizer decodes alike primed or not.
- ``echo`` with ``max_tokens: 0``: the prompt and its log-probabilities, no answer (vLLM's
  ``echo_without_generation``); ``max_tokens: 0`` without echo is refused.
- An integer written as a float with no fractional part (``2.0``) is one, as vLLM's lax
  pydantic and JSON Schema take it; ``2.5`` is refused, and so are ``"2"`` and ``true`` and a
  ``0`` for a boolean (the schema says so); a text part without ``text`` is refused.

The Metaspace checkpoint: a word-level vocabulary whose every word is written ``▁word``, so
that every answer is words, each after a space; a Llama 2 style chat template; random weights.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from common.sampling_params import SamplingParams
from front.chat_loop import ChatSession
from front.codec import TextCodec, text_decoder
from front.serve.serving_models import ServedModel
from front.steps import load_step
from front.stream import IncrementalDetokenizer, StreamPrinter
from front.text import TextOptions, generate_text
from tests.helpers import STEP_NAMES
from tests.serve.in_process import served_app
from tests.serve.server_process import ENGINE, ENGINE_OVERRIDES
from tests.toy_checkpoint import WORDS

PROMPT = "The capital of France is"
SPECIAL = ["<unk>", "<s>", "</s>"]
EXTRA = ["The", "capital", "of", "France", "Paris", "[INST]", "[/INST]"]
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] | trim }}"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)
CONTEXT = 256
SAMPLED = {"temperature": 1.0, "seed": 3}


def metaspace_tokenizer() -> Any:
    """Llama 2's way with spaces: ``▁`` begins a word's token, the decoder drops the first
    token's, and ``<s>`` comes first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = SPECIAL + [f"\u2581{w}" for w in WORDS + EXTRA]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(SPECIAL)
    return tok


@pytest.fixture(scope="module")
def metaspace_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import PreTrainedTokenizerFast

    from common.config import preset
    from front.hf import hf_llama

    folder = tmp_path_factory.mktemp("metaspace") / "toy-llama2"
    tokenizer = metaspace_tokenizer()
    cfg = preset("tiny", vocab_size=tokenizer.get_vocab_size())
    hf_llama(cfg, max_position_embeddings=CONTEXT).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def client(metaspace_checkpoint: Path) -> Iterator[TestClient]:
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(metaspace_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    served = ServedModel("toy", TextCodec.load(metaspace_checkpoint), CONTEXT, {})
    with TestClient(served_app(lambda: engine, model.cfg, served)) as test_client:
        yield test_client


def spaced(text: str) -> bool:
    """Words, each after one space: what every Metaspace answer here must be."""
    return text.startswith(" ") and " ".join(text.split()) == text[1:]


# ---- the detokenizer ------------------------------------------------------------------------


def test_a_metaspace_answer_decoded_after_its_prompt_keeps_its_first_space() -> None:
    tok = metaspace_tokenizer()
    decode = text_decoder(tok)
    prompt = tok.encode(PROMPT).ids
    answer = tok.encode("Paris is old", add_special_tokens=False).ids
    assert decode(answer) == "Paris is old"  # on its own: the first space is gone
    detokenizer = IncrementalDetokenizer(decode, prompt_ids=prompt)
    pieces = [detokenizer.update(answer[:end]) for end in range(1, len(answer) + 1)]
    assert pieces == [" Paris", " is", " old"]
    assert detokenizer.finish(answer) == "" and detokenizer.text == " Paris is old"
    assert PROMPT + detokenizer.text == decode(prompt + answer)


def test_a_byte_level_answer_decodes_alike_primed_or_not() -> None:
    from tests.serve.conftest import CORPUS, SPECIALS
    from tests.toy_checkpoint import byte_level_bpe

    tok = byte_level_bpe(CORPUS, SPECIALS, vocab_size=320)
    decode = text_decoder(tok)
    prompt = tok.encode("Grüße aus München! The weather").ids
    answer = tok.encode(" is nice 你好，世界 🙂").ids
    primed, bare = IncrementalDetokenizer(decode, prompt_ids=prompt), IncrementalDetokenizer(decode)
    for end in range(1, len(answer) + 1):
        assert primed.update(answer[:end]) == bare.update(answer[:end])
    assert primed.finish(answer) == bare.finish(answer)
    assert primed.text == " is nice 你好，世界 🙂"


# ---- the server -----------------------------------------------------------------------------


def streamed(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = client.post(path, json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    lines = [line.removeprefix("data: ") for line in answer.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_completion_keeps_its_first_space_whole_streamed_and_echoed(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, **SAMPLED}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert spaced(whole), whole
    chunks = streamed(client, "/v1/completions", body)
    pieces = [chunk["choices"][0]["text"] for chunk in chunks]
    assert "".join(pieces) == whole and pieces[0].startswith(" ")
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["text"] == PROMPT + whole
    echoed_chunks = streamed(client, "/v1/completions", {**body, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in echoed_chunks) == PROMPT + whole


def test_a_stop_string_leaves_the_first_space(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, **SAMPLED}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    words = whole.split()
    stop = next(f" {w}" for w in words[1:] if whole.find(f" {w}") > 0)
    expected = whole[: whole.find(stop)]
    for stream in (False, True):
        asked = {**body, "stop": [stop]}
        if stream:
            text = "".join(
                c["choices"][0]["text"] for c in streamed(client, "/v1/completions", asked)
            )
        else:
            text = client.post("/v1/completions", json=asked).json()["choices"][0]["text"]
        assert text == expected and spaced(text), (stream, text, expected)


def test_a_chat_answer_keeps_its_first_space(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 5, **SAMPLED}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert spaced(content["message"]["content"]), content
    chunks = streamed(client, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == content["message"]["content"]


# ---- the text run and the chat loop ---------------------------------------------------------


def test_the_text_run_keeps_the_first_space_printed_or_not(metaspace_checkpoint: Path) -> None:
    codec = TextCodec.load(metaspace_checkpoint, chat_template=False)
    out = io.StringIO()
    printer = StreamPrinter(codec.decode, [PROMPT], out, prompt_ids=[codec.encode(PROMPT)])
    options = TextOptions(max_new_tokens=6, chat_template=False, engine=ENGINE)
    result = generate_text(
        STEP_NAMES[-1], metaspace_checkpoint, [PROMPT], options, on_output=printer
    )
    assert spaced(result.outputs[0]), result.outputs
    assert printer.texts == result.outputs
    assert f"-> {result.outputs[0]}  (" in out.getvalue()


def test_the_chat_loop_keeps_the_first_space(metaspace_checkpoint: Path) -> None:
    step = load_step(STEP_NAMES[-1])
    model = step.TinyTransformerPaged.from_pretrained(metaspace_checkpoint, **ENGINE_OVERRIDES)
    engine = step.PagedPrefixCacheEngine(model)
    out = io.StringIO()
    session = ChatSession(
        engine, TextCodec.load(metaspace_checkpoint), SamplingParams(max_tokens=5), out=out
    )
    session.turn("the cat sat")
    answer = session.messages[-1]["content"]
    assert spaced(answer), answer
    assert out.getvalue() == answer + "\n"


# ---- echo with max_tokens 0 -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_no_tokens_is_the_prompt_and_its_logprobs(
    client: TestClient, stream: bool
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    scored = client.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]
    if stream:
        chunks = streamed(
            client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        logprobs = [x for c in choices for x in c["logprobs"]["token_logprobs"]]
        tokens = [x for c in choices for x in c["logprobs"]["tokens"]]
        finish, usage = choices[-1]["finish_reason"], chunks[-1]["usage"]
    else:
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice, usage = answer.json()["choices"][0], answer.json()["usage"]
        text, finish = choice["text"], choice["finish_reason"]
        logprobs, tokens = choice["logprobs"]["token_logprobs"], choice["logprobs"]["tokens"]
    prompt_tokens = usage["prompt_tokens"]
    assert text == PROMPT and finish == "length"
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == prompt_tokens
    assert len(tokens) == len(logprobs) == prompt_tokens
    assert logprobs == scored["logprobs"]["token_logprobs"][:prompt_tokens]
    assert logprobs[0] is None and all(isinstance(x, float) for x in logprobs[1:])


def test_no_tokens_without_echo_is_refused(client: TestClient) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        ),
    ]:
        answer = client.post(path, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"


# ---- integers written as floats ---------------------------------------------------------------


def test_an_integer_written_as_a_float_is_one(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "seed": 5819723, "temperature": 1.0, "n": 2}
    as_ints = client.post("/v1/completions", json=body).json()
    floats = {**body, "max_tokens": 3.0, "seed": 5819723.0, "n": 2.0, "stop_token_ids": [2.0]}
    as_floats = client.post("/v1/completions", json=floats)
    assert as_floats.status_code == 200, as_floats.text
    assert [c["text"] for c in as_floats.json()["choices"]] == [
        c["text"] for c in as_ints["choices"]
    ]
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_float_ids = client.post(
        "/v1/completions", json={**floats, "prompt": [float(t) for t in ids]}
    )
    assert by_float_ids.json()["usage"] == as_ints["usage"]
    detok = client.post("/detokenize", json={"tokens": [float(t) for t in ids]})
    assert detok.status_code == 200 and detok.json()["prompt"] == PROMPT


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", 2.5),
        ("/v1/completions", "max_tokens", "2"),
        ("/v1/completions", "max_tokens", True),
        ("/v1/completions", "seed", 1e30),
        ("/v1/completions", "prompt", [1.5, 2.0]),
        ("/v1/completions", "add_special_tokens", 1),
        ("/v1/chat/completions", "add_special_tokens", 0),
        ("/v1/chat/completions", "echo", 0),
        ("/detokenize", "tokens", [2.5]),
    ],
)
def test_what_is_not_an_integer_or_a_boolean_is_refused(
    client: TestClient, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"prompt": PROMPT} if path == "/v1/completions" else {}
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = client.post(path, json={**body, field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_a_text_part_without_its_text_is_refused(client: TestClient) -> None:
    part = {"type": "text"}
    messages = [{"role": "user", "content": [part]}]
    for path, body in [
        ("/tokenize", {"messages": messages}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
    ]:
        answer = client.post(path, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
