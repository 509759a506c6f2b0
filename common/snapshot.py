"""PoolSnapshot: the KV pool at one moment, as a watcher sees it.

The trace and its picture want to show who holds which block and every reference count. They
read this copy (``engine.snapshot()``) instead of the engine's parts, so a watcher can neither
change the engine nor break when a step rearranges its insides. Taking one visits every block
of the pool: it is a watcher's tool, and nothing in the round loop calls it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolSnapshot:
    total_blocks: int
    block_size: int
    num_free: int  # blocks in the free pool (ref_count 0)
    ref_counts: dict[int, int]  # block id -> ref_count, for every block out of the free pool
    cached: frozenset[int]  # blocks the prefix cache holds (one reference each)
    running: dict[int, tuple[int, ...]]  # request id -> block table, oldest request first
    waiting: dict[int, tuple[int, ...]]  # request id -> block table, head of the queue first

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts.get(block_id, 0)

    @property
    def holders(self) -> dict[int, tuple[int, ...]]:
        """Block id -> the requests whose tables hold it, running ones first."""
        holders: dict[int, list[int]] = {}
        for request_id, table in [*self.running.items(), *self.waiting.items()]:
            for block in table:
                holders.setdefault(block, []).append(request_id)
        return {block: tuple(ids) for block, ids in sorted(holders.items())}
