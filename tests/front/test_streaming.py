"""Text, streamed: the incremental detokenizer, sampling from the command line, ``--stream``,
``--prompt-file`` and ``--messages`` (``front/stream.py``, ``front/text.py``).

- The detokenizer hands out text only once it is whole: a character that byte-level BPE cut
  into several tokens is printed once its last byte has come, never as U+FFFD, and the pieces
  add up to the final answer (real non-ASCII text, and a random model's byte soup).
- Each answer ends with its ``finish_reason``: "stop" at the checkpoint's eos, "length" at
  ``--max-new-tokens``.
- ``--stream`` prints what the plain command prints, and a sampled run (``--temperature``,
  ``--seed``) prints the same in every step; ``--seed`` changes it.
- ``--prompt-file -`` reads stdin, one prompt per line; ``--messages FILE`` is a multi-turn
  conversation, through the checkpoint's chat template, token for token as transformers.
- A bad value of a new flag is one ``error:`` line and exit 2, before anything loads.

The checkpoint: a tiny Llama with random weights and a byte-level BPE tokenizer trained here,
in a second, on a few sentences in German, French, Chinese and emoji, saved by transformers
with a chat template. Its answers are gibberish, a good deal of it cut characters: what the
detokenizer has to survive.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tokenizers import Tokenizer

from common.config import preset
from common.errors import RequestError
from common.sampling_params import SamplingParams
from front import build
from front.codec import load_tokenizer, text_decoder
from front.hf import hf_llama
from front.options import EngineOptions
from front.stream import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StreamPrinter,
    shorten,
)
from front.text import TextOptions, generate_text
from tests.helpers import STEP_NAMES, SUBPROCESS_TIMEOUT_S, edit_json, has_fix, usage_error
from tests.toy_checkpoint import byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Grüße aus München! Der Käse ist köstlich, die Straße ist schön.",
    "Café crème, s'il vous plaît. Où est la bibliothèque? Très élégant.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "The weather is nice 🙂 and the cat is happy 🐱 in the sun ☀️ today.",
]
TEMPLATE = """{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
PROMPTS = ["Grüße aus München 🙂", "你好，世界", "Café crème, s'il vous plaît"]
NEW_TOKENS = 12
SAMPLED = ["--temperature", "0.8", "--seed", "1"]
CONVERSATION = [
    {"role": "system", "content": "Réponds en français, brièvement."},
    {"role": "user", "content": "Où est la bibliothèque?"},
    {"role": "assistant", "content": "Très élégant: à München 🙂"},
    {"role": "user", "content": "你好，世界。今天天气很好?"},
]
ROOT = Path(__file__).resolve().parents[2]
ANSWER = re.compile(
    r"\n\[(\d+)\] (.*?)\n  -> (.*?)  \((\d+) tokens?, finish_reason=(\w+)\)\n", re.DOTALL
)


def bpe_tokenizer() -> Tokenizer:
    """Byte-level BPE, as GPT-2, Llama 3 and SmolLM2 use: every byte is a token, and the
    merges learnt from CORPUS join the bytes of its characters (not of others: "🙃")."""
    return byte_level_bpe(CORPUS, SPECIALS, vocab_size=400)


def run_main(step_name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``python -m <step>.run argv`` in-process: its stdout, the run having succeeded."""
    run = importlib.import_module(f"{step_name}.run")
    assert run.main(argv) == 0
    return capsys.readouterr().out


def answers_of(out: str) -> list[tuple[str, str, int, str]]:
    """(echoed prompt, answer, token count, finish_reason) of each answer ``out`` prints."""
    found = ANSWER.findall(out)
    assert [int(n) for n, *_ in found] == list(range(1, len(found) + 1)), out
    return [(echo, answer, int(count), reason) for _, echo, answer, count, reason in found]


def the_answers(out: str) -> str:
    """``out`` without what may differ between two runs of the same requests: the first line
    (the step's name, the load time) and the last (the time taken)."""
    lines = out.splitlines()
    assert lines[0].startswith("step14") and "new tokens in" in lines[-1], out
    return "\n".join(lines[1:-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The checkpoint, and its eos chosen so that a sampled run (``SAMPLED``) of ``PROMPTS``
    ends the first answer at it ("stop") and the others at ``NEW_TOKENS`` ("length"): a token
    the first answer reaches after two others, which the other answers never make (a draw
    depends on the seed, the draw's number and the logits alone, so the eos changes no token
    before it)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("stream") / "ckpt"
    tok = bpe_tokenizer()
    cfg = preset("tiny", vocab_size=tok.get_vocab_size(), num_kv_heads=2)
    hf_llama(cfg).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8)
    options = TextOptions(sampling_params=params, eos_token_id=(), engine=EngineOptions(seed=1))
    free = generate_text(STEP_NAMES[-1], folder, PROMPTS, options).output_ids
    first, others = free[0], {t for ids in free[1:] for t in ids}
    eos = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i] and t not in others)
    edit_json(folder / "config.json", eos_token_id=eos)
    if (folder / "generation_config.json").is_file():
        edit_json(folder / "generation_config.json", eos_token_id=eos)
    return {"folder": folder, "eos_at": first.index(eos), "tokenizer": tok}


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the text front end gets as far as loading a step (and its model):
    every front end builds its engine through ``front.build``."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(build, "load_step", refuse)


# ---- the incremental detokenizer ------------------------------------------------------------


def streamed(decode, ids: list[int]) -> list[str]:
    """The pieces a detokenizer hands out when ``ids`` come one at a time, then end."""
    detokenizer = IncrementalDetokenizer(decode)
    pieces = [detokenizer.update(ids[: i + 1]) for i in range(len(ids) - 1)]
    return [*pieces, detokenizer.finish(ids)]


def test_a_character_cut_between_tokens_is_printed_whole() -> None:
    """An emoji the corpus lacks, "🙃", is several tokens: its first bytes (shared with the
    corpus's emoji) and one token per byte left. Nothing is printed until the last has come,
    and then the whole character."""
    tok = bpe_tokenizer()
    ids = tok.encode("🙃").ids
    assert len(ids) >= 3 and tok.decode(ids[:2]) == REPLACEMENT_CHAR  # the cut is real
    assert streamed(text_decoder(tok), ids) == [""] * (len(ids) - 1) + ["🙃"]


@pytest.mark.parametrize("sentence", [*CORPUS, "Straße 🙃 über 世界 ☀️ élan", *PROMPTS])
def test_streamed_pieces_add_up_to_the_text(sentence: str) -> None:
    """Real non-ASCII text, one token at a time: no piece holds a U+FFFD, and the pieces are
    the text."""
    tok = bpe_tokenizer()
    ids = tok.encode(sentence).ids
    pieces = streamed(text_decoder(tok), ids)
    assert "".join(pieces) == sentence == tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_a_byte_no_token_completes_holds_nothing_back_after_it() -> None:
    """A lone continuation byte in the middle of an answer (the second byte of "€", which
    nothing completes) decodes to U+FFFD for good. The text is held back only while it *ends*
    in U+FFFD: once the next token comes, the stream goes on, token by token, rather than
    freezing until the answer ends."""
    tok = bpe_tokenizer()
    stray = tok.encode("€").ids[1]  # a byte token that no later token completes
    head, tail = tok.encode("ab").ids, tok.encode(" cd ef gh").ids
    ids = [*head, stray, *tail]
    pieces = streamed(text_decoder(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == f"ab{REPLACEMENT_CHAR} cd ef gh"
    assert pieces[len(head)] == "", "held back while it ends in U+FFFD"
    assert pieces[len(head) + 1] == f"{REPLACEMENT_CHAR} c", "then let go with what follows"
    assert all(pieces[len(head) + 1 :]), "and every later token adds its text at once"


def test_a_transformers_tokenizer_streams_the_same() -> None:
    """A transformers tokenizer decodes with its own options (special tokens skipped, spaces
    not cleaned up): the same pieces as the tokenizer.json it wraps."""
    from transformers import PreTrainedTokenizerFast

    tok = bpe_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True)
    ids = tok.encode("Très élégant . 你好 🙃 !").ids
    assert streamed(text_decoder(fast), ids) == streamed(text_decoder(tok), ids)
    specials = [tok.token_to_id(SPECIALS[1]), *ids, tok.token_to_id(SPECIALS[2])]
    assert "".join(streamed(text_decoder(fast), specials)) == tok.decode(ids)


def test_long_prompts_are_echoed_shortened() -> None:
    long = "x" * 100 + "MIDDLE" + "y" * 100
    echo = shorten(long)
    assert echo == f"{'x' * 60} … (206 chars) … {'y' * 60}"
    assert shorten("short\nprompt") == "short ⏎ prompt"
    assert shorten("z" * 140) == "z" * 140  # cutting would save next to nothing


# ---- served: the stream is the answer -------------------------------------------------------


def test_streamed_text_equals_the_final_text(checkpoint: dict[str, object]) -> None:
    """A random model's answers, streamed round by round as ``RequestOutput``s come: every
    piece is whole (no U+FFFD at its end, but the answer's own last one), and the pieces of
    each answer are its final text, cut characters and all."""
    tok = checkpoint["tokenizer"]
    decode = text_decoder(tok)
    detokenizers = [IncrementalDetokenizer(decode) for _ in PROMPTS]
    pieces: list[list[str]] = [[] for _ in PROMPTS]
    cut = []  # rounds that ended inside a character

    def on_output(index: int, output) -> None:
        ids = output.token_ids
        detokenizer = detokenizers[index]
        piece = detokenizer.finish(ids) if output.finished else detokenizer.update(ids)
        pieces[index].append(piece)
        if not output.finished:
            assert not piece.endswith(REPLACEMENT_CHAR)
            cut.append(decode(list(ids)).endswith(REPLACEMENT_CHAR))

    params = SamplingParams(max_tokens=40, temperature=1.0)
    result = generate_text(
        STEP_NAMES[-1],
        checkpoint["folder"],
        PROMPTS,
        TextOptions(sampling_params=params, eos_token_id=(), engine=EngineOptions(seed=3)),
        on_output=on_output,
    )
    assert ["".join(p) for p in pieces] == result.outputs
    assert any(cut), "some round ended inside a character: the case under test"
    assert any(text.endswith(REPLACEMENT_CHAR) for text in result.outputs), "and an answer too"
    assert any(ord(c) > 127 and c != REPLACEMENT_CHAR for c in "".join(result.outputs))


def test_the_printer_prints_what_the_plain_command_prints(checkpoint: dict[str, object]) -> None:
    """``StreamPrinter`` fed the outputs of a run: the same answers, in the order of the
    prompts, as ``print_result`` lays them out after the run."""
    out = io.StringIO()
    printer = StreamPrinter(text_decoder(checkpoint["tokenizer"]), PROMPTS, out)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8)
    options = TextOptions(sampling_params=params)
    result = generate_text(
        STEP_NAMES[-1], checkpoint["folder"], PROMPTS, options, on_output=printer
    )
    assert printer.texts == result.outputs
    got = answers_of(out.getvalue())
    assert [answer for _, answer, _, _ in got] == result.outputs
    assert [echo for echo, _, _, _ in got] == PROMPTS
    assert [reason for *_, reason in got] == result.finish_reasons


# ---- finish reasons -------------------------------------------------------------------------


def test_each_answer_says_why_it_stopped(
    checkpoint: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """The first answer reaches the checkpoint's eos ("stop": the eos is not part of the
    answer), the others ``--max-new-tokens`` ("length"): streamed or not."""
    argv = ["--model", str(checkpoint["folder"]), "--block-size", "4", *SAMPLED]
    argv += ["--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    for stream in ([], ["--stream"]):
        got = answers_of(run_main(STEP_NAMES[-1], argv + stream, capsys))
        assert [(count, reason) for _, _, count, reason in got] == [
            (checkpoint["eos_at"], "stop"),
            (NEW_TOKENS, "length"),
            (NEW_TOKENS, "length"),
        ]
    result = generate_text(
        STEP_NAMES[-1],
        checkpoint["folder"],
        PROMPTS,
        TextOptions(
            sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8),
            engine=EngineOptions(seed=1),
        ),
    )
    assert result.finish_reasons == ["stop", "length", "length"]
    assert len(result.output_ids[0]) == checkpoint["eos_at"]


# ---- --stream, sampled, in every step -------------------------------------------------------


def test_a_sampled_stream_is_the_same_in_every_step(
    checkpoint: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--stream --temperature 0.8 --seed 1``: step14 prints what step14_7 prints, and what
    the same run without ``--stream`` prints; another ``--seed`` draws other answers."""
    argv = ["--model", str(checkpoint["folder"]), "--block-size", "4", "--max-new-tokens", "12"]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    first, last = STEP_NAMES[0], STEP_NAMES[-1]
    streamed_last = the_answers(run_main(last, [*argv, *SAMPLED, "--stream"], capsys))
    assert the_answers(run_main(first, [*argv, *SAMPLED, "--stream"], capsys)) == streamed_last
    assert the_answers(run_main(last, [*argv, *SAMPLED], capsys)) == streamed_last
    assert "sampling: temperature 0.8; seed 1" in streamed_last
    other = the_answers(run_main(last, [*argv, "--temperature", "0.8", "--stream"], capsys))
    assert answers_of(other) != answers_of(streamed_last)  # --seed 0: other draws
    greedy = the_answers(run_main(last, [*argv, "--stream"], capsys))
    assert "sampling:" not in greedy and answers_of(greedy) != answers_of(streamed_last)


def test_python_m_run_streams_prompts_from_stdin(checkpoint: dict[str, object]) -> None:
    """The command of the issue, in a fresh interpreter, prompts piped in: the same answers
    in step14 and step14_7, each with its finish reason."""
    argv = ["--model", str(checkpoint["folder"]), "--stream", *SAMPLED, "--prompt-file", "-"]
    argv += ["--block-size", "4", "--max-new-tokens", str(NEW_TOKENS)]
    outs = []
    for step_name in (STEP_NAMES[0], STEP_NAMES[-1]):
        proc = subprocess.run(
            [sys.executable, "-m", f"{step_name}.run", *argv],
            cwd=ROOT,
            input="\n".join(PROMPTS) + "\n",
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        outs.append(the_answers(proc.stdout))
    assert outs[0] == outs[1]
    assert [reason for *_, reason in answers_of(outs[0])] == ["stop", "length", "length"]


# ---- --prompt-file and --messages -----------------------------------------------------------


def test_prompt_file_reads_stdin_one_prompt_per_line(
    checkpoint: dict[str, object],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Empty (and blank) lines are skipped; ``-`` is stdin, a path the file, the same
    answers; ``--prompt`` ones come first."""
    lines = f"{PROMPTS[0]}\n\n   \n{PROMPTS[1]}\r\n"
    argv = ["--model", str(checkpoint["folder"]), "--block-size", "4", "--max-new-tokens", "3"]
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    from_stdin = run_main(STEP_NAMES[-1], [*argv, "--prompt-file", "-"], capsys)
    assert [echo for echo, *_ in answers_of(from_stdin)] == PROMPTS[:2]
    path = tmp_path / "prompts.txt"
    path.write_text(lines, encoding="utf-8")
    from_file = run_main(STEP_NAMES[-1], [*argv, "--prompt-file", str(path)], capsys)
    assert the_answers(from_file) == the_answers(from_stdin)
    both = run_main(
        STEP_NAMES[-1], [*argv, "--prompt", PROMPTS[2], "--prompt-file", str(path)], capsys
    )
    assert [echo for echo, *_ in answers_of(both)] == [PROMPTS[2], *PROMPTS[:2]]


def test_messages_is_a_multi_turn_chat_through_the_template(
    checkpoint: dict[str, object], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--messages FILE``: the whole conversation in the checkpoint's markup, token for
    token what transformers' ``apply_chat_template`` gives, answered as ``generate_text``
    answers the same conversation; two files, two requests sharing their history."""
    from transformers import AutoTokenizer

    folder = checkpoint["folder"]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(CONVERSATION, ensure_ascii=False), encoding="utf-8")
    result = generate_text(STEP_NAMES[-1], folder, [CONVERSATION], TextOptions(max_new_tokens=4))
    hf = AutoTokenizer.from_pretrained(folder)
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert result.prompt_ids == [want]
    markup = load_tokenizer(folder).decode(want, skip_special_tokens=False)
    assert all(m["content"] in markup for m in CONVERSATION), "every turn is in the prompt"
    argv = ["--model", str(folder), "--max-new-tokens", "4", "--block-size", "4", "--stream"]
    out = run_main(STEP_NAMES[-1], [*argv, "--messages", str(path)], capsys)
    (echo, answer, _, _), *_ = answers_of(out)
    assert echo == f"(4 messages) user: {CONVERSATION[-1]['content']}"
    assert answer == result.outputs[0]
    twice = run_main(STEP_NAMES[-1], [*argv, "--messages", str(path)] * 2, capsys)
    # Both requests hit before step14_9 (they leapfrog through the history); from it on the
    # first computes the history in one chunk and the second adopts all of it.
    hits = 1 if has_fix(STEP_NAMES[-1], "step14_9") else 2
    assert f"prefix cache: {hits}/2 requests hit" in twice


def test_generate_text_refuses_a_conversation_it_cannot_write(
    checkpoint: dict[str, object],
) -> None:
    folder = checkpoint["folder"]
    with pytest.raises(ValueError, match="own system message"):
        generate_text(STEP_NAMES[-1], folder, [CONVERSATION], TextOptions(system="Be brief."))
    with pytest.raises(ValueError, match="chat_template=False"):
        generate_text(STEP_NAMES[-1], folder, [CONVERSATION], TextOptions(chat_template=False))
    with pytest.raises(ValueError, match="prompt 1: message 2 has no 'content'"):
        generate_text(
            STEP_NAMES[-1], folder, [[{"role": "system", "content": "x"}, {"role": "user"}]]
        )
    with pytest.raises(ValueError, match="not both"):
        both = TextOptions(max_new_tokens=3, sampling_params=SamplingParams())
        generate_text(STEP_NAMES[-1], folder, PROMPTS, both)


@pytest.mark.usefixtures("no_model_load")
def test_generate_text_refuses_an_empty_prompt(checkpoint: dict[str, object]) -> None:
    """An empty prompt asks for nothing: refused by name, before the tokenizer would turn it
    into a BOS alone and the model would answer that."""
    with pytest.raises(RequestError, match="prompt 2 is empty"):
        generate_text(STEP_NAMES[-1], checkpoint["folder"], ["Grüße", ""])


def test_a_one_item_sampling_params_list_is_refused_like_the_engine_does(
    checkpoint: dict[str, object],
) -> None:
    """``generate_text`` and ``engine.generate`` agree: a list holds one ``SamplingParams``
    per prompt (vLLM's rule), so one item for two prompts is refused by both, with the same
    words; one item for one prompt is served by both."""
    from front.steps import load_step

    one = [SamplingParams(max_tokens=2)]
    with pytest.raises(RequestError) as text_error:
        generate_text(
            STEP_NAMES[-1], checkpoint["folder"], PROMPTS[:2], TextOptions(sampling_params=one)
        )
    step = load_step(STEP_NAMES[-1])
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(preset("tiny")))
    with pytest.raises(RequestError) as engine_error:
        engine.generate([[1, 2], [3, 4]], sampling_params=one)
    assert str(text_error.value) == str(engine_error.value)
    assert "1 sampling_params for 2 prompts" in str(text_error.value)
    assert text_error.value.param == engine_error.value.param == "sampling_params"
    served = generate_text(
        STEP_NAMES[-1], checkpoint["folder"], PROMPTS[:1], TextOptions(sampling_params=one)
    )
    assert [len(ids) for ids in engine.generate([[1, 2]], sampling_params=one)] == [2]
    assert len(served.output_ids) == 1


def test_the_result_says_why_a_short_system_prompt_cannot_hit(
    checkpoint: dict[str, object],
) -> None:
    """Prompts behind a system prompt shorter than one block share text but no full block:
    no request can hit, and the result says so (``cache_note``), as the command line prints
    it. In the chat template the same system prompt hits: the template's markup around it
    fills the block. A system prompt of several blocks hits too, and nothing is said; nor
    without a system prompt."""
    folder, options = checkpoint["folder"], TextOptions(max_new_tokens=1, system="Hi.")
    plain = replace(options, chat_template=False)
    short = generate_text(STEP_NAMES[-1], folder, PROMPTS, plain)
    assert short.stats.requests_hit == 0
    assert short.cache_note is not None and "fewer than one block of 16" in short.cache_note
    assert f"their first {short.system_tokens} tokens ('Hi.')" in short.cache_note
    chat = generate_text(STEP_NAMES[-1], folder, PROMPTS, options)
    assert chat.stats.requests_hit == len(PROMPTS) - 1 and chat.cache_note is None
    long = generate_text(STEP_NAMES[-1], folder, PROMPTS, replace(plain, system=CORPUS[0]))
    assert long.stats.requests_hit == len(PROMPTS) - 1 and long.cache_note is None
    alone = generate_text(STEP_NAMES[-1], folder, PROMPTS, replace(options, system=None))
    assert alone.system_tokens == 0 and alone.stats.requests_hit == 0  # the markup: 3 tokens
    assert alone.cache_note is None


# ---- bad values: one line, exit 2, before anything loads ------------------------------------


def bad_flags(folder: Path) -> list[tuple[list[str], str]]:
    """(argv, what the error line says), for files written by ``write_bad_files``."""
    model = ["--model", str(folder)]
    files = folder.parent / "bad"
    return [
        ([*model, "--temperature", "-0.5"], "argument --temperature: must be >= 0, got -0.5"),
        ([*model, "--temperature", "nan"], "argument --temperature: must be a finite number"),
        ([*model, "--temperature", "hot"], "argument --temperature: 'hot' is not a number"),
        ([*model, "--top-p", "0"], "argument --top-p: must be > 0 and <= 1, got 0"),
        ([*model, "--top-p", "1.5"], "argument --top-p: must be > 0 and <= 1, got 1.5"),
        ([*model, "--top-k", "-2"], "argument --top-k: must be >= -1, got -2"),
        ([*model, "--prompt-file", str(files / "nope.txt")], "No such file or directory"),
        ([*model, "--prompt-file", str(files / "blank.txt")], "no prompt in it"),
        ([*model, "--prompt-file", str(files)], "Is a directory"),
        ([*model, "--messages", str(files / "nope.json")], "No such file or directory"),
        ([*model, "--messages", str(files / "broken.json")], "not valid JSON"),
        ([*model, "--messages", str(files / "object.json")], "non-empty list of chat messages"),
        ([*model, "--messages", str(files / "empty.json")], "got an empty list"),
        ([*model, "--messages", str(files / "no-content.json")], "message 1 has no 'content'"),
        ([*model, "--messages", str(files / "number.json")], "message 2 has a non-string 'content"),
        ([*model, "--messages", str(files / "answered.json")], "is the assistant's"),
        (
            [*model, "--messages", str(files / "chat.json"), "--prompt", "hi"],
            "--messages and --prompt do not go together",
        ),
        (
            [*model, "--messages", str(files / "chat.json"), "--system", "Be brief."],
            "--messages and --system do not go together",
        ),
        (
            [*model, "--messages", str(files / "chat.json"), "--prompt-file", str(files / "p.txt")],
            "--messages and --prompt-file do not go together",
        ),
        (
            [*model, "--messages", str(files / "chat.json"), "--no-chat-template"],
            "drop --no-chat-template",
        ),
        ([*model, "--prompt", ""], "argument --prompt: an empty --prompt: give it some text"),
        ([*model, "--system", ""], "argument --system: an empty --system: give it some text"),
        ([*model, "--top-k", "50"], "--top-k chooses among the tokens a draw may take"),
        ([*model, "--top-p", "0.9"], "Give --temperature (vLLM's default is 1)"),
        ([*model, "--top-p", "0.9", "--temperature", "0"], "--top-p chooses among the tokens"),
        (["--stream"], "--stream needs --model DIR"),
        (["--temperature", "0.7"], "--temperature needs --model DIR"),
        (["--top-k", "5"], "--top-k needs --model DIR"),
        (["--prompt-file", str(files / "p.txt")], "--prompt-file needs --model DIR"),
        (["--messages", str(files / "chat.json")], "--messages needs --model DIR"),
    ]


def write_bad_files(folder: Path) -> None:
    files = folder.parent / "bad"
    files.mkdir(exist_ok=True)
    user = {"role": "user", "content": "hi"}
    contents = {
        "blank.txt": "\n  \n\n",
        "p.txt": "hello\n",
        "broken.json": '[{"role": "user",',
        "object.json": json.dumps({"role": "user", "content": "hi"}),
        "empty.json": "[]",
        "no-content.json": json.dumps([{"role": "user", "text": "hi"}]),
        "number.json": json.dumps([user, {"role": "user", "content": 5}]),
        "answered.json": json.dumps([user, {"role": "assistant", "content": "hello"}]),
        "chat.json": json.dumps([user]),
    }
    for name, text in contents.items():
        (files / name).write_text(text)


@pytest.mark.usefixtures("no_model_load")
def test_a_bad_text_flag_is_one_line_and_exit_2(
    checkpoint: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every case, in-process: argparse's one ``error:`` line, exit 2, nothing on stdout, no
    traceback, in well under a second each (nothing loaded, the model least of all)."""
    folder = checkpoint["folder"]
    write_bad_files(folder)
    run = importlib.import_module(f"{STEP_NAMES[-1]}.run")
    for argv, message in bad_flags(folder):
        start = time.perf_counter()
        line = usage_error(run.main, argv, capsys)
        assert time.perf_counter() - start < 1.0, argv
        assert line.startswith(f"python -m {STEP_NAMES[-1]}.run: error:"), line
        assert message in line, (argv, line)
