"""Sequence and PagedScheduler: who runs this round. No memory operation happens here.

The scheduler only decides; the engine owns the BlockManager and the prefix cache and does
every allocation and free. That split is vLLM's too (its Scheduler asks a KVCacheManager).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

from common import hashing


class SequenceStatus(Enum):
    WAITING = auto()  # queued, no blocks yet
    PREFILLING = auto()  # admitted; prompt being processed one block-sized chunk per round
    RUNNING = auto()  # prompt done; one decode token per round
    FINISHED = auto()  # max_new_tokens reached or eos produced; blocks released


@dataclass(eq=False)
class Sequence:
    """One request. ``block_table`` is its only KV state: physical block ids, in token order."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    generated_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Entries of block_table adopted from the prefix cache (retained, not allocated). Not only
    # leading ones: a sequence adopts whatever others cached whenever its prefill reaches it.
    hit_block_ids: list[int] = field(default_factory=list)
    prefill_offset: int = 0  # prompt tokens whose KV is in the pool (cached or computed)
    status: SequenceStatus = SequenceStatus.WAITING
    # Chain hashes of the full blocks, prompt and output, computed so far (vLLM:
    # Request.block_hashes).
    block_hashes: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output as one stream: the hash chain runs through both."""
        return self.prompt_ids + self.generated_ids

    @property
    def is_prefill_done(self) -> bool:
        return self.prefill_offset >= self.prompt_len

    @property
    def last_token_id(self) -> int:
        return self.generated_ids[-1] if self.generated_ids else self.prompt_ids[-1]

    def extend_block_hashes(self, num_blocks: int, block_size: int) -> None:
        """Grow the hash chain to the first ``num_blocks`` full blocks.

        Each link needs only the one before it, so a block is hashed once, when first needed,
        and every later use (each cache lookup, caching the block once filled) reads it here.
        """
        token_ids = self.token_ids
        while len(self.block_hashes) < num_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else hashing.ROOT_HASH
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hashing.hash_block(parent, tokens))

    def append_token(self, token_id: int) -> None:
        self.generated_ids.append(token_id)
        if len(self.generated_ids) >= self.max_new_tokens or token_id == self.eos_token_id:
            self.status = SequenceStatus.FINISHED


class PagedScheduler:
    """Continuous batching: each round, refill the running set from the queue and split it into
    sequences that still prefill and sequences that decode, so both kinds share every round."""

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(
            s.status is not SequenceStatus.FINISHED for s in self.running
        )

    def schedule(
        self,
        can_admit: Callable[[Sequence], bool] = lambda seq: True,
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Return ``(prefill_seqs, decode_seqs)`` for this round.

        ``can_admit`` is the engine's answer to "is there memory for this one?". Admission is
        first come, first served: the head of the queue waits rather than being overtaken.
        """
        self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]
        while self.waiting and len(self.running) < self.max_running and can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.PREFILLING
            self.running.append(seq)
        prefill = [s for s in self.running if s.status is SequenceStatus.PREFILLING]
        decode = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return prefill, decode
