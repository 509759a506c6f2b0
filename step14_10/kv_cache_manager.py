"""KVCacheManager: every memory operation of the engine, over the block pool and prefix cache.

The engine owns it and calls it at four moments of a sequence's life, with vLLM's names:

- ``get_computed_blocks`` before a prefill chunk: which of its next blocks the cache holds;
- ``allocate_slots`` when a chunk or a decode token needs room: adopt those blocks, and take
  fresh ones for the rest only now (memory on demand). When the pool cannot give them, it says
  so and changes nothing: the engine then preempts a sequence, or lets a new one wait;
- ``cache_blocks`` once a block is full: name it by its chain hash so others can adopt it;
- ``free`` when the sequence finishes, is aborted or is preempted: one reference fewer on every
  block it held (full blocks stay in the cache, so a preempted sequence finds them again).

This step adds a second tier behind the pool (``common/kv_offload.py``), the OS analogy's swap:
every block the cache takes is also written to it (``write_through``, once the round's forward
has filled it), and a lookup whose chain of pool hits ends goes on in the tier, loading what
it finds into the pool (``_swap_in``): an evicted prefix comes back as a copy, not a
recomputation.

The scheduler never calls it: the chapter's rule is that scheduling does no memory operation.
Each of these moves is also reported to the engine's observer (``common/observer.py``).
"""

from __future__ import annotations

from common.kv_offload import KVOffload
from common.numbers import cdiv
from common.observer import NO_OBSERVER, RoundObserver

from .block_manager import BlockManager
from .prefix_cache import PrefixCache
from .sequence import Sequence


class KVCacheManager:
    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        enable_prefix_cache: bool,
        observer: RoundObserver = NO_OBSERVER,
        offload: KVOffload | None = None,
    ) -> None:
        self.block_size = block_size
        self.block_manager = BlockManager(total_blocks)
        self.observer = observer  # the engine's: told of every block move
        self.prefix_cache = (
            PrefixCache(self.block_manager, block_size, observer) if enable_prefix_cache else None
        )
        self.offload = offload  # the second tier (None: the pool is all there is)
        self._to_store: list[tuple[int, int | None, tuple[int, ...], int]] = []

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could get: the free pool, plus cached blocks no request holds.
        Two counters, read at every allocation: it must not count the cache block by block."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.block_manager.num_free + evictable

    # ---- the prefix cache -------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Block ids of the cached chain that continues the sequence's block table: its next
        blocks, already computed by someone (or by itself, before a preemption). A lookup
        only; ``allocate_slots`` adopts them.

        The block holding the sequence's last token is never taken from the cache: its logits
        give the next token, so it is recomputed into a fresh block (shared blocks are
        read-only, and copy-on-write is never needed).

        A request may skip reading the cache (vLLM's ``skip_reading_prefix_cache``); its
        blocks are still cached for the others.
        """
        if self.prefix_cache is None or seq.sampling_params.skip_reading_prefix_cache:
            return []
        return self._lookup_prefix_cache(seq)

    def _lookup_prefix_cache(self, seq: Sequence) -> list[int]:
        first = len(seq.block_table)  # prefill is block-aligned: the blocks it has so far
        last = (seq.num_tokens - 1) // self.block_size  # the last token's block
        if first >= last:
            return []
        seq.extend_block_hashes(last, self.block_size)  # hashes only blocks not hashed yet
        parent_id = seq.block_table[-1] if seq.block_table else None
        tokens = seq.token_ids[first * self.block_size : last * self.block_size]
        hits = self.prefix_cache.match(seq.block_hashes[first:last], tokens, parent_id)
        if self.offload is not None and first + len(hits) < last:  # the pool's chain ended
            hits += self._swap_in(seq, hits, first + len(hits), last)
        return hits

    def _swap_in(self, seq: Sequence, pool_hits: list[int], first: int, last: int) -> list[int]:
        """The page fault served from swap: the sequence's blocks ``first ... last - 1`` that
        the second tier holds, in order up to its first miss, each loaded into a fresh pool
        block and cached there as if computed here. Returns their ids (adopted next, as the
        ``pool_hits`` before them).

        Only as many as the pool has room for without evicting those hits (they go to the back
        of the eviction queue first). A block the cache refuses (its parent is not cached) ends
        the loads: it goes back to the free pool, and the sequence computes it."""
        parent_id = pool_hits[-1] if pool_hits else (seq.block_table or [None])[-1]
        held = sum(self.block_manager.ref_count(b) == 1 for b in pool_hits)
        bs, parent_hash = self.block_size, seq.block_hashes[first - 1] if first else None
        entries = self.offload.lookup(
            seq.block_hashes[first:last],
            seq.token_ids[first * bs : last * bs],
            parent_hash,
            limit=self.num_available_blocks - held,
            resumed=seq.num_preemptions > 0,
        )
        if not entries:
            return []
        self.prefix_cache.update_eviction_queue(pool_hits[::-1])  # not evicted for the loads
        block_ids, evicted = self._allocate(len(entries))
        self.offload.load(entries, block_ids)
        loaded = []
        for entry, block_id in zip(entries, block_ids):
            tokens = list(entry.token_ids)
            if not self.prefix_cache.insert(entry.block_hash, block_id, tokens, parent_id):
                break
            loaded.append(block_id)
            parent_id = block_id
        for block_id in block_ids:  # the cache holds the loaded ones now; the rest go back
            self.block_manager.release(block_id)
        self.prefix_cache.update_eviction_queue((pool_hits + loaded)[::-1])
        self.observer.loaded(seq, loaded, evicted)
        return loaded

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of the sequence's first ``num_tokens`` tokens is in the pool (or about to be).
        If that completes a block, prompt or output, name it by the chain hash of every token up
        to its end: a later request, or the next turn of this conversation, can then adopt it."""
        if self.prefix_cache is None or num_tokens % self.block_size:
            return
        block_idx, token_ids = num_tokens // self.block_size - 1, seq.token_ids
        seq.extend_block_hashes(block_idx + 1, self.block_size)  # a no-op if lookup hashed it
        block_hash = seq.block_hashes[block_idx]
        parent_id = seq.block_table[block_idx - 1] if block_idx else None
        taken = self.prefix_cache.insert(
            block_hash,
            seq.block_table[block_idx],
            token_ids[num_tokens - self.block_size : num_tokens],
            parent_id,
        )
        self.observer.cached(seq, block_idx, taken)
        if taken and self.offload is not None:  # written through once the forward fills it
            parent_hash = seq.block_hashes[block_idx - 1] if block_idx else None
            tokens = tuple(token_ids[num_tokens - self.block_size : num_tokens])
            self._to_store.append((block_hash, parent_hash, tokens, seq.block_table[block_idx]))

    def write_through(self) -> None:
        """The round's forward pass has written its K/V: every block the cache took this round
        goes to the second tier too (the copy out of the pool now, the write on the tier's
        thread), so it outlives its eviction from the pool."""
        if self.offload is not None:
            self.offload.store(self._to_store)
            self._to_store = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: each goes back to the free pool (the caller makes sure no
        request holds one)."""
        if self.prefix_cache is not None:
            self.observer.cache_reset(self.prefix_cache.clear())

    def num_common_prefix_blocks(self, seq: Sequence, num_running: int) -> int:
        """How many leading blocks of ``seq``'s table every one of the ``num_running`` running
        sequences holds (vLLM: ``KVCacheManager.get_num_common_prefix_blocks``).

        A block's references are its owners: each running sequence that holds it, plus the
        cache's one if it is cached. So a block with ``num_running`` references besides the
        cache's is held by every running sequence, at the same place in every table (a shared
        block is a cached one, and the chain puts it there). Only this one table is read:
        O(blocks in a table), whatever the number of sequences or the size of the pool.
        """
        for i, block_id in enumerate(seq.block_table):
            cached = self.prefix_cache is not None and block_id in self.prefix_cache
            if self.block_manager.ref_count(block_id) - cached != num_running:
                return i
        return len(seq.block_table)

    # ---- allocation and freeing -------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow the block table to hold the KV of the sequence's first ``num_tokens`` tokens:
        first the ``computed_blocks`` found by ``get_computed_blocks``, then fresh blocks.

        An adopted block is zero copy: one more owner (``retain``), nothing moves. A fresh
        block is taken only when a chunk or a decode token first needs it, evicting cache-only
        blocks if the free pool is empty. Returns False, having changed nothing, when even that
        is not enough (vLLM's ``allocate_slots`` returns None).
        """
        computed_blocks = computed_blocks or []
        missing = cdiv(num_tokens, self.block_size) - len(seq.block_table) - len(computed_blocks)
        if missing > 0:
            # An adopted block that only the cache held is no longer evictable once adopted.
            adopted_evictable = sum(self.block_manager.ref_count(b) == 1 for b in computed_blocks)
            if missing + adopted_evictable > self.num_available_blocks:
                return False
        for block_id in computed_blocks:
            self.block_manager.retain(block_id)
        if computed_blocks:  # held by a request now: out of the eviction queue
            self.prefix_cache.update_eviction_queue(computed_blocks)
        seq.block_table += computed_blocks
        seq.hit_block_ids += computed_blocks
        new, evicted = self._allocate(missing) if missing > 0 else ([], [])
        seq.block_table += new
        self.observer.allocated(seq, computed_blocks, new, evicted)
        return True

    def _allocate(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` fresh blocks, evicting what the free pool lacks; and the evicted ids."""
        shortfall = n - self.block_manager.num_free
        evicted = []
        if shortfall > 0 and self.prefix_cache is not None:
            evicted = self.prefix_cache.evict(shortfall)
        return self.block_manager.allocate(n), evicted

    def free(self, seq: Sequence) -> None:
        """The chapter's ``_free_seq``: drop the sequence's references."""
        # Adopted or allocated, each block holds one reference of this sequence: release() is
        # the mirror of the retain() at adoption and of allocate(). A block the cache also holds
        # stays (ref_count 1); the others go back to the free pool.
        for block_id in seq.block_table:
            self.block_manager.release(block_id)
        if self.prefix_cache is not None:  # cache-only blocks join the eviction queue,
            self.prefix_cache.update_eviction_queue(seq.block_table[::-1])  # tail first
        self.observer.freed(seq)
        seq.block_table, seq.hit_block_ids = [], []

    # ---- what the pool looks like -----------------------------------------------------------

    def pool_figures(self) -> dict[str, int]:
        """Where the blocks are now (``EngineStats``' block fields), and the second tier's
        counters."""
        bm, cache = self.block_manager, self.prefix_cache
        return {
            "evictions": cache.num_evictions if cache is not None else 0,
            "blocks_free": bm.num_free,
            "blocks_cached": len(cache) if cache is not None else 0,
            "blocks_used": bm.total_blocks - self.num_available_blocks,
            "blocks_peak": bm.peak_used,
            **(self.offload.figures() if self.offload is not None else {}),
        }

    def ref_count_problems(self) -> list[str]:
        """With no request running, every block is free (ref_count 0) or held by the cache
        alone (ref_count 1), and free + cached = total. Returns what breaks that (empty: sane)."""
        bm, cache, problems = self.block_manager, self.prefix_cache, []
        for block_id in range(bm.total_blocks):
            expected = 1 if cache is not None and block_id in cache else 0
            if bm.ref_count(block_id) != expected:
                problems.append(
                    f"block {block_id}: ref_count {bm.ref_count(block_id)}, expected {expected}"
                )
        cached = len(cache) if cache is not None else 0
        if bm.num_free + cached != bm.total_blocks:
            problems.append(f"free {bm.num_free} + cached {cached} != total {bm.total_blocks}")
        return problems
