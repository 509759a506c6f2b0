"""Memory pressure: many requests through a pool far smaller than their total need.

The design promises that memory pressure never crashes the engine and never loses a request: a
request waits until the blocks it can need over its whole life are free or evictable. These tests
squeeze the pool down to the largest single request and check that every request still finishes
with exactly the tokens of a roomy pool and of the dense reference, and that no block leaks.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from common.workload import shared_prefix_prompts
from tests.conftest import EngineFactory, blocks_needed, reference_tokens, tiny_config

BLOCK_SIZE = 4
MAX_NEW = 4
VOCAB = tiny_config().vocab_size

Runner = Callable[[object, list[list[int]]], list[list[int]]]


def largest_need(prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> int:
    return max(blocks_needed(len(p), max_new_tokens, BLOCK_SIZE) for p in prompts)


def total_need(prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> int:
    return sum(blocks_needed(len(p), max_new_tokens, BLOCK_SIZE) for p in prompts)


def mixed_prompts() -> list[list[int]]:
    """16 requests: two groups behind shared prefixes (cache hits, shared blocks) and six
    unrelated prompts of assorted lengths (including one-token and exact block multiples)."""
    group_a = shared_prefix_prompts(5, prefix_len=12, tail_len=3, vocab_size=VOCAB, seed=1)
    group_b = shared_prefix_prompts(5, prefix_len=8, tail_len=5, vocab_size=VOCAB, seed=2)
    rng = random.Random(3)
    loners = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 4, 7, 16, 19, 10)]
    mixed = group_a + group_b + loners
    random.Random(4).shuffle(mixed)  # interleave groups so hits and misses alternate
    return mixed


def distinct_prompts(count: int = 12, length: int = 9) -> list[list[int]]:
    """Prompts sharing nothing, each leaving two full blocks in the cache: a cache that keeps
    them all would need far more than the pool, so serving them must evict."""
    rng = random.Random(5)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(count)]


def engine_for(
    make_engine: EngineFactory,
    total_blocks: int,
    max_running: int = 4,
    enable_prefix_cache: bool = True,
):
    cfg = tiny_config(block_size=BLOCK_SIZE, total_blocks=total_blocks)
    return make_engine(cfg, max_running=max_running, enable_prefix_cache=enable_prefix_cache)


def assert_at_rest(engine, expected_requests: int) -> None:
    """No request holds a block any more: every block is free or held by the cache alone."""
    stats, total = engine.stats, engine.kv_cache_manager.block_manager.total_blocks
    assert not engine.has_work
    assert stats.blocks_used == 0
    assert stats.blocks_free + stats.blocks_cached == total
    assert stats.requests == expected_requests
    assert engine.ref_count_problems() == []
    if engine.kv_cache_manager.prefix_cache is None:
        assert stats.blocks_cached == 0 and stats.blocks_free == total


def roomy_outputs(make_engine: EngineFactory, prompts: list[list[int]]) -> list[list[int]]:
    """The same prompts through a pool where every request fits at once."""
    engine = engine_for(make_engine, 2 * total_need(prompts), max_running=len(prompts))
    return engine.generate(prompts, MAX_NEW)


def check_tight_run(
    make_engine: EngineFactory,
    prompts: list[list[int]],
    total_blocks: int,
    run: Runner | None = None,
    compare_roomy: bool = False,
    **engine_kwargs: object,
):
    """Serve ``prompts`` through a pool of ``total_blocks``; compare with the reference (and,
    when asked, with a roomy pool); the engine must end at rest."""
    assert total_blocks >= largest_need(prompts)
    engine = engine_for(make_engine, total_blocks, **engine_kwargs)
    outputs = run(engine, prompts) if run else engine.generate(prompts, MAX_NEW)
    cfg = engine.model.cfg
    assert outputs == reference_tokens(cfg, prompts, MAX_NEW)
    if compare_roomy:
        assert outputs == roomy_outputs(make_engine, prompts)
    assert_at_rest(engine, len(prompts))
    return engine


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("fraction", [2, 4], ids=["half", "quarter"])
def test_tight_pool_finishes_every_request_with_reference_tokens(
    make_engine: EngineFactory, enable_prefix_cache: bool, fraction: int
) -> None:
    """A pool holding a fraction of the total need still serves every request correctly."""
    prompts = mixed_prompts()
    pool = max(largest_need(prompts), total_need(prompts) // fraction)
    assert pool < total_need(prompts)  # the case really is under pressure
    check_tight_run(
        make_engine, prompts, pool, compare_roomy=True, enable_prefix_cache=enable_prefix_cache
    )


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("max_running", [1, 16])
def test_pool_exactly_the_largest_request(
    make_engine: EngineFactory, enable_prefix_cache: bool, max_running: int
) -> None:
    """The smallest legal pool: the largest request alone fills it, so it must wait for an empty
    pool (cache evicted) and everything else must squeeze around it."""
    prompts = mixed_prompts()
    check_tight_run(
        make_engine,
        prompts,
        largest_need(prompts),
        max_running=max_running,
        enable_prefix_cache=enable_prefix_cache,
    )


@pytest.mark.parametrize("serial", [False, True], ids=["batched", "serial"])
def test_cache_evicts_when_the_pool_is_full(make_engine: EngineFactory, serial: bool) -> None:
    """Distinct prompts leave more cached blocks than the pool holds, so new requests can only
    be served by evicting; the evicted prefixes must not corrupt later tokens."""
    prompts = distinct_prompts()
    pool = 3 * largest_need(prompts)
    cached_if_kept = len(prompts) * (len(prompts[0]) // BLOCK_SIZE)
    assert cached_if_kept > pool  # by construction, the cache cannot keep everything

    def run(engine, batch: list[list[int]]) -> list[list[int]]:
        return (engine.generate_serial if serial else engine.generate)(batch, MAX_NEW)

    engine = check_tight_run(make_engine, prompts, pool, run=run, max_running=2)
    assert engine.stats.evictions > 0
    assert engine.stats.blocks_cached <= pool


def test_evictions_are_reported_even_when_the_cache_ends_empty(make_engine: EngineFactory) -> None:
    """The eviction count is history: emptying the cache must not make it read zero.

    The first request leaves one cached block A. The second is exactly A's tokens with a long
    answer: its only prompt block holds the last prompt token, so it is recomputed into a fresh
    block (A keeps the hash), and its output block cannot be cached behind an uncached parent.
    It needs the whole pool, so its first output block can only come from evicting A."""
    (block_a,) = distinct_prompts(count=1, length=BLOCK_SIZE)
    first, second = [[*block_a, 0]], [block_a]
    max_new = BLOCK_SIZE + 1  # KV for 2 * BLOCK_SIZE tokens: two blocks, the whole pool
    pool = blocks_needed(BLOCK_SIZE, max_new, BLOCK_SIZE)
    engine = engine_for(make_engine, pool)
    assert engine.generate(first, 1) == reference_tokens(engine.model.cfg, first, 1)
    assert engine.stats.blocks_cached == 1
    assert engine.generate(second, max_new) == reference_tokens(engine.model.cfg, second, max_new)
    assert engine.stats.blocks_cached == 0
    assert engine.stats.evictions == 1
    assert_at_rest(engine, 2)


def test_hot_round_after_eviction_still_matches(make_engine: EngineFactory) -> None:
    """A second round on the same squeezed engine mixes surviving cache entries with evicted
    ones: hits must be verified, evicted ones recomputed, tokens unchanged."""
    prompts = mixed_prompts()
    engine = engine_for(make_engine, largest_need(prompts) + 2, max_running=3)
    first = engine.generate(prompts, MAX_NEW)
    evictions_after_first = engine.stats.evictions
    second = engine.generate(prompts[::-1], MAX_NEW)
    assert second == first[::-1]
    assert first == reference_tokens(engine.model.cfg, prompts, MAX_NEW)
    assert engine.stats.evictions >= evictions_after_first > 0
    assert_at_rest(engine, 2 * len(prompts))


def record_rounds(engine) -> list[tuple[int, int]]:
    """Wrap ``engine.step`` so each round logs (admitted-and-unfinished, waiting) after it ran
    the scheduler; returns the live log."""
    log: list[tuple[int, int]] = []
    original_step = engine.step

    def step() -> None:
        original_step()
        scheduler = engine.scheduler
        log.append((len(scheduler.running), len(scheduler.waiting)))

    engine.step = step
    return log


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
def test_max_running_beyond_memory_makes_requests_wait(
    make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """max_running allows every request at once but memory does not: admission must hold
    requests back (they wait), never over-commit the pool or crash mid-run."""
    prompts = mixed_prompts()
    pool = 2 * largest_need(prompts)
    engine = engine_for(
        make_engine, pool, max_running=len(prompts), enable_prefix_cache=enable_prefix_cache
    )
    log = record_rounds(engine)
    outputs = engine.generate(prompts, MAX_NEW)
    assert outputs == reference_tokens(engine.model.cfg, prompts, MAX_NEW)
    assert log, "generate must go through engine.step"
    assert max(running for running, _ in log) < len(prompts)
    assert any(waiting > 0 and running < len(prompts) for running, waiting in log)
    assert_at_rest(engine, len(prompts))
