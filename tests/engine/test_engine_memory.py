"""The engine's memory: admission by the first chunk, allocation on demand, exact block
figures, and a pool under pressure.

The specification: a waiting request is admitted, first come first served and up to
max_running, once the blocks its first chunk needs (after adopting what the cache holds) fit in
what is free or evictable, and nobody is admitted in a round that had to preempt; every later
block is allocated when a chunk or a decode token first needs it, so a pool that worst-case
reservation would fill with two requests runs four or more. ``EngineStats``' block figures are
exact: free + cached + used-but-uncached = total, at every round. With a pool squeezed down to
the largest single request, every request still finishes with exactly the tokens of a roomy
pool and of the dense reference, and the cache evicts what it must.

What happens when a running request finds no block (preemption of the youngest, recompute,
nothing lost) is in ``test_engine_preemption.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from common.inputs import blocks_for_request
from common.numbers import cdiv
from common.status import SequenceStatus
from front.workload import shared_prefix_prompts
from tests.helpers import (
    EngineFactory,
    blocks_needed,
    budget_args,
    guard_against_hangs,
    life_in_rounds,
    log_schedules,
    prefill_chunk,
    reference_tokens,
    run_rounds,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size
VOCAB = CFG.vocab_size


# ---- admission: the first chunk, first come first served, not in a round that preempts -----------


def test_engine_admission_needs_only_the_first_chunk(make_engine: EngineFactory) -> None:
    """A request is admitted when its first chunk fits, not its whole life.

    Pool of 8, cache off: A can need 5 blocks (9 + 12 - 1 = 20 tokens), B 3 (5 + 5 - 1 = 9
    tokens), C and D one each: 10 in all, so reserving each one's worst case would leave C and D
    waiting behind A and B. Each first chunk needs one block, so all four start in round one,
    in arrival order; C and D finish in it, and A and B then fit exactly. (From step14_9 on a
    first chunk is a whole short prompt, 3 + 2 + 1 + 1 blocks: all four still start at once.)"""
    cfg = tiny_config(total_blocks=8)
    sizes = [(9, 12), (5, 5), (1, 1), (1, 1)]
    assert [blocks_needed(n, m, BS) for n, m in sizes] == [5, 3, 1, 1]
    engine = make_engine(cfg, enable_prefix_cache=False)
    log = log_schedules(engine)
    prompts = [tokens(200 + i, n) for i, (n, _) in enumerate(sizes)]
    ids = [engine.add_request(p, m) for p, (_, m) in zip(prompts, sizes)]
    engine.step()
    assert (engine.stats.requests, engine.stats.prompt_tokens) == (4, 9 + 5 + 1 + 1)
    run_rounds(engine)
    assert log[0] == ids
    b_life = life_in_rounds(5, 5, chunk=prefill_chunk(engine))
    assert all(round_ids == ids[:2] for round_ids in log[1:b_life])
    assert engine.stats.preemptions == 0
    for prompt, (_, m), rid in zip(prompts, sizes, ids):
        assert engine.pop_output(rid) == reference_tokens(cfg, [prompt], m)[0]


def test_a_request_that_may_need_the_whole_pool_starts_beside_another(
    make_engine: EngineFactory,
) -> None:
    """A request whose worst case (prompt + max_new_tokens) is the whole pool is admitted in the
    same round as another one, because its first chunk fits; worst-case reservation would make
    it wait until the pool is empty. Both then finish with the reference's tokens."""
    cfg = tiny_config(block_size=BS, total_blocks=8)
    engine = make_engine(cfg, max_running=2)
    first, second = tokens(100, BS), tokens(101, BS)
    ids = [engine.add_request(first, 2)]
    ids.append(engine.add_request(second, 8 * BS - BS + 1))  # needs all 8 blocks by the end
    assert blocks_for_request(BS, 8 * BS - BS + 1, BS) == cfg.total_blocks
    engine.step()
    assert [s.seq_id for s in engine.scheduler.running] == ids
    run_rounds(engine)
    assert engine.pop_output(ids[0]) == reference_tokens(cfg, [first], 2)[0]
    assert engine.pop_output(ids[1]) == reference_tokens(cfg, [second], 8 * BS - BS + 1)[0]


def test_the_head_of_the_queue_is_not_overtaken(make_engine: EngineFactory) -> None:
    """First come, first served: when the head's first chunk does not fit, nobody behind it is
    admitted, even a request that would fit.

    The head H would adopt two cached blocks that only the cache holds (adopting them makes them
    unevictable) and needs a fresh one: three blocks out of the two available while R runs. S
    behind it needs one; it waits anyway."""
    cfg = tiny_config(total_blocks=5)
    engine = make_engine(cfg, max_running=4)
    cached_prompt = tokens(210, 2 * BS + 1)
    engine.generate([cached_prompt], 1)  # leaves its two full blocks in the cache
    rid_r = engine.add_request(tokens(211, 3 * BS - 1), 3)
    # R's prefill (three chunks; one from step14_9 on): it holds three blocks, none is free
    for _ in range(cdiv(3 * BS - 1, prefill_chunk(engine))):
        engine.step()
    assert (engine.stats.blocks_free, engine.stats.blocks_used) == (0, 3)  # 2 evictable
    rid_h = engine.add_request([*cached_prompt[: 2 * BS], 5], 1)
    rid_s = engine.add_request(tokens(212, 1), 1)
    engine.step()
    assert [s.seq_id for s in engine.scheduler.waiting] == [rid_h, rid_s]
    assert [s.seq_id for s in engine.scheduler.running] == [rid_r]
    run_rounds(engine)
    for rid in (rid_r, rid_h, rid_s):
        assert engine.pop_output(rid)


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
def test_a_round_that_preempts_admits_nobody(
    make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """Memory is short in a round that had to preempt: nobody waiting joins in it, not even the
    victim, whose first chunk would fit in the blocks it has just given back."""
    cfg = tiny_config(block_size=BS, total_blocks=5)
    engine = make_engine(cfg, max_running=3, enable_prefix_cache=enable_prefix_cache)
    prompts = [tokens(90, 7), tokens(91, 3), tokens(92, 2)]
    ids = [engine.add_request(p, 8) for p in prompts]
    preempting_rounds = 0
    while engine.has_work:
        waiting_before = {s.seq_id for s in engine.scheduler.waiting}
        preempted_before = {s.seq_id: s.num_preemptions for s in engine.scheduler.running}
        before = engine.stats.preemptions
        engine.step()
        if engine.stats.preemptions == before:
            continue
        preempting_rounds += 1
        running = {s.seq_id for s in engine.scheduler.running}
        assert not running & waiting_before, "a round that preempted admitted a waiting request"
        victims = [s for s in engine.scheduler.waiting if s.status is SequenceStatus.PREEMPTED]
        assert len(victims) >= engine.stats.preemptions - before
        assert all(v.num_preemptions > preempted_before.get(v.seq_id, 0) for v in victims[:1])
    assert preempting_rounds > 0, "the scenario never preempted"
    assert [engine.pop_output(i) for i in ids] == reference_tokens(cfg, prompts, 8)


# ---- allocation on demand: every block comes back ------------------------------------------------


POOL = 6
POOL_CFG = tiny_config(total_blocks=POOL)


def assert_whole_pool_request_starts_at_once(engine) -> None:
    """A request that can need every block of the pool must be admitted in its first round and
    run its exact life: nothing may stay held once the engine is idle."""
    prompt = tokens(400, (POOL - 1) * BS + 1)
    max_new = BS
    assert blocks_needed(len(prompt), max_new, BS) == POOL
    rid = engine.add_request(prompt, max_new)
    assert run_rounds(engine) == life_in_rounds(len(prompt), max_new, chunk=prefill_chunk(engine))
    assert engine.pop_output(rid) == reference_tokens(POOL_CFG, [prompt], max_new)[0]


def test_early_eos_leaves_the_whole_pool_free(make_engine: EngineFactory) -> None:
    """A request that may need the whole pool but stops at its first token (eos) held only
    what it used, and gives it back: the next whole-pool request starts at once."""
    engine = make_engine(POOL_CFG)
    prompt = tokens(401, 3)
    max_new = POOL * BS - len(prompt) + 1
    assert blocks_needed(len(prompt), max_new, BS) == POOL
    eos = reference_tokens(POOL_CFG, [prompt], 1)[0][0]
    assert engine.generate([prompt], max_new, eos_token_id=eos) == [[eos]]
    assert_whole_pool_request_starts_at_once(engine)


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
def test_every_block_comes_back_after_hits_and_lazy_allocation(
    make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """Adopted blocks and allocated blocks alike go back when their requests are done, so a
    whole-pool request still starts at once (evicting what the cache kept)."""
    engine = make_engine(POOL_CFG, enable_prefix_cache=enable_prefix_cache)
    shared = tokens(402, 2 * BS)
    prompts = [[*shared, 1], [*shared, 2, 3], [*shared, 4]]
    assert engine.generate_serial(prompts, 2) == reference_tokens(POOL_CFG, prompts, 2)
    assert engine.generate(prompts, 2) == reference_tokens(POOL_CFG, prompts, 2)
    if enable_prefix_cache:
        assert engine.stats.cached_tokens > 0
    assert_whole_pool_request_starts_at_once(engine)


def test_allocation_is_lazy_and_never_beyond_the_need(step, make_engine: EngineFactory) -> None:
    """One request alone, cache off: after each round it holds exactly the blocks its KV
    needs so far (ceil(tokens with KV / block_size)), never more than its whole life needs
    (a prefill chunk is one block; from step14_9 on, two under a budget of two blocks)."""
    engine = make_engine(enable_prefix_cache=False, **budget_args(step, 2 * BS))
    total = CFG.total_blocks
    prompt, max_new = tokens(410, 3 * BS + 1), BS + 2
    need = blocks_needed(len(prompt), max_new, BS)
    rid = engine.add_request(prompt, max_new)
    held = []
    while engine.has_work:
        engine.step()
        held.append(engine.stats.blocks_used)
        assert engine.stats.blocks_free == total - held[-1]
    chunk = prefill_chunk(engine)
    kv_tokens = [min((r + 1) * chunk, len(prompt)) for r in range(cdiv(len(prompt), chunk))]
    kv_tokens += [len(prompt) + d for d in range(1, max_new)]
    expected = [cdiv(n, BS) for n in kv_tokens]
    expected[-1] = 0  # the last round finishes the request: everything is back
    assert held == expected
    assert max(held) == need
    assert len(engine.pop_output(rid)) == max_new


def occupancy_workload() -> tuple[list[list[int]], list[int], int]:
    """Two dozen short prompts whose answers end at an eos within a dozen tokens, asked with
    max_new_tokens=64: the reservation waste the PagedAttention paper set out to remove."""
    cfg = tiny_config(block_size=BS)
    rng = random.Random(7)
    prompts = [tokens(200 + i, rng.randrange(4, 12)) for i in range(24)]
    answers = reference_tokens(cfg, prompts, 13)
    eos = [answer[rng.randrange(5, 13)] for answer in answers]
    return prompts, eos, 64


def test_memory_on_demand_runs_several_requests_per_round(step) -> None:
    """In a 48-block pool, worst-case reservation could hold two of these requests at a time;
    allocating on demand the engine runs at least four per round on average, every token as
    the reference's (each request stops at its eos)."""
    prompts, eos, max_new = occupancy_workload()
    cfg = tiny_config(block_size=BS, total_blocks=48)
    reserved = min(blocks_for_request(len(p), max_new, BS) for p in prompts)
    assert cfg.total_blocks // reserved <= 2, "worst-case reservation would run two at most"
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=8)
    guard_against_hangs(engine)
    ids = [engine.add_request(p, max_new, e) for p, e in zip(prompts, eos)]
    while engine.has_work:
        engine.step()
    for rid, prompt, e in zip(ids, prompts, eos):
        assert engine.pop_output(rid) == reference_tokens(cfg, [prompt], max_new, e)[0]
    assert engine.stats.seqs_per_round >= 4
    assert engine.ref_count_problems() == []


# ---- EngineStats: exact block figures ------------------------------------------------------------


def test_blocks_used_counts_cached_blocks_that_requests_hold(make_engine: EngineFactory) -> None:
    """blocks_used is every block a running request holds, each once, cached or not.

    P leaves two cached blocks. Then Q and R, both behind P's two blocks, start together: each
    adopts the two shared blocks and allocates one of its own, so 2 + 1 + 1 blocks are in use,
    2 of them cached, and everything else is free."""
    engine = make_engine()
    total = CFG.total_blocks
    shared = tokens(500, 2 * BS)
    engine.generate([[*shared, 1]], 1)  # KV for 2 * BS + 1 tokens: 2 full blocks, cached
    assert (engine.stats.blocks_cached, engine.stats.blocks_used) == (2, 0)
    assert engine.stats.blocks_free == total - 2
    engine.reset_stats()
    q, r = [*shared, 2, 3], [*shared, 4, 5]
    ids = [engine.add_request(p, 4) for p in (q, r)]
    expected = [
        (4, 2),  # each adopts the 2 shared blocks and prefills its 2-token tail into its own
        (4, 2),  # decode at position 2 * BS + 2: the own block has 3 of its 4 slots
        (4, 4),  # decode at 2 * BS + 3: each own block is full and cached, still held
    ]
    for used, cached in expected:
        engine.step()
        stats = engine.stats
        assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (
            used,
            cached,
            total - used,
        )
    assert (engine.stats.requests_hit, engine.stats.cached_tokens) == (2, 4 * BS)
    run_rounds(engine)  # a fourth block each, partial, freed when they finish
    stats = engine.stats
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (0, 4, total - 4)
    assert [len(engine.pop_output(i)) for i in ids] == [4, 4]


def test_block_figures_at_rest_after_one_request(make_engine: EngineFactory) -> None:
    """After one request the cache holds every full block of its KV (prompt and output), the
    partial last block is free again, and free + cached = total."""
    for prompt_len, max_new in ((1, 1), (BS, 1), (BS, 2), (2 * BS + 3, 7)):
        engine = make_engine()
        engine.generate([tokens(510, prompt_len)], max_new)
        cached = (prompt_len + max_new - 1) // BS
        stats = engine.stats
        assert (stats.blocks_cached, stats.blocks_free, stats.blocks_used) == (
            cached,
            CFG.total_blocks - cached,
            0,
        )


# ---- memory pressure: many requests through a pool far smaller than their total need -------------
#
# Squeeze the pool down to the largest single request: every request still finishes with
# exactly the tokens of a roomy pool and of the dense reference, and no block leaks.

BLOCK_SIZE = 4
MAX_NEW = 4

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
