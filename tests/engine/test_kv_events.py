"""KV cache events (``enable_kv_cache_events=True``, ``engine.take_events()``), as vLLM has them.

A consumer that replays the stream (``common.kv_events.replay``) must hold exactly what the
prefix cache holds, hash -> (parent hash, token ids), after every round: through random
scenarios with tight pools (evictions, preemptions), aborts and ``reset_prefix_cache``. Every
step emits the same stream on the same requests, round for round, up to step14_8; step14_9's
longer chunks store blocks in fewer rounds (its own stream is checked by the replay alone).
With events off, nothing is recorded at all. Every block event names its ``medium``: the
engine's pool is ``"GPU"``, as vLLM's ``BlockPool`` names it on every build (its CPU build
too); a second tier's events name their own, and ``replay`` keeps one medium apart.
``replay`` also reads vLLM's own shape of a ``BlockStored``, several blocks in one event, each
chained to the block before it.
"""

from __future__ import annotations

import contextlib
import random
from functools import cache
from types import ModuleType

import pytest

from common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    replay,
)
from front.steps import load_step
from tests.helpers import (
    STEP_NAMES,
    guard_against_hangs,
    has_fix,
    random_shared_prefix_prompts,
    tiny_config,
)

SEEDS = range(20)
BS = 4


def cache_content(engine) -> dict:
    """The prefix cache's content, read from its internals: hash -> (parent hash, tokens)."""
    pc = engine.kv_cache_manager.prefix_cache
    assert {e.block_id for e in pc._by_hash.values()} == set(pc._by_block)
    return {
        e.block_hash: (
            pc._by_block[e.parent_id].block_hash if e.parent_id is not None else None,
            tuple(e.token_ids),
        )
        for e in pc._by_hash.values()
    }


def scenario(step: ModuleType, seed: int) -> tuple[list[list], list[list[int]], object]:
    """Requests arriving over the first rounds of a random engine (often a pool barely larger
    than the longest request), some aborted on the way; at rest a reset of the cache, sometimes,
    and a second wave that reuses the prompts. After every round and every abort or reset, the
    replayed stream must equal the cache. Returns the events (one list per moment), the
    outputs and the stats."""
    rng = random.Random(seed)
    prompts = random_shared_prefix_prompts(rng, 512, max_prompts=8, max_prefix=24, max_tail=9)
    max_new = rng.randint(1, 9)
    need = max(-(-(len(p) + max_new - 1) // BS) for p in prompts)
    total = rng.choice([need, need + 1, need + 2, 2 * need, 64])
    cfg = tiny_config(block_size=BS, total_blocks=total)
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(cfg),
        max_running=rng.randint(1, 5),
        enable_kv_cache_events=True,
    )
    guard_against_hangs(engine)
    content: dict = {}
    stream: list[list] = []
    outputs: list[list[int]] = []

    def check() -> None:
        events = engine.take_events()
        stream.append(events)
        replay(events, content)
        assert content == cache_content(engine), f"after moment {len(stream)}"

    for wave in range(2):
        arrivals = sorted((rng.randint(0, 5), p) for p in prompts)
        aborts = {rng.randint(0, 12): rng.randrange(len(prompts)) for _ in range(rng.randint(0, 2))}
        ids, round_ = [], 0
        while arrivals or engine.has_work:
            while arrivals and arrivals[0][0] <= round_:
                ids.append(engine.add_request(arrivals.pop(0)[1], max_new))
            if round_ in aborts and aborts[round_] < len(ids):
                with contextlib.suppress(KeyError):  # unless it has finished already
                    engine.abort(ids[aborts[round_]])
                    outputs.append(["aborted"])
                check()
            if rng.random() < 0.1:
                assert not engine.reset_prefix_cache() or not engine.scheduler.running
                check()
            engine.step()
            check()
            round_ += 1
        for request_id in ids:
            try:
                outputs.append(engine.pop_output(request_id))
            except KeyError:
                outputs.append([])  # aborted
        assert engine.ref_count_problems() == []
        if wave == 0 and rng.random() < 0.5:
            assert engine.reset_prefix_cache()
            check()
            assert content == {}
    return stream, outputs, engine.stats


@cache
def first_step_scenario(seed: int) -> tuple[list[list], list[list[int]], object]:
    return scenario(load_step(STEP_NAMES[0]), seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_replaying_the_events_rebuilds_the_cache(step: ModuleType, seed: int) -> None:
    stream, outputs, stats = scenario(step, seed)
    removed = sum(
        len(e.block_hashes) for moment in stream for e in moment if type(e) is BlockRemoved
    )
    assert removed == stats.evictions, "every eviction is one BlockRemoved hash, and only those"
    if not has_fix(step, "step14_9"):  # its rounds differ; the replay above holds it
        assert (stream, outputs, stats) == first_step_scenario(seed), "every step, the same stream"


def test_the_scenarios_reach_every_event_and_preemption() -> None:
    kinds, preemptions, evictions, aborts = set(), 0, 0, 0
    for seed in SEEDS:
        stream, outputs, stats = first_step_scenario(seed)
        kinds |= {type(e) for moment in stream for e in moment}
        preemptions += stats.preemptions
        evictions += stats.evictions
        aborts += outputs.count(["aborted"])
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    assert preemptions > 0 and evictions > 0 and aborts > 0


def test_an_eviction_and_a_reset_in_order(step: ModuleType) -> None:
    """Two blocks of 4 cached, then a pool too small for both them and a new request: the
    cache gives up the tail of the chain first; then a reset clears everything."""
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(tiny_config(block_size=BS, total_blocks=4)),
        enable_kv_cache_events=True,
    )
    engine.generate([list(range(1, 10))], max_new_tokens=1)  # caches blocks 1-4 and 5-8
    stored = engine.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    first, second = stored
    assert first.parent_block_hash is None and first.token_ids == [1, 2, 3, 4]
    assert second.parent_block_hash == first.block_hashes[0] and second.token_ids == [5, 6, 7, 8]
    assert first.block_size == BS and first.medium == second.medium == MEDIUM_GPU
    engine.generate([list(range(20, 30))], max_new_tokens=2)  # needs 3 of the 4 blocks
    removed = [e for e in engine.take_events() if type(e) is BlockRemoved]
    assert removed == [BlockRemoved(second.block_hashes, MEDIUM_GPU)]  # the chain's tail first
    assert engine.reset_prefix_cache()
    assert engine.take_events()[-1] == AllBlocksCleared()
    assert engine.take_events() == []  # taken once


def test_with_events_off_nothing_is_recorded(step: ModuleType) -> None:
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(tiny_config(block_size=BS, total_blocks=8))
    )
    engine.generate([list(range(1, 14)), list(range(1, 12))], max_new_tokens=6)
    engine.generate([list(range(30, 45))], max_new_tokens=4)  # evicts
    assert engine.stats.evictions > 0
    assert engine.reset_prefix_cache()
    assert engine.take_events() == []
    assert engine.kv_events.events == []  # the log was never attached


def test_with_the_prefix_cache_off_there_is_nothing_to_report(step: ModuleType) -> None:
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(tiny_config(block_size=BS)),
        enable_prefix_cache=False,
        enable_kv_cache_events=True,
    )
    engine.generate([list(range(1, 14))] * 2, max_new_tokens=6)
    assert engine.reset_prefix_cache()
    assert engine.take_events() == []


# ---- replay on its own: vLLM's events of several blocks ------------------------------------------


def test_a_stored_event_of_several_blocks_chains_each_to_the_one_before() -> None:
    """vLLM stores a chain of blocks in one ``BlockStored``: ``block_hashes=[h1, h2, h3]``, one
    ``parent_block_hash`` (the block before h1, None for a root) and the tokens of all three.
    Replaying it chains h1 to that parent, h2 to h1 and h3 to h2, each with its own
    ``block_size`` tokens: the same content as the blocks stored one event each (the shape
    this engine emits), and not every block hung on the event's parent."""
    tokens = list(range(100, 128))  # seven blocks of 4
    block = [tuple(tokens[i : i + BS]) for i in range(0, len(tokens), BS)]
    root = BlockStored([1, 2], None, tokens[: 2 * BS], BS)  # a root chain of two
    chain = BlockStored([3, 4, 5], 2, tokens[2 * BS : 5 * BS], BS)
    branch = BlockStored([6, 7], 3, tokens[5 * BS :], BS)  # a second child of block 3
    expected = {
        1: (None, block[0]),
        2: (1, block[1]),
        3: (2, block[2]),
        4: (3, block[3]),
        5: (4, block[4]),
        6: (3, block[5]),
        7: (6, block[6]),
    }
    assert replay([root, chain, branch]) == expected
    one_each = [
        BlockStored([h], parent, list(block[h - 1]), BS) for h, (parent, _) in expected.items()
    ]
    assert replay(one_each) == expected


# ---- medium: where a block lives -------------------------------------------------------------


def test_a_second_tiers_events_name_their_medium_and_replay_keeps_them_apart() -> None:
    """The pool's events say ``"GPU"`` (vLLM's name for the engine's own pool, on its CPU
    build too); ``stored_in`` and ``removed_from`` write a second tier's, with its medium. A
    block can live in both: leaving the pool does not take it out of the host tier, and
    replaying one medium rebuilds that tier alone (an event without a medium counts as the
    pool's, as routers read it)."""
    log = KVEventLog(BS)
    log.block_stored(1, None, (1, 2, 3, 4))
    log.stored_in(MEDIUM_CPU, 1, None, (1, 2, 3, 4))  # offloaded: in both
    log.block_stored(2, 1, (5, 6, 7, 8))
    log.block_removed(1)  # evicted from the pool, still in host memory
    log.removed_from(MEDIUM_CPU, 2)  # never stored there: not the pool's business
    events = log.take()
    assert events == [
        BlockStored([1], None, [1, 2, 3, 4], BS, medium="GPU"),
        BlockStored([1], None, [1, 2, 3, 4], BS, medium="CPU"),
        BlockStored([2], 1, [5, 6, 7, 8], BS, medium="GPU"),
        BlockRemoved([1], "GPU"),
        BlockRemoved([2], "CPU"),
    ]
    assert replay(events[:4]) == {2: (1, (5, 6, 7, 8))}  # the pool, MEDIUM_GPU by default
    assert replay(events[:4], medium=MEDIUM_CPU) == {1: (None, (1, 2, 3, 4))}
    unnamed = [BlockStored([3], None, [9, 9, 9, 9], BS)]  # medium None: the pool's
    assert replay(unnamed) == {3: (None, (9, 9, 9, 9))} and replay(unnamed, medium="CPU") == {}
    assert KVEventLog(BS, medium="CPU").medium == "CPU" and log.medium == MEDIUM_GPU
