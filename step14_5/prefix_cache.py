"""The prefix cache: chain hash → one physical block holding that prefix's KV.

The cache is an owner like any request: it holds one reference to each cached block, so a
cached block that no request uses has ref_count 1 and stays out of the free pool until it is
evicted. A hit only retains blocks (zero copy); cached blocks are never written again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

from .block_manager import BlockManager


@dataclass
class CachedBlock:
    """What a hash names, kept so a hit can be *verified* rather than trusted."""

    block_hash: int
    block_id: int
    token_ids: tuple[int, ...]
    parent_id: int | None  # the cached block before it in the chain (None: first block)
    num_children: int = 0  # cached blocks whose parent this is


class PrefixCache:
    def __init__(
        self,
        block_manager: BlockManager,
        block_size: int,
        events: list[KVCacheEvent] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_size
        # Where each change of the cache's content is recorded (vLLM's KV cache events); None:
        # nothing is (the default: then a change costs one `is None` check, nothing more).
        self.events = events
        self._by_hash: dict[int, CachedBlock] = {}
        # block id → entry, least recently used first: the eviction order.
        self._lru: OrderedDict[int, CachedBlock] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds (ref_count 1: only the cache's own reference)."""
        return sum(1 for b in self._lru if self.block_manager.ref_count(b) == 1)

    def match(
        self, block_hashes: list[int], token_ids: list[int], parent_id: int | None = None
    ) -> list[int]:
        """Block ids of the longest cached chain that continues from ``parent_id``.

        ``block_hashes`` and ``token_ids`` describe the blocks that follow ``parent_id`` (the
        last block the caller already holds; None: the start of the prompt). Walks them in order
        and stops at the first miss. An entry counts only if its tokens are the caller's and its
        parent is the block matched just before: then by induction the whole chain holds exactly
        the caller's prefix, so a hash collision can cost a hit but never give wrong KV.
        """
        hits: list[int] = []
        for i, block_hash in enumerate(block_hashes):
            entry = self._by_hash.get(block_hash)
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hits[-1] if hits else parent_id
            if entry is None or entry.token_ids != tokens or entry.parent_id != parent:
                break
            hits.append(entry.block_id)
        return hits

    def insert(
        self, block_hash: int, block_id: int, token_ids: list[int], parent_id: int | None
    ) -> bool:
        """Cache a full block (prompt or output) under its chain hash. Returns whether it was.

        The first block stored under a hash wins (a request that computed its own copy keeps it
        private). A block whose parent is not cached is not stored either: nothing could ever
        reach it by walking a chain from the start.
        """
        if block_hash in self._by_hash or block_id in self._lru:
            return False
        if parent_id is not None and parent_id not in self._lru:
            return False
        entry = CachedBlock(block_hash, block_id, tuple(token_ids), parent_id)
        self.block_manager.retain(block_id)  # the cache's own reference
        self._by_hash[block_hash] = entry
        self._lru[block_id] = entry
        if parent_id is not None:
            self._lru[parent_id].num_children += 1
        if self.events is not None:
            parent_hash = self._lru[parent_id].block_hash if parent_id is not None else None
            self.events.append(
                BlockStored([block_hash], parent_hash, list(token_ids), self.block_size)
            )
        return True

    def touch(self, block_ids: list[int]) -> None:
        """Mark blocks most recently used, in the order given (pass a chain tail first, so the
        tail is evicted before its head)."""
        for block_id in block_ids:
            if block_id in self._lru:
                self._lru.move_to_end(block_id)

    def evict(self, n: int) -> None:
        """Give ``n`` cache-only blocks back to the free pool, least recently used first.

        Only leaves of the cached forest go (a block with cached children would strand them),
        so a chain is evicted from its tail towards its head.
        """
        for _ in range(n):
            victim = next(
                (
                    e
                    for b, e in self._lru.items()
                    if e.num_children == 0 and self.block_manager.ref_count(b) == 1
                ),
                None,
            )
            if victim is None:
                raise RuntimeError("prefix cache has no evictable block left")
            self._remove(victim)
            self.num_evictions += 1

    def clear(self) -> None:
        """Forget every entry: each block loses the cache's reference, and one that no request
        holds goes back to the free pool."""
        self.block_manager.free(list(self._lru))
        self._by_hash.clear()
        self._lru.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def _remove(self, entry: CachedBlock) -> None:
        del self._by_hash[entry.block_hash]
        del self._lru[entry.block_id]
        if entry.parent_id is not None:
            self._lru[entry.parent_id].num_children -= 1
        self.block_manager.free([entry.block_id])  # the cache's reference: back to the pool
        if self.events is not None:
            self.events.append(BlockRemoved([entry.block_hash]))
