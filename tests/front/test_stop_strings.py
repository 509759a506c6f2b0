"""Stop strings (vLLM's ``stop``), the rule that ``generate_text``, the chat loop and the server
share (``front/stream.py``: ``StopStrings``, ``IncrementalDetokenizer``):

- the text ends before the first stop string (after it, with ``include_stop_str_in_output``),
  the request is aborted there and its tokens counted up to the one that completed it;
- streamed, nothing that could still become a stop string is shown: every piece handed out is
  a beginning of the final text, and the pieces add up to it;
- none is looked for in the text of the first ``min_tokens`` tokens (it may begin there);
- an empty stop string is refused when the options are made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from common.errors import RequestError
from common.sampling_params import SamplingParams
from front.codec import text_decoder
from front.stream import IncrementalDetokenizer, StopStrings
from front.text import TextOptions, generate_text
from tests.helpers import STEP_NAMES
from tests.toy_checkpoint import byte_level_bpe

CORPUS = ["The weather is nice today and the cat is happy in the sun.", "Grüße 你好 🙂"]
TOKENIZER = byte_level_bpe(CORPUS, ["<|endoftext|>"], vocab_size=300)
DECODE = text_decoder(TOKENIZER)


def pieces(text: str, stop: StopStrings) -> tuple[list[str], IncrementalDetokenizer]:
    """``text``'s tokens fed one at a time: the pieces handed out, and the detokenizer."""
    ids = TOKENIZER.encode(text).ids
    detokenizer = IncrementalDetokenizer(DECODE, stop)
    handed = [detokenizer.update(ids[: i + 1]) for i in range(len(ids))]
    return [*handed, detokenizer.finish(ids)], detokenizer


@pytest.mark.parametrize(
    ("stop", "include", "expected", "reason"),
    [
        (("cat",), False, "The weather is nice today and the ", "cat"),
        (("cat",), True, "The weather is nice today and the cat", "cat"),
        (("happy", "nice"), False, "The weather is ", "nice"),  # the first in the text
        (("dog",), False, "The weather is nice today and the cat is happy in the sun.", None),
    ],
)
def test_the_text_ends_at_the_first_stop_string(
    stop: tuple[str, ...], include: bool, expected: str, reason: str | None
) -> None:
    handed, detokenizer = pieces(CORPUS[0], StopStrings(stop, include))
    assert "".join(handed) == detokenizer.text == expected
    assert detokenizer.stop_reason == reason
    if reason is not None:  # the token that completed it is the answer's last
        ids = TOKENIZER.encode(CORPUS[0]).ids
        before = DECODE(ids[: detokenizer.num_tokens - 1])
        assert reason not in before and reason in DECODE(ids[: detokenizer.num_tokens])


@pytest.mark.parametrize("stop", ["the cat", "e c", "is happy in the sun.", "Grüße 你"])
def test_nothing_shown_is_taken_back(stop: str) -> None:
    """Every piece handed out so far is a beginning of the final text, which never contains
    the stop string: text that could still become one is held back."""
    text = CORPUS[0] + " " + CORPUS[1]
    handed, detokenizer = pieces(text, StopStrings((stop,)))
    shown = ""
    for piece in handed:
        shown += piece
        assert detokenizer.text.startswith(shown) and stop not in shown
    assert shown == detokenizer.text == text.split(stop)[0]


def test_a_stop_string_within_min_tokens_is_not_looked_for() -> None:
    """vLLM's rule: no stop string ends in the text of the first ``min_tokens`` tokens; one
    that begins there and ends after is found."""
    ids = TOKENIZER.encode(CORPUS[0]).ids
    at = next(n for n in range(len(ids)) if "cat" in DECODE(ids[: n + 1]))  # "cat" ends there
    _, within = pieces(CORPUS[0], StopStrings(("cat",), min_tokens=at + 1))
    assert within.stop_reason is None
    _, across = pieces(CORPUS[0], StopStrings(("cat is",), min_tokens=at + 1))
    assert across.stop_reason == "cat is" and across.text.endswith("the ")
    _, before = pieces(CORPUS[0], StopStrings(("cat",), min_tokens=at))
    assert before.stop_reason == "cat"


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(RequestError, match="stop"):
        StopStrings(("",))
    with pytest.raises(RequestError, match="stop"):
        TextOptions(stop=["x", ""])


def half_way(text: str) -> str:
    """Two characters from the middle of ``text`` that do not occur before."""
    starts = range(len(text) // 3, len(text) - 2)
    return next(text[i : i + 2] for i in starts if text[i : i + 2] not in text[: i + 1])


def test_generate_text_stops_and_aborts_at_a_stop_string(tmp_path: Path) -> None:
    """A sampled run cut by a string it reaches half-way: the same tokens up to the one that
    completed it, the text before the string, "stop", and the engine left with no request."""
    from transformers import PreTrainedTokenizerFast

    from common.config import preset
    from front.hf import hf_llama

    cfg = preset("tiny", vocab_size=TOKENIZER.get_vocab_size())
    hf_llama(cfg).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=TOKENIZER).save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=4)
    base = {"sampling_params": params, "chat_template": False}
    free = generate_text(STEP_NAMES[-1], tmp_path, ["The weather"], TextOptions(**base))
    text = free.outputs[0]
    stop = half_way(text)
    cut = generate_text(STEP_NAMES[-1], tmp_path, ["The weather"], TextOptions(**base, stop=stop))
    assert cut.outputs[0] == text.split(stop)[0]
    assert cut.finish_reasons == ["stop"] and cut.stop_reasons == [stop]
    ids = cut.output_ids[0]
    assert ids == free.output_ids[0][: len(ids)] and len(ids) < 24
    assert stop in DECODE(ids) and stop not in DECODE(ids[:-1])
    assert cut.stats.requests_running == 0
