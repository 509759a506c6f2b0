"""KVCacheManager: every memory operation of the engine, over the block pool and prefix cache.

The engine owns it and calls it at four moments of a sequence's life, with vLLM's names:

- ``get_computed_blocks`` before a prefill chunk: which of its next blocks the cache holds;
- ``allocate_slots`` when a chunk or a decode token needs room: adopt those blocks, and take
  fresh ones for the rest only now (lazy allocation, vLLM's ``KVCacheManager.allocate_slots``);
- ``cache_blocks`` once a block is full: name it by its chain hash so others can adopt it;
- ``free`` when the sequence finishes: one reference fewer on every block it held.

The scheduler never calls it: the chapter's rule is that scheduling does no memory operation.
"""

from __future__ import annotations

from common import hashing
from common.inputs import blocks_for_request, cdiv

from .block_manager import BlockManager
from .prefix_cache import PrefixCache
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, total_blocks: int, block_size: int, enable_prefix_cache: bool) -> None:
        self.block_size = block_size
        self.block_manager = BlockManager(total_blocks)
        self.prefix_cache = (
            PrefixCache(self.block_manager, block_size) if enable_prefix_cache else None
        )
        self.reserved = 0  # blocks promised to admitted sequences that have not allocated yet

    # ---- admission --------------------------------------------------------------------------

    def can_admit(self, seq: Sequence) -> bool:
        """Admit only if the worst case (no cache hit) fits in free + evictable blocks, and
        reserve them: a running request can then never run out of memory."""
        need = blocks_for_request(seq.prompt_len, seq.max_new_tokens, self.block_size)
        if need > self.num_available_blocks - self.reserved:
            return False
        self.reserved += need
        return True

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could get: the free pool, plus cached blocks no request holds."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.block_manager.num_free + evictable

    # ---- the prefix cache -------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Block ids of the cached chain that continues the sequence's block table: its next
        prompt blocks, already computed by someone. A lookup only; ``allocate_slots`` adopts.

        The block holding the last prompt token is never taken from the cache: its logits give
        the first output token, so it is recomputed into a fresh block (shared blocks are
        read-only, and copy-on-write is never needed).
        """
        if self.prefix_cache is None:
            return []
        return self._lookup_prefix_cache(seq)

    def _lookup_prefix_cache(self, seq: Sequence) -> list[int]:
        first = len(seq.block_table)  # prefill is block-aligned: the blocks it has so far
        last = (seq.prompt_len - 1) // self.block_size  # the last prompt token's block
        if first >= last:
            return []
        block_hashes = hashing.hash_prefix_blocks(
            seq.prompt_ids[: last * self.block_size], self.block_size
        )
        parent_id = seq.block_table[-1] if seq.block_table else None
        tokens = seq.prompt_ids[first * self.block_size : last * self.block_size]
        return self.prefix_cache.match(block_hashes[first:last], tokens, parent_id)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of the sequence's first ``num_tokens`` tokens is in the pool (or about to be).
        If that completes a block, prompt or output, name it by the chain hash of every token up
        to its end: a later request, or the next turn of this conversation, can then adopt it."""
        if self.prefix_cache is None or num_tokens % self.block_size:
            return
        block_idx, token_ids = num_tokens // self.block_size - 1, seq.token_ids
        block_hash = hashing.hash_prefix_blocks(token_ids[:num_tokens], self.block_size)[-1]
        parent_id = seq.block_table[block_idx - 1] if block_idx else None
        self.prefix_cache.insert(
            block_hash,
            seq.block_table[block_idx],
            token_ids[num_tokens - self.block_size : num_tokens],
            parent_id,
        )

    # ---- allocation and freeing -------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_tokens: int, computed_blocks: list[int] | None = None
    ) -> None:
        """Grow the block table to hold the KV of the sequence's first ``num_tokens`` tokens:
        first the ``computed_blocks`` found by ``get_computed_blocks``, then fresh blocks.

        An adopted block is zero copy: one more owner (``retain``), nothing moves. A fresh
        block is taken only when a chunk or a decode token first needs it, out of the
        reservation made at admission, so this cannot fail.
        """
        computed_blocks = computed_blocks or []
        for block_id in computed_blocks:
            self.block_manager.retain(block_id)
        seq.block_table += computed_blocks
        seq.hit_block_ids += computed_blocks
        self.reserved -= len(computed_blocks)  # reserved for blocks that need no allocation
        missing = cdiv(num_tokens, self.block_size) - len(seq.block_table)
        if missing > 0:
            seq.block_table += self._allocate(missing)
            self.reserved -= missing

    def _allocate(self, n: int) -> list[int]:
        shortfall = n - self.block_manager.num_free
        if shortfall > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(shortfall)
        return self.block_manager.allocate(n)

    def free(self, seq: Sequence) -> None:
        """The chapter's ``_free_seq``: drop the request's references. Adopted blocks go back
        to the cache's sole ownership, blocks it allocated are freed (those the cache took
        stay, with ref_count 1), and the part of its reservation it never used (an early eos)
        is returned."""
        if self.prefix_cache is not None:
            self.prefix_cache.touch(seq.block_table[::-1])  # tail first: evicted first
        for block_id in seq.hit_block_ids:
            self.block_manager._blocks[block_id].ref_count -= 1
        hits = set(seq.hit_block_ids)
        self.block_manager.free([b for b in seq.block_table if b not in hits])
        need = blocks_for_request(seq.prompt_len, seq.max_new_tokens, self.block_size)
        self.reserved -= need - len(seq.block_table)
        seq.block_table = []

    # ---- what the pool looks like -----------------------------------------------------------

    def ref_count_problems(self) -> list[str]:
        """With no request running, every block is free (ref_count 0) or held by the cache
        alone (ref_count 1), free + cached = total, and nothing is still reserved (a leaked
        reservation would shrink the pool for good). Returns what breaks that (empty: sane)."""
        bm, cache, problems = self.block_manager, self.prefix_cache, []
        if self.reserved:
            problems.append(f"{self.reserved} blocks still reserved with no request running")
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
