"""End-to-end greedy generation: every way of driving the engine gives the reference's tokens.

The specification: batched or serial, through ``generate`` or round by round, with a cold, a
hot or a disabled cache, in float64 or float32, the tokens are the dense reference's; a request
stops exactly at ``max_new_tokens`` or just after its first eos (even as its first token); and
the model is worth testing against (its generations are not degenerate).
"""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch

from common.config import ModelConfig
from common.numbers import cdiv
from front.workload import demo_prompts, shared_prefix_prompts
from tests.helpers import (
    EngineFactory,
    assert_engine_matches_reference,
    prefill_chunk,
    reference_tokens,
    tiny_config,
    tokens,
    truncate_at,
)

CFG = tiny_config()
MAX_NEW = 10


def mixed_prompts() -> list[list[int]]:
    """Shared prefixes, exact block multiples, a prompt that is a prefix of another, one-token
    and longer-than-a-chunk prompts: the shapes where a paged engine goes wrong."""
    cfg = tiny_config()
    shared = shared_prefix_prompts(4, prefix_len=9, tail_len=3, vocab_size=cfg.vocab_size)
    rng = random.Random(21)
    other = [rng.randrange(cfg.vocab_size) for _ in range(cfg.block_size * 3)]
    return [*shared, other, other[: cfg.block_size], [other[0]], shared[0][:9]]


@cache
def _reference(
    cfg: ModelConfig, prompts: tuple[tuple[int, ...], ...], max_new: int, eos: int | None
) -> list[list[int]]:
    return reference_tokens(cfg, [list(p) for p in prompts], max_new, eos)


def expected(
    prompts: list[list[int]], max_new: int = MAX_NEW, eos: int | None = None
) -> list[list[int]]:
    """The float64 oracle's tokens, memoized: every step asks for the same ones."""
    return _reference(tiny_config(), tuple(map(tuple, prompts)), max_new, eos)


def drive(engine: object, prompts: list[list[int]], max_new: int) -> tuple[list[int], int]:
    """Serve ``prompts`` through add_request / step / has_work; returns (request ids, rounds)."""
    ids = [engine.add_request(p, max_new) for p in prompts]
    assert engine.has_work
    rounds = 0
    while engine.has_work:
        engine.step()
        rounds += 1
    return ids, rounds


# ---- parity with the reference --------------------------------------------------------------


@pytest.mark.parametrize("max_running", [1, 3, 16])
def test_generate_matches_reference(make_engine: EngineFactory, max_running: int) -> None:
    engine = make_engine(max_running=max_running)
    assert_engine_matches_reference(engine, mixed_prompts(), MAX_NEW)


def test_generate_serial_matches_reference(make_engine: EngineFactory) -> None:
    assert_engine_matches_reference(make_engine(), mixed_prompts(), MAX_NEW, serial=True)


def test_cold_then_hot_run_matches_reference(make_engine: EngineFactory) -> None:
    """The second run reads prefixes from the cache, and still produces the same tokens."""
    engine = make_engine(max_running=3)
    assert_engine_matches_reference(engine, mixed_prompts(), MAX_NEW)
    engine.reset_stats()
    assert_engine_matches_reference(engine, mixed_prompts(), MAX_NEW, serial=True)
    assert engine.stats.cached_tokens > 0  # the hot path really ran


def test_without_prefix_cache_matches_reference(make_engine: EngineFactory) -> None:
    engine = make_engine(enable_prefix_cache=False)
    assert_engine_matches_reference(engine, mixed_prompts(), MAX_NEW)
    assert_engine_matches_reference(engine, mixed_prompts(), MAX_NEW, serial=True)
    assert engine.stats.cached_tokens == 0


def test_float32_engine_gives_float64_reference_tokens(make_engine: EngineFactory) -> None:
    """float32 is checked against the float64 oracle: the weights make argmax margins decisive."""
    cfg = tiny_config(dtype=torch.float32)
    prompts = demo_prompts(cfg.vocab_size, cfg.block_size)
    assert make_engine(cfg, max_running=4).generate(prompts, 12) == expected(prompts, 12)


# ---- stopping and edge cases ----------------------------------------------------------------


def test_eos_stops_request_at_first_eos(make_engine: EngineFactory) -> None:
    """eos is taken from the reference's own output, so it surely occurs mid-generation."""
    prompts = mixed_prompts()
    full = expected(prompts, 16)
    eos = full[0][7]
    want = [truncate_at(tokens, eos) for tokens in full]
    assert len(want[0]) <= 8 < 16
    assert make_engine(max_running=3).generate(prompts, 16, eos_token_id=eos) == want
    assert expected(prompts, 16, eos) == want  # the oracle agrees on what stopping means


def test_eos_as_the_first_generated_token_stops_with_exactly_that_token(
    make_engine: EngineFactory,
) -> None:
    """The first token comes out of the last prefill chunk; if it is eos the request is done,
    with that one token, and the others in the batch go on unaffected."""
    prompts = [tokens(300 + i, n) for i, n in enumerate((6, 1, 9, 4))]
    full = reference_tokens(CFG, prompts, 8)
    eos = full[2][0]
    want = [truncate_at(out, eos) for out in full]
    assert want[2] == [eos]
    assert make_engine(max_running=4).generate(prompts, 8, eos_token_id=eos) == want
    serial = make_engine(max_running=1).generate_serial(prompts, 8, eos_token_id=eos)
    assert serial == want


def test_request_stops_at_max_new_tokens_exactly(make_engine: EngineFactory) -> None:
    prompts = [tokens(310 + i, n) for i, n in enumerate((3, 8, 1))]
    for max_new in (1, 2, 5):
        outputs = make_engine().generate(prompts, max_new)
        assert [len(o) for o in outputs] == [max_new] * len(prompts)


def test_one_new_token(make_engine: EngineFactory) -> None:
    outputs = assert_engine_matches_reference(make_engine(), mixed_prompts(), 1)
    assert all(len(tokens) == 1 for tokens in outputs)


def test_one_token_prompts(make_engine: EngineFactory) -> None:
    prompts = [[5], [tiny_config().vocab_size - 1], [0], [5]]
    outputs = assert_engine_matches_reference(make_engine(), prompts, MAX_NEW)
    assert outputs[0] == outputs[3]


def test_step_api_matches_generate(make_engine: EngineFactory) -> None:
    """Driving the engine round by round gives generate's tokens. With everyone admitted at
    once, each round advances every prefill one chunk (a block; from step14_9 on, these short
    prompts whole) and every decode one token."""
    prompts = mixed_prompts()
    engine = make_engine(max_running=len(prompts))
    ids, rounds = drive(engine, prompts, MAX_NEW)
    assert len(set(ids)) == len(ids)
    via_step = [engine.pop_output(i) for i in ids]
    assert via_step == make_engine().generate(prompts, MAX_NEW) == expected(prompts)
    prefill_rounds = max(cdiv(len(p), prefill_chunk(engine)) for p in prompts)
    assert rounds == prefill_rounds + MAX_NEW - 1


# ---- the model is worth testing against -----------------------------------------------------


def test_generations_are_not_degenerate(make_engine: EngineFactory) -> None:
    """A collapsed model (one repeated token, or output independent of the prompt) would make
    every parity test above pass trivially; these thresholds fail such a model."""
    cfg = tiny_config()
    rng = random.Random(3)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(5 + 3 * i)] for i in range(5)]
    outputs = make_engine().generate(prompts, 24)
    assert all(len(set(tokens)) >= 16 for tokens in outputs), outputs
    assert len({tuple(tokens) for tokens in outputs}) == len(prompts)
    assert len({tokens[0] for tokens in outputs}) >= 4
