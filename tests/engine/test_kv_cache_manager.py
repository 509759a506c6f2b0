"""KVCacheManager: every memory operation of the engine, called directly, as the engine does.

The specification of its four moments of a sequence's life (vLLM's names):
``get_computed_blocks`` is a lookup only: the cached chain that continues the sequence's block
table, never the block of the last prompt token, and nothing with the cache off;
``allocate_slots`` adopts those blocks (one more owner each, zero copy) and then takes fresh
blocks for what is still missing, evicting only the shortfall; ``cache_blocks`` names a block
by its chain hash once it is full, prompt or output, and not before; ``free`` drops every
reference the sequence holds, the blocks the cache holds stay cached, and a finished request's
blocks become the most recently used, tail first (so a chain loses its tail first).
"""

from __future__ import annotations

from types import ModuleType

from common import hashing
from tests.helpers import EngineFactory, tiny_config, tokens

CFG = tiny_config()
BS = CFG.block_size


def manager_with_chain(step: ModuleType, total_blocks: int = 16, num_blocks: int = 3):
    """A manager whose cache holds one chain of ``num_blocks`` full blocks, left by a finished
    request of ``num_blocks * BS + 1`` tokens (its partial last block went back to the pool).
    Returns the manager, the chain's prompt and its block ids, head first."""
    manager = step.KVCacheManager(total_blocks, BS, enable_prefix_cache=True)
    prompt = tokens(700, num_blocks * BS + 1)
    seq = step.Sequence(0, prompt, max_new_tokens=1)
    manager.allocate_slots(seq, len(prompt))
    for n in range(1, len(prompt) + 1):  # as prefill and decode fill the blocks
        manager.cache_blocks(seq, n)
    chain = seq.block_table[:num_blocks]
    manager.free(seq)
    return manager, prompt, chain


def ref_counts(manager, block_ids: list[int]) -> list[int]:
    return [manager.block_manager.ref_count(b) for b in block_ids]


# ---- get_computed_blocks: a lookup ----------------------------------------------------------


def test_get_computed_blocks_is_the_cached_chain_that_continues_the_table(
    step: ModuleType,
) -> None:
    manager, prompt, chain = manager_with_chain(step)
    assert ref_counts(manager, chain) == [1, 1, 1]  # the cache's own reference
    follow_up = step.Sequence(1, [*prompt[: 3 * BS], 5, 6], max_new_tokens=2)
    assert manager.get_computed_blocks(follow_up) == chain
    assert ref_counts(manager, chain) == [1, 1, 1]  # a lookup takes nothing
    # a prompt of exactly the chain: its last block holds the last prompt token, recomputed
    whole = step.Sequence(2, prompt[: 3 * BS], max_new_tokens=2)
    assert manager.get_computed_blocks(whole) == chain[:2]
    # later in prefill, the lookup continues the block table: only the blocks after it
    manager.allocate_slots(follow_up, BS, chain[:1])
    assert manager.get_computed_blocks(follow_up) == chain[1:]
    other = step.Sequence(3, [*tokens(701, BS), *prompt[BS : 3 * BS], 5], max_new_tokens=2)
    assert manager.get_computed_blocks(other) == []  # same blocks behind another head
    manager.free(follow_up)


def test_get_computed_blocks_with_the_cache_off_finds_nothing(step: ModuleType) -> None:
    manager = step.KVCacheManager(16, BS, enable_prefix_cache=False)
    prompt = tokens(702, 2 * BS + 1)
    first = step.Sequence(0, prompt, max_new_tokens=1)
    manager.allocate_slots(first, len(prompt))
    for n in range(1, len(prompt) + 1):
        manager.cache_blocks(first, n)
    manager.free(first)
    assert manager.prefix_cache is None
    assert manager.get_computed_blocks(step.Sequence(1, prompt, max_new_tokens=1)) == []
    assert manager.block_manager.num_free == 16


# ---- allocate_slots: adopt, then allocate what is missing -----------------------------------


def test_allocate_slots_adopts_then_allocates_only_what_is_missing(step: ModuleType) -> None:
    manager, prompt, chain = manager_with_chain(step)
    bm = manager.block_manager
    seq = step.Sequence(1, [*prompt[: 3 * BS], 5, 6], max_new_tokens=BS + 2)
    free_before = bm.num_free
    manager.allocate_slots(seq, 3 * BS + 2, manager.get_computed_blocks(seq))
    (own,) = seq.block_table[3:]
    assert seq.block_table[:3] == chain and seq.hit_block_ids == chain  # zero copy
    assert ref_counts(manager, chain) == [2, 2, 2]  # the cache and this sequence
    assert (bm.ref_count(own), bm.num_free) == (1, free_before - 1)
    manager.allocate_slots(seq, 4 * BS)  # still within its last block: nothing new
    assert (len(seq.block_table), bm.num_free) == (4, free_before - 1)
    manager.allocate_slots(seq, 4 * BS + 1)  # one token into a fifth block
    assert (len(seq.block_table), bm.num_free) == (5, free_before - 2)
    assert seq.hit_block_ids == chain
    manager.free(seq)


def test_allocate_slots_evicts_only_the_shortfall(step: ModuleType) -> None:
    """A pool of 4 with one free block and a 3-block chain cached: a sequence that needs 2
    blocks takes the free one and evicts one cached block, the chain's tail."""
    manager, prompt, chain = manager_with_chain(step, total_blocks=4)
    cache = manager.prefix_cache
    assert (manager.block_manager.num_free, len(cache)) == (1, 3)
    seq = step.Sequence(1, tokens(703, 2 * BS), max_new_tokens=1)
    manager.allocate_slots(seq, 2 * BS)
    assert (cache.num_evictions, len(cache), manager.block_manager.num_free) == (1, 2, 0)
    assert cache.match(hashing.hash_prefix_blocks(prompt, BS), prompt) == chain[:2]
    manager.free(seq)


# ---- cache_blocks: a block is named once it is full -----------------------------------------


def test_cache_blocks_names_a_block_once_it_is_full(step: ModuleType) -> None:
    manager = step.KVCacheManager(16, BS, enable_prefix_cache=True)
    cache = manager.prefix_cache
    prompt = tokens(704, 2 * BS + 1)
    seq = step.Sequence(0, prompt, max_new_tokens=BS)
    manager.allocate_slots(seq, len(prompt))
    table = list(seq.block_table)
    manager.cache_blocks(seq, BS - 1)
    assert len(cache) == 0  # block 0 is not full yet
    manager.cache_blocks(seq, BS)
    manager.cache_blocks(seq, 2 * BS)
    manager.cache_blocks(seq, 2 * BS + 1)  # block 2 has one token of BS: not named
    hashes = hashing.hash_prefix_blocks(prompt, BS)
    assert len(cache) == 2 and cache.match(hashes, prompt) == table[:2]
    assert ref_counts(manager, table) == [2, 2, 1]  # the cache holds what it names
    for t in tokens(705, BS - 1):  # output tokens fill block 2: the chain runs on through them
        seq.generated_ids.append(t)
    manager.allocate_slots(seq, 3 * BS)
    manager.cache_blocks(seq, 3 * BS)
    hashes = hashing.hash_prefix_blocks(seq.token_ids, BS)
    assert cache.match(hashes, seq.token_ids) == table
    manager.free(seq)
    assert ref_counts(manager, table) == [1, 1, 1]


# ---- free: every reference back ---------------------------------------------------------------


def test_free_drops_every_reference_and_keeps_the_cached_blocks(step: ModuleType) -> None:
    """Adopted blocks go back to the cache alone, an own block the cache took stays cached, an
    own partial block returns to the free pool, and the sequence holds nothing."""
    manager, prompt, chain = manager_with_chain(step, num_blocks=2)
    bm, total = manager.block_manager, manager.block_manager.total_blocks
    seq = step.Sequence(1, [*prompt[: 2 * BS], *tokens(706, BS + 1)], max_new_tokens=1)
    manager.allocate_slots(seq, seq.prompt_len, manager.get_computed_blocks(seq))
    manager.cache_blocks(seq, 3 * BS)
    own_full, own_partial = seq.block_table[2:]
    assert ref_counts(manager, [*chain, own_full, own_partial]) == [2, 2, 2, 1]
    manager.free(seq)
    assert seq.block_table == []
    assert ref_counts(manager, [*chain, own_full, own_partial]) == [1, 1, 1, 0]
    assert bm.num_free + len(manager.prefix_cache) == total


def test_finished_request_files_its_blocks_tail_first(make_engine: EngineFactory) -> None:
    """``free`` (the chapter's ``_free_seq``) marks a finished request's blocks most recently used
    tail first, so that in LRU order a chain's tail comes before its head (evicted first),
    whatever PrefixCache.evict does on its own."""
    engine = make_engine()
    touched: list[list[int]] = []
    real = engine.kv_cache_manager.prefix_cache.update_eviction_queue

    def update_eviction_queue(block_ids):
        touched.append(list(block_ids))
        return real(block_ids)

    engine.kv_cache_manager.prefix_cache.update_eviction_queue = update_eviction_queue
    prompt = tokens(530, 3 * BS + 2)
    engine.generate([prompt], BS)
    chain = engine.kv_cache_manager.prefix_cache.match(
        hashing.hash_prefix_blocks(prompt, BS), prompt
    )
    assert len(chain) == 3
    assert [b for call in touched for b in call if b in chain] == chain[::-1]
