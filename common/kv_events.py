"""KV cache events, as vLLM publishes them (``vllm/distributed/kv_events.py``).

Every change of the prefix cache's content is one event: a block stored under its hash, blocks
removed (evicted), or the whole cache cleared. A KV-aware router that runs several engines
consumes exactly these to send a request where its prefix already lives; here they let a
learner (and the tests) watch the cache. Replaying the stream in order rebuilds the cache's
content: hash -> (parent hash, token ids).

The field names are vLLM's. Hashes are this project's chain hashes (``common/hashing.py``);
block ids, which differ from engine to engine, are never part of an event.
"""

from __future__ import annotations

from dataclasses import dataclass

from .observer import RoundObserver


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the cache, in chain order (here always one block per event)."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the hash of the block before the first one; None: a root
    token_ids: list[int]  # the tokens of every stored block, concatenated
    block_size: int
    lora_id: int | None = None  # vLLM's field; this engine has no LoRA adapters
    medium: str | None = None  # vLLM's field: where the block lives (one pool here)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache (evicted): their hashes no longer name anything."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was emptied (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: list[KVCacheEvent], content: dict | None = None) -> dict:
    """Apply ``events`` in order to ``content`` (hash -> (parent hash, token ids)), which
    starts empty; returns it. What a consumer of the stream keeps."""
    content = {} if content is None else content
    for event in events:
        if isinstance(event, AllBlocksCleared):
            content.clear()
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                del content[block_hash]
        else:
            parent, size = event.parent_block_hash, event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                content[block_hash] = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                parent = block_hash
    return content


class KVEventLog(RoundObserver):
    """The events of one engine's prefix cache, as its observer hears them, until ``take``n.

    ``enable_kv_cache_events=True`` attaches one to the engine: the prefix cache only says
    what it did (a block stored, a block evicted, the cache reset), in one named call each,
    and this class writes it down as vLLM's events."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size))

    def block_removed(self, block_hash: int) -> None:
        self.events.append(BlockRemoved([block_hash]))

    def cache_reset(self, block_ids: list[int]) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        taken, self.events = self.events, []
        return taken
