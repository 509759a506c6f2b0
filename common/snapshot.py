"""PoolSnapshot: the KV pool at one moment, as a watcher sees it.

The trace and its picture want to show who holds which block and every reference count. They
read this copy (``engine.snapshot()``) instead of the engine's parts, so a watcher can neither
change the engine nor break when a step rearranges its insides. Taking one visits every block
of the pool: it is a watcher's tool, and nothing in the round loop calls it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class PoolSnapshot:
    total_blocks: int
    block_size: int
    num_free: int  # blocks in the free pool (ref_count 0)
    ref_counts: dict[int, int]  # block id -> ref_count, for every block out of the free pool
    cached: frozenset[int]  # blocks the prefix cache holds (one reference each)
    running: dict[int, tuple[int, ...]]  # request id -> block table, oldest request first
    waiting: dict[int, tuple[int, ...]]  # request id -> block table, head of the queue first

    @classmethod
    def of(
        cls, kv_cache_manager: Any, running: Iterable[Any], waiting: Iterable[Any]
    ) -> PoolSnapshot:
        """The pool of a step's ``kv_cache_manager`` as it is now, with the block tables of the
        ``running`` and ``waiting`` requests (it visits every block: a watcher's tool)."""
        bm, cache = kv_cache_manager.block_manager, kv_cache_manager.prefix_cache
        refs = {b: bm.ref_count(b) for b in range(bm.total_blocks) if bm.ref_count(b)}
        return cls(
            bm.total_blocks,
            kv_cache_manager.block_size,
            bm.num_free,
            refs,
            frozenset(cache) if cache is not None else frozenset(),
            {seq.seq_id: tuple(seq.block_table) for seq in running},
            {seq.seq_id: tuple(seq.block_table) for seq in waiting},
        )

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts.get(block_id, 0)

    @cached_property
    def holders(self) -> dict[int, tuple[int, ...]]:
        """Block id -> the requests whose tables hold it, running ones first."""
        holders: dict[int, list[int]] = {}
        for request_id, table in [*self.running.items(), *self.waiting.items()]:
            for block in table:
                holders.setdefault(block, []).append(request_id)
        return {block: tuple(ids) for block, ids in sorted(holders.items())}

    @property
    def in_use(self) -> int:
        """Blocks that at least one request holds (the cache may hold them too)."""
        return len(self.holders)

    @property
    def cached_only(self) -> list[int]:
        """Blocks only the cache holds (ref_count 1): the evictable ones, in id order."""
        return sorted(b for b in self.cached if b not in self.holders)

    def problems(self) -> list[str]:
        """Where the books do not balance: every block's ref_count must be the requests that
        hold it plus one if the cache does, and free + in use + cached only = total."""
        problems = []
        for block in sorted(set(self.ref_counts) | set(self.holders) | self.cached):
            owners = len(self.holders.get(block, ())) + (block in self.cached)
            if self.ref_count(block) != owners:
                problems.append(
                    f"block {block}: ref_count {self.ref_count(block)}, but {owners} owners"
                )
        if self.num_free + self.in_use + len(self.cached_only) != self.total_blocks:
            problems.append(
                f"free {self.num_free} + in use {self.in_use} + cached only "
                f"{len(self.cached_only)} != total {self.total_blocks}"
            )
        return problems
