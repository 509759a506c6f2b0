"""RoundObserver: what an engine tells whoever watches it, as it happens.

Every step's engine and KV cache manager report each round's events here: a request admitted,
a chunk or token scheduled, blocks adopted, allocated and evicted for it, a full block offered
to the prefix cache, a block stored in or evicted from it, a request preempted or freed, the
cache reset. The KV cache events (``common/kv_events.py``), the trace of ``run.py --trace``
(``front/trace.py``) and the benchmark's count of the model's work are observers; none
changes a line of the engine or replaces any of its methods.

This class is the default observer and ignores everything. A watcher subclasses it,
overrides what it needs, and is attached with ``engine.observer.add(watcher)``
(``engine.observer.remove`` detaches it); several can watch one engine at once (``--trace`` and the
bench's count), each told every event in the order they were added (``Observers``). (A
server's metrics are not an observer: they read the engine's stats and each round's outputs
as ``AsyncLLM`` hands them on, in the server's process.) A method is
called *when* its event happens, so the watcher may read the engine's state right then
(``engine.snapshot()``); it must not change it. (vLLM's ``BlockPool`` has the same kind of hook
for its metrics: a ``KVCacheMetricsCollector`` told of every allocation, access and eviction.)
"""

from __future__ import annotations

from typing import Any

Seq = Any  # a step's Sequence (each step has its own class; this module imports none)


class RoundObserver:
    """The events of one engine, in the order they happen within a round."""

    def round_started(self) -> None:
        """``engine.step()`` begins a round."""

    def admitted(self, seq: Seq) -> None:
        """The head of the waiting queue joined the running set (new, or resumed after a
        preemption: ``seq.num_preemptions``)."""

    def waits(self, seq: Seq) -> None:
        """The head of the waiting queue stays there: its first chunk does not fit."""

    def allocated(self, seq: Seq, adopted: list[int], new: list[int], evicted: list[int]) -> None:
        """``seq`` took blocks for its next chunk or token: ``adopted`` from the prefix cache
        (one reference more each), ``new`` from the free pool, after ``evicted`` cache-only
        blocks went back to it to make room."""

    def scheduled(self, seq: Seq, start: int, num_tokens: int) -> None:
        """``seq`` computes its tokens ``start ... start + num_tokens - 1`` this round: a
        prefill chunk, or one decode token."""

    def cached(self, seq: Seq, block_index: int, taken: bool) -> None:
        """``seq`` filled its block ``seq.block_table[block_index]``, which was offered to the
        prefix cache: ``taken``, or refused (the cache holds that prefix already, or the block
        before it is not cached)."""

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """The prefix cache took a full block under ``block_hash`` (its chain's parent:
        ``parent_hash``; None for a first block): vLLM's ``BlockStored``."""

    def block_removed(self, block_hash: int) -> None:
        """The prefix cache evicted the block cached under ``block_hash``: ``BlockRemoved``."""

    def loaded(self, seq: Seq, block_ids: list[int], evicted: list[int]) -> None:
        """step14_10: blocks that continue ``seq``'s chain were found in the second tier and
        loaded into ``block_ids`` of the pool (now cached, adopted next), after ``evicted``
        cache-only blocks went back to the free pool to make room."""

    def tier_stored(
        self, medium: str, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """step14_10: a full block was written through to the second tier, whose ``medium`` is
        vLLM's name for it ("CPU": host memory; "STORAGE": a disk or a remote store): vLLM's
        ``BlockStored`` with that medium."""

    def tier_removed(self, medium: str, block_hash: int) -> None:
        """step14_10: the second tier dropped the block stored under ``block_hash`` (evicted
        for room, or its write failed): vLLM's ``BlockRemoved`` with the tier's medium."""

    def preempted(self, seq: Seq, for_seq: Seq) -> None:
        """``seq``, the youngest running request, goes back to the queue because ``for_seq``
        found no block (perhaps ``seq`` itself). Its ``freed`` follows."""

    def freed(self, seq: Seq) -> None:
        """``seq`` dropped its reference to every block of its table (it finished, was
        preempted or aborted): a block no one else holds is free now. Called before the table
        is emptied, so the watcher can still read it."""

    def cache_reset(self, block_ids: list[int]) -> None:
        """``reset_prefix_cache()`` gave these cached blocks back to the free pool."""

    def round_ended(self) -> None:
        """The round is over: outputs appended, finished requests freed."""


NO_OBSERVER = RoundObserver()


class Observers(RoundObserver):
    """The watchers of one engine: every event goes to each of them, in the order they were
    added. With nobody attached an event costs one loop over an empty list."""

    def __init__(self, watchers: list[RoundObserver] | None = None) -> None:
        self._watchers: list[RoundObserver] = list(watchers or [])

    def add(self, watcher: RoundObserver) -> None:
        if watcher in self._watchers:
            raise ValueError("this observer is attached already")
        self._watchers.append(watcher)

    def remove(self, watcher: RoundObserver) -> None:
        """Detach ``watcher``; ValueError if it is not attached."""
        self._watchers.remove(watcher)

    def round_started(self) -> None:
        for w in self._watchers:
            w.round_started()

    def admitted(self, seq: Seq) -> None:
        for w in self._watchers:
            w.admitted(seq)

    def waits(self, seq: Seq) -> None:
        for w in self._watchers:
            w.waits(seq)

    def allocated(self, seq: Seq, adopted: list[int], new: list[int], evicted: list[int]) -> None:
        for w in self._watchers:
            w.allocated(seq, adopted, new, evicted)

    def scheduled(self, seq: Seq, start: int, num_tokens: int) -> None:
        for w in self._watchers:
            w.scheduled(seq, start, num_tokens)

    def cached(self, seq: Seq, block_index: int, taken: bool) -> None:
        for w in self._watchers:
            w.cached(seq, block_index, taken)

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        for w in self._watchers:
            w.block_stored(block_hash, parent_hash, token_ids)

    def block_removed(self, block_hash: int) -> None:
        for w in self._watchers:
            w.block_removed(block_hash)

    def loaded(self, seq: Seq, block_ids: list[int], evicted: list[int]) -> None:
        for w in self._watchers:
            w.loaded(seq, block_ids, evicted)

    def tier_stored(
        self, medium: str, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        for w in self._watchers:
            w.tier_stored(medium, block_hash, parent_hash, token_ids)

    def tier_removed(self, medium: str, block_hash: int) -> None:
        for w in self._watchers:
            w.tier_removed(medium, block_hash)

    def preempted(self, seq: Seq, for_seq: Seq) -> None:
        for w in self._watchers:
            w.preempted(seq, for_seq)

    def freed(self, seq: Seq) -> None:
        for w in self._watchers:
            w.freed(seq)

    def cache_reset(self, block_ids: list[int]) -> None:
        for w in self._watchers:
            w.cache_reset(block_ids)

    def round_ended(self) -> None:
        for w in self._watchers:
            w.round_ended()
