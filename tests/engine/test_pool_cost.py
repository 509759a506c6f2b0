"""The block pool's cost grows with the work, never with the pool or the cache.

Every block operation (allocate, free, adopt, cache, evict, count the available blocks) must
cost the same in a cache of 1,000 blocks and in one of 50,000, in every step, as in vLLM's
``BlockPool``. Not timed (timings flake on a shared machine): counted. ``lines_run`` counts the
lines of Python a call executes, in every function it enters, so a loop over the cache, even
one hidden in a generator or a helper, runs its body once per cached block and shows up as a
count that grows with the cache. Each operation must execute exactly as many lines in the big
cache as in the small one. (A loop done entirely in C, such as ``list(cache)``, is the one thing
this cannot see.) ``python -m bench --workload scale`` shows the same thing in seconds.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from bench.workloads.scale import FILLER_CHAIN, FILLER_TOKEN, fill_cache
from tests.helpers import tiny_config

SMALL, LARGE = 1_000, 50_000  # cached blocks
BS = 4


def lines_run(call: Callable[[], object]) -> int:
    """The lines of Python that ``call()`` executes, counted in every frame it opens."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += event == "line"
        return trace

    gc.disable()  # no collection in the middle: the finalizers it ran would count as the call's
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
        gc.enable()
    return count


def filled_manager(step: ModuleType, cached: int):
    """A KV cache manager with an empty free pool and ``cached`` blocks in its cache: the older
    half held by requests still running, the newer half held by the cache alone. A search of
    the cache in least recently used order for a block to evict would pass the whole held half
    first."""
    manager = step.KVCacheManager(cached, BS, enable_prefix_cache=True)
    fill_cache(step, manager, cached // 2, hold=True)  # bench/workloads/scale.py: as requests do
    fill_cache(step, manager, cached - cached // 2)
    assert (len(manager.prefix_cache), manager.block_manager.num_free) == (cached, 0)
    assert manager.num_available_blocks == cached - cached // 2
    return manager


def request(step: ModuleType, seq_id: int, tokens: list[int]):
    return step.Sequence(seq_id, tokens, 2)


def operations(step: ModuleType, manager) -> dict[str, Callable[[], object]]:
    """One call of each block operation, in an order that leaves each one real work: the free
    pool is empty, so the first allocation evicts; the adopted chain sits in the middle of the
    eviction queue; freeing it puts it back at the tail."""
    cache = manager.prefix_cache
    fresh = request(step, 10**7, [7] * (BS + 1))
    middle = (len(cache) // FILLER_CHAIN) * 3 // 4  # a chain halfway down the eviction queue
    adopter = request(step, 10**7 + 1, [FILLER_TOKEN + middle] * (FILLER_CHAIN * BS) + [7])
    hits: list[int] = []

    def adopt() -> None:
        hits.extend(manager.get_computed_blocks(adopter))
        assert len(hits) == FILLER_CHAIN
        assert manager.allocate_slots(adopter, FILLER_CHAIN * BS + 1, hits)

    return {
        "num_available_blocks": lambda: manager.num_available_blocks,
        "pool_figures": manager.pool_figures,
        "allocate_slots (evicts)": lambda: manager.allocate_slots(fresh, BS + 1),
        "cache_blocks": lambda: manager.cache_blocks(fresh, BS),
        "adopt a cached chain": adopt,
        "free": lambda: manager.free(adopter),
        "evict": lambda: cache.evict(1),
        "free the first request": lambda: manager.free(fresh),
    }


def lines_per_operation(step: ModuleType, cached: int) -> dict[str, int]:
    manager = filled_manager(step, cached)
    counts = {name: lines_run(call) for name, call in operations(step, manager).items()}
    assert manager.prefix_cache.num_evictions == 4  # 2 + 1 for allocations, 1 on its own
    return counts


def test_every_block_operation_costs_the_same_in_a_small_and_a_large_cache(step) -> None:
    """Allocation with eviction, caching a block, adopting a chain from the middle of the
    eviction queue, freeing, evicting and counting: the same lines with 50,000 cached blocks as
    with 1,000."""
    lines_per_operation(step, SMALL)  # a first call pays one-time costs (imports, ABC caches)
    small = lines_per_operation(step, SMALL)
    assert all(small.values())
    assert lines_per_operation(step, LARGE) == small


def old_num_evictable(manager) -> int:
    """How ``num_evictable`` used to count: every block, one ``ref_count`` at a time."""
    bm, cache = manager.block_manager, manager.prefix_cache
    return sum(1 for b in range(bm.total_blocks) if b in cache and bm.ref_count(b) == 1)


def test_a_scan_would_be_caught(step) -> None:
    """The control: a loop over the pool runs its body once per block, so ``lines_run`` grows
    with the cache."""
    counts = []
    for cached in (SMALL, 2 * SMALL):
        manager = filled_manager(step, cached)
        assert old_num_evictable(manager) == manager.num_available_blocks
        counts.append(lines_run(lambda m=manager: old_num_evictable(m)))
    assert counts[1] - counts[0] >= SMALL


def serve_one(step: ModuleType, cached: int) -> int:
    """The lines an engine runs to serve one request, from ``add_request`` to its output,
    while its cache holds ``cached`` blocks no request uses and its free pool is two blocks
    short of what the request needs (so it evicts)."""
    prompt = [1, 2, 3, 4, 5, 6]
    cfg = tiny_config(num_layers=1, dtype=torch.float32, total_blocks=cached + 1)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=4)
    fill_cache(step, engine.kv_cache_manager, cached)

    def serve() -> None:
        rid = engine.add_request(prompt, 4)
        while engine.has_work:
            engine.step()
        engine.pop_output(rid)
        assert engine.stats.evictions == 2

    with torch.inference_mode():
        return lines_run(serve)


def test_serving_a_request_costs_the_same_in_a_small_and_a_large_cache(step) -> None:
    """The whole engine: admission, rounds, allocation with eviction, caching, finishing and
    the stats run the same lines whether the cache holds 1,000 blocks or 50,000."""
    serve_one(step, SMALL)  # a first call pays one-time costs (imports, ABC caches)
    assert serve_one(step, LARGE) == serve_one(step, SMALL)
