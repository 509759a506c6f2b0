"""KV cache events, as vLLM publishes them (``vllm/distributed/kv_events.py``).

Every change of the prefix cache's content is one event: a block stored under its hash, blocks
removed (evicted), or the whole cache cleared. A KV-aware router that runs several engines
consumes exactly these to send a request where its prefix already lives; here they let a
learner (and the tests) watch the cache. Replaying the stream in order rebuilds the cache's
content: hash -> (parent hash, token ids).

The field names are vLLM's. Hashes are this project's chain hashes (``common/hashing.py``);
block ids, which differ from engine to engine, are never part of an event.

``medium`` says where a block lives, with vLLM's names: ``"GPU"`` for the engine's own pool,
the one that attention reads, whatever the hardware (vLLM's CPU build says ``"GPU"`` there
too: its ``BlockPool`` always does); ``"CPU"`` and ``"STORAGE"`` for the tiers vLLM offloads
blocks to (host memory; disk or a remote store). A router that tells tiers apart counts a
``"GPU"`` block, or one with no medium, as in the pool, ready to serve.
"""

from __future__ import annotations

from dataclasses import dataclass

from .observer import RoundObserver

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own pool (on its CPU build too)
MEDIUM_CPU = "CPU"  # vLLM's name for blocks offloaded to host memory
MEDIUM_STORAGE = "STORAGE"  # vLLM's name for blocks offloaded to disk or a remote store


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the cache, in chain order (here always one block per event)."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the hash of the block before the first one; None: a root
    token_ids: list[int]  # the tokens of every stored block, concatenated
    block_size: int
    lora_id: int | None = None  # vLLM's field; this engine has no LoRA adapters
    medium: str | None = None  # vLLM's field: where the block lives (MEDIUM_GPU: the pool)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache (evicted): their hashes no longer name anything."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was emptied (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(
    events: list[KVCacheEvent], content: dict | None = None, medium: str = MEDIUM_GPU
) -> dict:
    """Apply ``events`` in order to ``content`` (hash -> (parent hash, token ids)), which
    starts empty; returns it. What a consumer of the stream keeps of one ``medium`` (the
    engine's pool by default): a block stored in or removed from another tier is not the
    pool's (an event with no medium counts as the pool's, as routers read it)."""
    content = {} if content is None else content
    for event in events:
        if isinstance(event, AllBlocksCleared):
            content.clear()
        elif (event.medium or MEDIUM_GPU) != medium:
            continue
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                if medium == MEDIUM_GPU:
                    del content[block_hash]  # the pool removes only what it stored
                else:  # a tier outlives AllBlocksCleared (a reset empties the pool): after
                    content.pop(block_hash, None)  # one, it may remove what was forgotten
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
    and this class writes it down as vLLM's events, each with the ``medium`` of the engine's
    pool (vLLM's ``BlockPool`` default, ``"GPU"``, which its CPU build keeps). A second tier
    says what it holds with ``stored_in`` and ``removed_from``, naming its own medium."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVCacheEvent] = []

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        self.stored_in(self.medium, block_hash, parent_hash, token_ids)

    def block_removed(self, block_hash: int) -> None:
        self.removed_from(self.medium, block_hash)

    def stored_in(
        self, medium: str, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """A full block entered ``medium`` (the pool, or a second tier: ``MEDIUM_CPU``...)."""
        tokens = list(token_ids)
        self.events.append(
            BlockStored([block_hash], parent_hash, tokens, self.block_size, medium=medium)
        )

    tier_stored = stored_in  # the observer's name for a block written to step14_10's tier

    def removed_from(self, medium: str, block_hash: int) -> None:
        """A block left ``medium``: it may still live in another one."""
        self.events.append(BlockRemoved([block_hash], medium))

    tier_removed = removed_from  # and one the tier dropped

    def cache_reset(self, block_ids: list[int]) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        taken, self.events = self.events, []
        return taken
