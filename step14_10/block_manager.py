"""BlockManager: the physical block pool and a reference count per block.

This is the page-frame allocator of the OS analogy: ``kv_pool_k[layer, block_id]`` is a page
frame, a sequence's ``block_table`` is its page table, and ``ref_count`` says how many owners
(running requests, plus the prefix cache) a frame has. A block returns to the free pool only
when its last owner lets go.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """``allocate(n)`` asked for more blocks than the free pool holds."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    def __init__(self, total_blocks: int) -> None:
        if total_blocks < 1:
            raise ValueError(f"total_blocks must be >= 1, got {total_blocks}")
        self.total_blocks = total_blocks
        self._blocks = [Block(i) for i in range(total_blocks)]
        self._free_ids: deque[int] = deque(range(total_blocks))
        self.peak_used = 0  # the most blocks ever out of the free pool at once: KV memory held

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id).ref_count

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the free pool, each with ref_count 1 (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free_ids):
            raise NoFreeBlocksError(
                f"asked for {n} blocks, only {len(self._free_ids)} of {self.total_blocks} free"
            )
        ids = [self._free_ids.popleft() for _ in range(n)]
        for block_id in ids:
            self._blocks[block_id].ref_count = 1
        self.peak_used = max(self.peak_used, self.total_blocks - len(self._free_ids))
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (all or nothing): a checked loop of ``release``."""
        # Check everything first: a bad call must not leave half of its blocks freed.
        for block_id, n in Counter(block_ids).items():
            if self._block(block_id).ref_count < n:
                raise ValueError(f"double free: block {block_id} has fewer than {n} references")
        for block_id in block_ids:
            self.release(block_id)

    def retain(self, block_id: int) -> None:
        """One more owner for a block in use (a prefix-cache hit, or the cache itself)."""
        block = self._block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"cannot retain block {block_id}: it is free (allocate it first)")
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """The mirror of ``retain()``: one owner fewer. At 0 the block is free again.

        Every reference change goes through this class, so the invariant "a block is in the
        free pool exactly when its ref_count is 0" is kept in one place, and misuse (releasing
        a free block) fails here at once instead of corrupting the pool silently.
        """
        block = self._block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"cannot release block {block_id}: it is already free")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_ids.append(block_id)

    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.total_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.total_blocks})")
        return self._blocks[block_id]
