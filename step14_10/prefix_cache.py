"""The prefix cache: chain hash → one physical block holding that prefix's KV.

The cache is an owner like any request: it holds one reference to each cached block, so a
cached block that no request uses has ref_count 1 and stays out of the free pool until it is
evicted. A hit only retains blocks (zero copy); cached blocks are never written again.

Every operation costs O(1) per block, however many blocks are cached: the cached blocks that
no request holds wait in one queue, least recently used first, so counting them is a ``len``,
evicting one takes the queue's head, and a hit lifts one out of the middle. The queue is an
``OrderedDict``: a hash map threaded on a doubly linked list, as vLLM's
``FreeKVCacheBlockQueue`` is (the first step's README maps the two).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from common.observer import NO_OBSERVER, RoundObserver

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
        observer: RoundObserver = NO_OBSERVER,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_size
        self.observer = observer  # told of each block stored and evicted (vLLM's KV events)
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}  # every cached block, by block id
        # The eviction queue: cached blocks no request holds (ref_count 1), least recently
        # used first. A request that holds a block holds the whole chain before it, and lets
        # go of its blocks tail first (``update_eviction_queue``), so a chain's tail is always
        # ahead of its head here: the queue's head is a leaf, and evicting it strands no other
        # block.
        self._evictable: OrderedDict[int, CachedBlock] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    def __iter__(self) -> Iterator[int]:
        """The cached block ids (what ``engine.snapshot()`` shows a watcher)."""
        return iter(self._by_block)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds (ref_count 1: only the cache's own reference)."""
        return len(self._evictable)

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
        reach it by walking a chain from the start. The request that fills the block holds it,
        so it does not join the eviction queue until that request lets go
        (``update_eviction_queue``).
        """
        if block_hash in self._by_hash or block_id in self._by_block:
            return False
        if parent_id is not None and parent_id not in self._by_block:
            return False
        entry = CachedBlock(block_hash, block_id, tuple(token_ids), parent_id)
        self.block_manager.retain(block_id)  # the cache's own reference
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        if parent_id is not None:
            self._by_block[parent_id].num_children += 1
        parent_hash = self._by_block[parent_id].block_hash if parent_id is not None else None
        self.observer.block_stored(block_hash, parent_hash, entry.token_ids)
        return True

    def update_eviction_queue(self, block_ids: list[int]) -> None:
        """A request has just taken or dropped its reference to these blocks: file each cached
        one by its ref_count. Held by a request (a hit adopted it): out of the eviction queue.
        Held by the cache alone (its last request let go): to the queue's tail, most recently
        used, in the order given, so a request lets go of its chain tail first and the tail is
        evicted before its head. Other blocks are skipped. O(1) per block.

        vLLM splits this in two: ``BlockPool.touch`` takes one reference more and lifts the
        block out of its free queue; ``free_blocks`` drops one and, at zero, queues it. Here
        ``BlockManager`` counts the references, and this method only files the block."""
        for block_id in block_ids:
            entry = self._by_block.get(block_id)
            if entry is None:
                continue
            if self.block_manager.ref_count(block_id) == 1:
                self._evictable[block_id] = entry
                self._evictable.move_to_end(block_id)
            else:
                self._evictable.pop(block_id, None)

    def evict(self, n: int) -> list[int]:
        """Give ``n`` cache-only blocks back to the free pool, least recently used first: the
        head of the eviction queue each time, O(1) per block. Returns their ids.

        The head is a leaf of the cached forest (see ``_evictable``), so a chain is evicted
        from its tail towards its head and no cached block is ever stranded without its parent.
        """
        evicted = []
        for _ in range(n):
            if not self._evictable:
                raise RuntimeError("prefix cache has no evictable block left")
            victim = next(iter(self._evictable.values()))
            if victim.num_children:  # only if a caller let go of a chain head first
                raise RuntimeError(
                    f"block {victim.block_id} is the least recently used but has cached "
                    "children: let go of a chain tail first "
                    "(update_eviction_queue(block_table[::-1]))"
                )
            self._remove(victim)
            self.num_evictions += 1
            evicted.append(victim.block_id)
        return evicted

    def clear(self) -> list[int]:
        """Forget every entry: each block loses the cache's reference, and one that no request
        holds goes back to the free pool. Returns the blocks it held."""
        cleared = list(self._by_block)
        self.block_manager.free(cleared)
        self._by_hash.clear()
        self._by_block.clear()
        self._evictable.clear()
        return cleared

    def _remove(self, entry: CachedBlock) -> None:
        del self._by_hash[entry.block_hash]
        del self._by_block[entry.block_id]
        del self._evictable[entry.block_id]
        if entry.parent_id is not None:
            self._by_block[entry.parent_id].num_children -= 1
        self.block_manager.free([entry.block_id])  # the cache's reference: back to the pool
        self.observer.block_removed(entry.block_hash)
