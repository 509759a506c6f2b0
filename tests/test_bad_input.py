"""Bad input: a clear ValueError at the door, and an engine left exactly as it was.

The design lists what must be refused (empty prompt, ids outside the vocabulary, non-integer
ids, max_new_tokens < 1, a request the whole pool could not hold) and promises the engine's
state is untouched. Each bad input is tried through ``add_request``, ``generate`` and
``generate_serial`` on an engine that is mid-life (warm cache, one request queued), then the
engine is compared with a twin that never saw the bad input.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import EngineFactory, reference_tokens, tiny_config

BLOCK_SIZE = 4
TOTAL_BLOCKS = 8  # the pool holds 32 token slots: a request of 33 can never run
CFG = tiny_config(block_size=BLOCK_SIZE, total_blocks=TOTAL_BLOCKS)
VOCAB = CFG.vocab_size
MAX_NEW = 2

_rng = random.Random(7)
GOOD = [_rng.randrange(VOCAB) for _ in range(9)]
WARMUP = [[*GOOD[:8], _rng.randrange(VOCAB)]]
QUEUED = [*GOOD[:4], *(_rng.randrange(VOCAB) for _ in range(2))]


@dataclass(frozen=True)
class BadRequest:
    """``add_request`` arguments that must be refused."""

    prompt: object
    max_new_tokens: object = MAX_NEW
    eos_token_id: object = None


BAD_REQUESTS: dict[str, BadRequest] = {
    "empty-list": BadRequest([]),
    "empty-tuple": BadRequest(()),
    "empty-tensor": BadRequest(torch.tensor([], dtype=torch.long)),
    "negative-id": BadRequest([1, -1, 2]),
    "id-equals-vocab": BadRequest([1, VOCAB, 2]),
    "id-far-above-vocab": BadRequest([10**20]),
    "float-ids": BadRequest([1.0, 2.0]),
    "fractional-id": BadRequest([1, 2.5]),
    "string-ids": BadRequest(["1", "2"]),
    "none-id": BadRequest([1, None]),
    "bool-ids": BadRequest([True, False]),
    "float-tensor": BadRequest(torch.tensor([1.0, 2.0])),
    "2d-tensor": BadRequest(torch.tensor([[1, 2], [3, 4]])),
    "string-prompt": BadRequest("hello"),
    "bytes-prompt": BadRequest(b"\x01\x02"),
    "none-prompt": BadRequest(None),
    "int-prompt": BadRequest(5),
    "max-new-zero": BadRequest([1, 2], max_new_tokens=0),
    "max-new-negative": BadRequest([1, 2], max_new_tokens=-3),
    "max-new-float": BadRequest([1, 2], max_new_tokens=2.0),
    "max-new-string": BadRequest([1, 2], max_new_tokens="2"),
    "max-new-none": BadRequest([1, 2], max_new_tokens=None),
    "eos-negative": BadRequest([1, 2], eos_token_id=-1),
    "eos-equals-vocab": BadRequest([1, 2], eos_token_id=VOCAB),
    "eos-float": BadRequest([1, 2], eos_token_id=1.0),
    "too-long-prompt": BadRequest([1] * (TOTAL_BLOCKS * BLOCK_SIZE + 1), max_new_tokens=1),
    "too-many-new-tokens": BadRequest([1, 2], max_new_tokens=TOTAL_BLOCKS * BLOCK_SIZE),
}
TOO_BIG = ("too-long-prompt", "too-many-new-tokens")


def submit_add_request(engine, bad: BadRequest) -> object:
    return engine.add_request(bad.prompt, bad.max_new_tokens, bad.eos_token_id)


def submit_generate(engine, bad: BadRequest) -> object:
    """The bad prompt comes last, after good ones: all or nothing means none is queued."""
    return engine.generate([GOOD, QUEUED, bad.prompt], bad.max_new_tokens, bad.eos_token_id)


def submit_generate_serial(engine, bad: BadRequest) -> object:
    return engine.generate_serial([GOOD, bad.prompt], bad.max_new_tokens, bad.eos_token_id)


SUBMITTERS: dict[str, Callable[[object, BadRequest], object]] = {
    "add_request": submit_add_request,
    "generate": submit_generate,
    "generate_serial": submit_generate_serial,
}


def mid_life_engine(make_engine: EngineFactory):
    """An engine with a warm cache and one request queued: "unchanged" is then non-trivial."""
    engine = make_engine(CFG, max_running=2)
    engine.generate(WARMUP, MAX_NEW)
    engine.add_request(QUEUED, MAX_NEW)
    return engine


def snapshot(engine) -> tuple[object, ...]:
    scheduler = engine.scheduler
    return (
        engine.stats,
        len(scheduler.waiting),
        len(scheduler.running),
        engine.kv_cache_manager.block_manager.num_free,
        engine.has_work,
    )


def assert_same_future(engine, twin) -> None:
    """The engine behaves exactly like a twin that never saw the bad input: same next id, same
    tokens (those of the reference), same stats afterwards."""
    assert engine.add_request(GOOD, MAX_NEW) == twin.add_request(GOOD, MAX_NEW)
    outputs = engine.generate([GOOD, QUEUED], MAX_NEW)
    assert outputs == twin.generate([GOOD, QUEUED], MAX_NEW)
    assert outputs == reference_tokens(CFG, [GOOD, QUEUED], MAX_NEW)
    assert not engine.has_work
    assert engine.stats == twin.stats
    assert engine.ref_count_problems() == []


@pytest.mark.parametrize("submit", SUBMITTERS.values(), ids=SUBMITTERS.keys())
@pytest.mark.parametrize("case", BAD_REQUESTS.keys())
def test_bad_input_is_refused_and_changes_nothing(
    make_engine: EngineFactory, case: str, submit: Callable[[object, BadRequest], object]
) -> None:
    """Every listed bad input raises ValueError, leaves the state as it was, and the engine
    goes on exactly as if the call had never been made."""
    engine, twin = mid_life_engine(make_engine), mid_life_engine(make_engine)
    before = snapshot(engine)
    with pytest.raises(ValueError):
        submit(engine, BAD_REQUESTS[case])
    assert snapshot(engine) == before
    assert_same_future(engine, twin)


@pytest.mark.parametrize("case", TOO_BIG)
def test_too_big_request_error_says_the_pool_cannot_hold_it(
    make_engine: EngineFactory, case: str
) -> None:
    """The user must learn that the request can never run here, not just that it failed."""
    engine = make_engine(CFG)
    with pytest.raises(ValueError, match=r"(?i)pool|blocks") as info:
        submit_add_request(engine, BAD_REQUESTS[case])
    assert str(TOTAL_BLOCKS) in str(info.value)


def test_request_filling_the_whole_pool_is_accepted(make_engine: EngineFactory) -> None:
    """The boundary of the "could never run" check: exactly the pool's size is legal."""
    prompt = GOOD[:2] * (TOTAL_BLOCKS * BLOCK_SIZE // 2)  # 32 tokens
    max_new = 1  # needs ceil((32 + 1 - 1) / 4) = 8 blocks: all of them
    engine = make_engine(CFG)
    assert engine.generate([prompt], max_new) == reference_tokens(CFG, [prompt], max_new)
    assert engine.ref_count_problems() == []


VALID_PROMPT_FORMS: dict[str, Callable[[list[int]], object]] = {
    "tuple": tuple,
    "int64-tensor": lambda p: torch.tensor(p, dtype=torch.int64),
    "int32-tensor": lambda p: torch.tensor(p, dtype=torch.int32),
}


@pytest.mark.parametrize("form", VALID_PROMPT_FORMS.values(), ids=VALID_PROMPT_FORMS.keys())
def test_alternative_prompt_forms_are_accepted(
    make_engine: EngineFactory, form: Callable[[list[int]], object]
) -> None:
    """A 1-D integer tensor or a tuple is the same prompt as the list: same tokens out."""
    expected = reference_tokens(CFG, [GOOD], MAX_NEW)
    engine = make_engine(CFG)
    assert engine.generate([form(GOOD)], MAX_NEW) == expected
    assert engine.generate_serial([form(GOOD)], MAX_NEW) == expected
    request_id = engine.add_request(form(GOOD), MAX_NEW)
    assert isinstance(request_id, int)
    assert engine.has_work
    while engine.has_work:
        engine.step()
    assert engine.ref_count_problems() == []


def test_eos_at_the_vocabulary_edge_is_accepted(make_engine: EngineFactory) -> None:
    """eos ids 0 and vocab_size - 1 are real tokens: the range check must not be off by one."""
    engine = make_engine(CFG)
    for eos in (0, VOCAB - 1):
        outputs = engine.generate([GOOD], MAX_NEW, eos_token_id=eos)
        assert outputs == reference_tokens(CFG, [GOOD], MAX_NEW, eos)


@pytest.mark.parametrize(
    "bad",
    [BadRequest(GOOD, max_new_tokens=True), BadRequest(GOOD, eos_token_id=False)],
    ids=["max-new-bool", "eos-bool"],
)
def test_a_bool_is_not_an_integer_anywhere(make_engine: EngineFactory, bad: BadRequest) -> None:
    """True and False are ints to Python, but not a token count or a token id."""
    engine = make_engine(CFG)
    with pytest.raises(ValueError):
        submit_add_request(engine, bad)
    assert not engine.has_work


@pytest.mark.parametrize("serial", [False, True], ids=["generate", "generate_serial"])
def test_a_one_shot_iterable_prompt_is_served_or_refused_whole(
    make_engine: EngineFactory, serial: bool
) -> None:
    """``common.inputs.as_token_list`` takes any iterable of ints; generate must then either
    serve it (what add_request does with it) or refuse the whole call and change nothing."""
    engine = make_engine(CFG)
    run = engine.generate_serial if serial else engine.generate
    try:
        outputs = run([GOOD, iter(QUEUED)], MAX_NEW)
    except ValueError:
        assert not engine.has_work
        raise AssertionError("a valid prompt was refused") from None
    assert outputs == reference_tokens(CFG, [GOOD, QUEUED], MAX_NEW)


@pytest.mark.parametrize(
    "text", ["hello", "", b"\x01\x02", 5, None], ids=["str", "empty-str", "bytes", "int", "none"]
)
@pytest.mark.parametrize("serial", [False, True], ids=["generate", "generate_serial"])
def test_text_in_place_of_the_list_of_prompts_is_refused(
    make_engine: EngineFactory, text: object, serial: bool
) -> None:
    """generate takes a list of prompts: text in its place is refused with an error that says
    so, not read as one prompt per character (an empty string is not an empty batch), and so
    is a lone number or None, with a ValueError like every other bad input."""
    engine = make_engine(CFG)
    run = engine.generate_serial if serial else engine.generate
    with pytest.raises(ValueError, match="list of prompts"):
        run(text, MAX_NEW)
    assert not engine.has_work
