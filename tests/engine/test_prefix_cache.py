"""The block-granular prefix cache, observed through each step's engine, and on its own.

A cache hit replaces computation with shared KV, so every test here checks two things: that the
hit happened where the design says it must (full blocks, whole chains, LRU eviction), and that
the tokens are still exactly the dense reference's, i.e. that no hit ever served wrong KV. The
chain hash (``common.hashing``) is specified here too, and ``PrefixCache`` alone (insert,
match, evict) at the end.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common import hashing
from front.workload import demo_prompts, shared_prefix_prompts
from tests.helpers import (
    assert_engine_matches_reference,
    has_fix,
    random_shared_prefix_prompts,
    reference_tokens,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size
VOCAB = CFG.vocab_size
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    """One request's output and what the cache gave it."""

    output: list[int]
    cached_tokens: int
    hit: bool


def serve(engine, prompt: list[int], max_new_tokens: int = 3) -> Served:
    """Run one request alone and read its own counters (stats are reset first)."""
    engine.reset_stats()
    (output,) = engine.generate([prompt], max_new_tokens)
    stats = engine.stats
    assert stats.requests == 1
    assert stats.prompt_tokens == len(prompt)
    return Served(output, stats.cached_tokens, stats.requests_hit == 1)


def serve_all(engine, prompts: list[list[int]], max_new_tokens: int = 3) -> list[Served]:
    """Serve prompts one after another, and check every output against the reference."""
    served = [serve(engine, p, max_new_tokens) for p in prompts]
    expected = reference_tokens(engine.model.cfg, prompts, max_new_tokens)
    assert [s.output for s in served] == expected
    return served


def cached_block_ids(engine) -> list[int]:
    return [
        b
        for b in range(engine.kv_cache_manager.block_manager.total_blocks)
        if b in engine.kv_cache_manager.prefix_cache
    ]


def assert_at_rest(engine) -> None:
    """At rest every block is free or cached, and no request holds any."""
    stats = engine.stats
    assert (
        stats.blocks_free + stats.blocks_cached
        == engine.kv_cache_manager.block_manager.total_blocks
    )
    assert stats.blocks_used == 0


# ---- the chapter's demo -------------------------------------------------------------------------


def test_demo_cold_then_hot_round(make_engine) -> None:
    """The chapter's numbers: cold 9/10 (the first request stores the prefix), hot 10/10."""
    engine = make_engine(tiny_config(block_size=16))
    prompts = demo_prompts(engine.model.cfg.vocab_size, block_size=16)
    rounds = []
    for expected_hits in (9, 10):
        engine.reset_stats()
        rounds.append(assert_engine_matches_reference(engine, prompts, 4, serial=True))
        assert (engine.stats.requests, engine.stats.requests_hit) == (10, expected_hits)
    assert rounds[0] == rounds[1]
    assert_at_rest(engine)


# ---- where hits may happen ----------------------------------------------------------------------


def test_cached_tokens_are_whole_blocks(make_engine) -> None:
    """Only full blocks are cached, so a hit always covers a whole number of blocks."""
    engine = make_engine()
    prompts = random_shared_prefix_prompts(random.Random(0), VOCAB, max_prompts=10)
    prompts += prompts  # a hot pass, so that hits certainly occur
    served = serve_all(engine, prompts)
    assert any(s.hit for s in served)
    for prompt, s in zip(prompts, served):
        assert s.cached_tokens % BS == 0
        assert s.cached_tokens < len(prompt)  # the last prompt token is always computed
        assert s.hit == (s.cached_tokens > 0)


@pytest.mark.parametrize(("full_blocks", "extra"), [(1, 1), (2, BS - 1)])
def test_shared_partial_block_is_not_a_hit(make_engine, full_blocks: int, extra: int) -> None:
    """Two prompts agreeing on k full blocks plus part of the next: exactly k blocks hit."""
    shared = tokens(1, full_blocks * BS + extra)
    tail = tokens(2, 5)
    other_tail = [(tail[0] + 1) % VOCAB, *tail[1:]]
    first, second = serve_all(make_engine(), [shared + tail, shared + other_tail])
    assert first.cached_tokens == 0
    assert second.cached_tokens == full_blocks * BS


def test_same_block_after_a_different_prefix_misses(make_engine) -> None:
    """Chain hashing: a block's KV depends on everything before it, so identical block
    contents behind a different first block must not be reused."""
    head_a, head_c, middle = tokens(3, BS), tokens(4, BS), tokens(5, BS)
    prompts = [head_a + middle + [1], head_c + middle + [1], head_a + middle + [2]]
    _, other_head, same_head = serve_all(make_engine(), prompts)
    assert other_head.cached_tokens == 0 and not other_head.hit
    assert same_head.cached_tokens == 2 * BS  # the control: the middle block was cached
    hashes = [hashing.hash_prefix_blocks(p, BS) for p in prompts[:2]]
    assert hashes[0][1] != hashes[1][1]


def test_full_prompt_hit_recomputes_last_block(make_engine) -> None:
    """A prompt of whole blocks sent again hits all blocks but the last (its last token's
    logits are needed), gives the same tokens, and never writes a shared block."""
    engine = make_engine()
    prompt = tokens(6, 3 * BS)
    (cold,) = serve_all(engine, [prompt], max_new_tokens=6)
    shared = cached_block_ids(engine)
    assert len(shared) == (len(prompt) + 6 - 1) // BS  # prompt and output blocks alike
    kv_before = [pool[:, shared].clone() for pool in kv_pools(engine)]
    (hot,) = serve_all(engine, [prompt], max_new_tokens=6)
    assert (cold.cached_tokens, hot.cached_tokens) == (0, len(prompt) - BS)
    assert hot.output == cold.output
    for before, pool in zip(kv_before, kv_pools(engine)):
        assert torch.equal(pool[:, shared], before)


def kv_pools(engine) -> tuple[torch.Tensor, torch.Tensor]:
    return engine.model.kv_pool_k, engine.model.kv_pool_v


# ---- the hash -----------------------------------------------------------------------------------


def test_token_ids_above_255(make_engine) -> None:
    """``bytes(tokens)`` would fail (or wrap) above 255; the engine must serve and cache them."""
    prompt = tokens(7, 2 * BS + 1, low=256)
    first, second = serve_all(make_engine(), [prompt, prompt])
    assert (first.cached_tokens, second.cached_tokens) == (0, 2 * BS)
    wrapped = [t - 256 for t in prompt]
    assert hashing.hash_prefix_blocks(prompt, BS) != hashing.hash_prefix_blocks(wrapped, BS)
    assert hashing.hash_block(hashing.ROOT_HASH, [256]) != hashing.hash_block(
        hashing.ROOT_HASH, [0]
    )


HASH_INPUT = (987654321, [0, 255, 256, 511, 70000])


def test_hash_is_stable_across_processes() -> None:
    """Python's ``hash()`` of str/bytes is salted per process; the block hash must not be."""
    code = (
        "from common.hashing import hash_block\n"
        f"print(hash_block({HASH_INPUT[0]}, {HASH_INPUT[1]}))\n"
    )
    expected = hashing.hash_block(*HASH_INPUT)
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) == expected


COLLIDING_HASHES: dict[str, Callable[[int, list[int]], int]] = {
    "constant": lambda parent, token_ids: 7,
    "three values": lambda parent, token_ids: (parent + sum(token_ids)) % 3,
}


def collision_workload() -> list[list[int]]:
    """An unrelated prompt first (it claims the colliding hashes), then three prompts sharing
    a three-block prefix: without collisions the last two hit all three blocks."""
    prefix = tokens(8, 3 * BS)
    return [tokens(9, 3 * BS + 1)] + [prefix + tokens(10 + i, 2) for i in range(3)]


def cached_tokens_served(engine, prompts: list[list[int]]) -> int:
    return sum(s.cached_tokens for s in serve_all(engine, prompts))


@pytest.mark.parametrize("name", sorted(COLLIDING_HASHES))
def test_hash_collisions_cost_hits_not_correctness(
    make_engine, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every hit is verified against its tokens and parent, so a colliding hash can only
    lose hits; ``serve_all`` checks the tokens against the reference either way."""
    prompts = collision_workload()
    honest = cached_tokens_served(make_engine(), prompts)
    monkeypatch.setattr(hashing, "hash_block", COLLIDING_HASHES[name])
    colliding = cached_tokens_served(make_engine(), prompts)
    assert colliding < honest


# ---- eviction -----------------------------------------------------------------------------------

EVICTION_CFG = tiny_config(total_blocks=8)
CHAIN_A, CHAIN_B = tokens(11, 2 * BS + 1), tokens(12, 2 * BS + 1)  # 3 blocks, 2 of them cached


def cached_chain_length(engine, prompt: list[int]) -> int:
    """How many leading full blocks of ``prompt`` the cache holds, looked up without serving
    (serving could evict)."""
    return len(
        engine.kv_cache_manager.prefix_cache.match(hashing.hash_prefix_blocks(prompt, BS), prompt)
    )


def fill_pool(engine, evict: int) -> int:
    """An unrelated request with a long answer that needs ``evict`` blocks beyond the free
    pool. The blocks it fills are cached but held by it while it runs, so the cache loses
    exactly ``evict`` of the blocks it had. Returns how many blocks it left in the cache."""
    prompt = tokens(13, BS - 1)
    need = engine.stats.blocks_free + evict
    max_new_tokens = need * BS - len(prompt) + 1  # blocks for prompt + all but the last token
    serve_all(engine, [prompt], max_new_tokens)
    return need  # every block it used was full, and each continues its own cached chain


@pytest.mark.parametrize(
    ("history", "survivor", "evicted"),
    [
        pytest.param([CHAIN_A, CHAIN_B], CHAIN_B, CHAIN_A, id="A-then-B"),
        pytest.param([CHAIN_A, CHAIN_B, CHAIN_A], CHAIN_A, CHAIN_B, id="A-reused-last"),
    ],
)
def test_eviction_is_lru_and_tail_first(
    make_engine, history: list[list[int]], survivor: list[int], evicted: list[int]
) -> None:
    """Two cached 2-block chains, then a request that needs 3 more blocks than are free: the
    least recently used chain goes whole, then the other chain's tail; only its head is left."""
    engine = make_engine(EVICTION_CFG)
    serve_all(engine, history, max_new_tokens=1)
    assert engine.stats.blocks_cached == 4
    filled = fill_pool(engine, evict=3)
    assert (engine.stats.evictions, engine.stats.blocks_cached) == (3, 1 + filled)
    assert (cached_chain_length(engine, survivor), cached_chain_length(engine, evicted)) == (1, 0)
    head_only, gone = serve_all(engine, [survivor, evicted], max_new_tokens=1)
    assert (head_only.hit, head_only.cached_tokens) == (True, BS)
    assert (gone.hit, gone.cached_tokens) == (False, 0)
    assert_at_rest(engine)


def test_no_eviction_while_the_free_pool_lasts(make_engine) -> None:
    """Cached blocks are only taken back when the free pool cannot serve an allocation."""
    engine = make_engine(EVICTION_CFG)
    serve_all(engine, [CHAIN_A, CHAIN_B], max_new_tokens=1)
    filled = fill_pool(engine, evict=0)
    assert (engine.stats.evictions, engine.stats.blocks_cached) == (0, 4 + filled)
    assert cached_chain_length(engine, CHAIN_A) == cached_chain_length(engine, CHAIN_B) == 2


# ---- switches and counters ----------------------------------------------------------------------


def test_disabled_cache_never_hits(make_engine) -> None:
    """With the cache off the same tokens come out, and nothing stays behind at rest."""
    engine = make_engine(enable_prefix_cache=False)
    prompts = demo_prompts(VOCAB, block_size=BS)
    for _ in range(2):
        engine.reset_stats()
        assert_engine_matches_reference(engine, prompts, 3, serial=True)
        assert (engine.stats.requests, engine.stats.requests_hit) == (len(prompts), 0)
        assert engine.stats.cached_tokens == 0
    assert (engine.stats.blocks_cached, engine.stats.blocks_free) == (0, CFG.total_blocks)
    assert_at_rest(engine)


def test_block_stats_in_flight_and_at_rest(step, make_engine) -> None:
    """Exact block figures. Three requests behind a 2-block prefix, with 3-token tails, start
    together: in round one the first computes block 0, the second adopts it and computes block
    1, the third adopts both and prefills its tail into a block of its own; 3 blocks in use, 2
    of them cached. (From step14_9 on, the first computes its whole prompt, and the others adopt
    the prefix and prefill their tails: 5 blocks in use, 2 cached.) At rest each request has
    left its third block (tail + first output token, full) in the cache besides the shared two,
    and the partial fourth is free again."""
    engine = make_engine()
    total = engine.kv_cache_manager.block_manager.total_blocks
    prompts = shared_prefix_prompts(3, 2 * BS, 3, VOCAB)
    for prompt in prompts:
        engine.add_request(prompt, 4)
    engine.step()
    stats = engine.stats
    used = 5 if has_fix(step, "step14_9") else 3
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (used, 2, total - used)
    while engine.has_work:
        engine.step()
    stats = engine.stats
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (0, 5, total - 5)
    assert_at_rest(engine)


def test_prefix_shared_within_one_round(make_engine) -> None:
    """Requests prefilling together share a prefix nobody has cached yet: they leapfrog, each
    adopting the blocks the others computed, so every request but the first hits and the
    prefix is computed once. A hot round then hits every full prompt block."""
    engine = make_engine(max_running=4)
    prefix_blocks, tail = 2, 3
    prompts = shared_prefix_prompts(4, prefix_blocks * BS, tail, VOCAB, seed=1)
    assert_engine_matches_reference(engine, prompts, 4)
    stats = engine.stats
    assert stats.computed_prefill_tokens == prefix_blocks * BS + len(prompts) * tail
    assert stats.cached_tokens == (len(prompts) - 1) * prefix_blocks * BS
    engine.reset_stats()
    assert_engine_matches_reference(engine, prompts, 4)
    assert engine.stats.cached_tokens == len(prompts) * prefix_blocks * BS
    assert engine.stats.requests_hit == len(prompts)
    assert_at_rest(engine)


def test_same_block_behind_two_prefixes_is_cached_once_per_chain(make_engine) -> None:
    """A block's hash names its whole prefix: the same tokens behind two different first blocks
    are two cache entries, and each chain's next request adopts its own (two blocks each)."""
    head_a, head_c, middle = tokens(14, BS), tokens(15, BS), tokens(16, BS)
    engine = make_engine()
    first = serve_all(engine, [head_a + middle + [1], head_c + middle + [2]])
    assert [s.cached_tokens for s in first] == [0, 0]
    assert engine.stats.blocks_cached == 4
    again = serve_all(engine, [head_c + middle + [3], head_a + middle + [4]])
    assert [s.cached_tokens for s in again] == [2 * BS, 2 * BS]


def test_chain_hash_is_each_block_hashed_with_its_parent() -> None:
    """h_i = H(h_{i-1}, tokens of block i) from ROOT_HASH; a trailing partial block has none."""
    ids = tokens(17, 3 * BS - 1)
    h0 = hashing.hash_block(hashing.ROOT_HASH, ids[:BS])
    h1 = hashing.hash_block(h0, ids[BS : 2 * BS])
    assert hashing.hash_prefix_blocks(ids, BS) == [h0, h1]
    assert hashing.hash_prefix_blocks(ids[: BS - 1], BS) == []
    assert h1 != hashing.hash_block(hashing.ROOT_HASH, ids[BS : 2 * BS])


# ---- PrefixCache on its own -----------------------------------------------------------------


def cache_alone(step, total_blocks: int = 8):
    block_manager = step.BlockManager(total_blocks)
    return block_manager, step.PrefixCache(block_manager, BS)


def cache_chain(block_manager, cache, token_ids: list[int]) -> list[int]:
    """Cache the full blocks of ``token_ids`` as one chain, the way a request does (allocate,
    insert each block behind the one before), then let the request go (``free``, then ``touch``
    tail first, as ``KVCacheManager.free`` does): ref_count 1 each, all evictable."""
    hashes = hashing.hash_prefix_blocks(token_ids, BS)
    ids = block_manager.allocate(len(hashes))
    parent = None
    for i, (block_hash, block_id) in enumerate(zip(hashes, ids)):
        assert cache.insert(block_hash, block_id, token_ids[i * BS : (i + 1) * BS], parent)
        parent = block_id
    block_manager.free(ids)
    cache.update_eviction_queue(ids[::-1])
    return ids


def cached(cache, total_blocks: int = 8) -> set[int]:
    return {b for b in range(total_blocks) if b in cache}


def evict_one_by_one(block_manager, cache, n: int) -> list[int]:
    """Evict ``n`` blocks one call at a time; returns them in eviction order."""
    order = []
    for _ in range(n):
        before, free_before = cached(cache), block_manager.num_free
        cache.evict(1)
        (gone,) = before - cached(cache)
        assert block_manager.ref_count(gone) == 0
        assert block_manager.num_free == free_before + 1
        order.append(gone)
    return order


def test_evict_goes_tail_first_and_never_strands_a_block(step) -> None:
    """A chain let go of tail first loses its tail first. Let go of head first (which no
    request does: it holds the chain before each block it holds), the head would be the least
    recently used block: eviction refuses rather than strand its children, and changes
    nothing."""
    block_manager, cache = cache_alone(step)
    chain = cache_chain(block_manager, cache, tokens(20, 3 * BS))
    cache.update_eviction_queue(chain)  # head first: the head is now least recently used
    with pytest.raises(RuntimeError, match="children"):
        cache.evict(1)
    assert (len(cache), cache.num_evictable, cache.num_evictions) == (3, 3, 0)
    cache.update_eviction_queue(chain[::-1])
    assert evict_one_by_one(block_manager, cache, 3) == chain[::-1]
    assert cache.num_evictions == 3 and len(cache) == 0


def test_evict_is_least_recently_used_first_among_leaves(step) -> None:
    """Two chains; the one touched last survives longest, whatever order they were cached in."""
    block_manager, cache = cache_alone(step)
    chain_a = cache_chain(block_manager, cache, tokens(21, 2 * BS))
    chain_b = cache_chain(block_manager, cache, tokens(22, 2 * BS))
    cache.update_eviction_queue(chain_a[::-1])  # A used after B
    assert evict_one_by_one(block_manager, cache, 4) == chain_b[::-1] + chain_a[::-1]


def test_evict_skips_blocks_a_request_holds_and_refuses_when_none_is_left(step) -> None:
    """Only cache-only blocks (ref_count 1) are evictable; asking for more raises, after
    evicting what it could."""
    block_manager, cache = cache_alone(step)
    held = cache_chain(block_manager, cache, tokens(23, BS))
    loose = cache_chain(block_manager, cache, tokens(24, 2 * BS))
    block_manager.retain(held[0])  # a request adopts it (KVCacheManager.allocate_slots)...
    assert cache.num_evictable == 3
    cache.update_eviction_queue(
        held
    )  # ...and tells the cache: the oldest block, but a request holds it
    assert cache.num_evictable == 2
    cache.update_eviction_queue(loose[::-1])
    assert evict_one_by_one(block_manager, cache, 2) == loose[::-1]
    assert cache.num_evictable == 0
    with pytest.raises(RuntimeError):
        cache.evict(1)
    assert cached(cache) == set(held) and block_manager.ref_count(held[0]) == 2


def test_insert_takes_a_reference_and_the_first_block_under_a_hash_wins(step) -> None:
    """insert retains the block (the cache is an owner); a second block under a cached hash, a
    cached block under a second hash, and a block behind an uncached parent are all refused,
    and a refused insert takes no reference."""
    block_manager, cache = cache_alone(step)
    ids = tokens(25, 2 * BS)
    h0, h1 = hashing.hash_prefix_blocks(ids, BS)
    a, b, c = block_manager.allocate(3)
    assert cache.insert(h0, a, ids[:BS], None)
    assert (block_manager.ref_count(a), len(cache), a in cache) == (2, 1, True)
    assert not cache.insert(h0, b, ids[:BS], None)  # the hash is taken: b stays private
    assert not cache.insert(h1, a, ids[BS:], a)  # a is cached already
    assert not cache.insert(h1, b, ids[BS:], c)  # c, its parent, is not cached
    assert [block_manager.ref_count(x) for x in (a, b, c)] == [2, 1, 1]
    assert cached(cache) == {a}
    assert cache.insert(h1, b, ids[BS:], a)
    assert cached(cache) == {a, b} and block_manager.ref_count(b) == 2


def test_match_verifies_tokens_and_parent(step) -> None:
    """A hit must carry the caller's tokens and continue the caller's chain: a mismatch in
    either stops the match there (a colliding hash costs a hit, never correctness)."""
    block_manager, cache = cache_alone(step)
    ids = tokens(26, 3 * BS)
    chain = cache_chain(block_manager, cache, ids)
    hashes = hashing.hash_prefix_blocks(ids, BS)
    assert cache.match(hashes, ids) == chain
    assert cache.match(hashes[1:], ids[BS:], parent_id=chain[0]) == chain[1:]
    assert cache.match(hashes[1:], ids[BS:], parent_id=None) == []  # not the chain's start
    assert cache.match(hashes[1:], ids[BS:], parent_id=chain[1]) == []  # wrong parent
    forged = [*ids[: BS + 1], (ids[BS + 1] + 1) % VOCAB, *ids[BS + 2 :]]
    assert cache.match(hashes, forged) == chain[:1]  # block 1's tokens differ: stop there
    assert cache.match([hashes[0] ^ 1, *hashes[1:]], ids) == []  # unknown hash: stop at once
    assert all(block_manager.ref_count(b) == 1 for b in chain)  # a lookup takes nothing


def test_a_hit_must_continue_the_callers_chain(
    make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash that forgets the parent (a collision of the worst kind) names block M the same
    behind A and behind C. A lookup for C+M finds the entry for M cached behind A, with the
    right tokens: only the parent check stops it from splicing A's KV behind C."""
    monkeypatch.setattr(hashing, "hash_block", lambda parent, token_ids: hash(tuple(token_ids)))
    head_a, head_c, middle = tokens(27, BS), tokens(28, BS), tokens(29, BS)
    engine = make_engine()
    served = serve_all(engine, [head_a + middle + [1], [*head_c, 2], head_c + middle + [3]])
    assert [s.cached_tokens for s in served] == [0, 0, BS]  # C hits, M behind C does not
