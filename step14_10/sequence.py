"""Sequence: one request, as the scheduler and the KV cache manager see it (vLLM: ``Request``).

It holds what the request asked for (prompt, ``max_new_tokens``, eos ids, how to sample), what
it has produced (``generated_ids``) and where its KV lives (``block_table``): nothing else about
memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import hashing
from common.sampling_params import GREEDY, FinishReason, SamplingParams
from common.status import SequenceStatus  # WAITING -> PREFILLING -> RUNNING -> FINISHED

__all__ = ["Sequence", "SequenceStatus"]


@dataclass(eq=False)
class Sequence:
    """One request. ``block_table`` is its only KV state: physical block ids, in token order."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    # The ids that end the request (Llama 3 lists several eos ids; a request may add stop ids);
    # empty: only max_new_tokens does.
    eos_token_ids: frozenset[int] = frozenset()
    # Greedy or drawn; a drawn request always has its seed here (the engine gives it one).
    sampling_params: SamplingParams = GREEDY
    generated_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Entries of block_table adopted from the prefix cache (retained, not allocated). Not only
    # leading ones: a sequence adopts whatever others cached whenever its prefill reaches it.
    hit_block_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the pool (cached or computed) while prefilling: the prompt's, and
    # after a preemption the output's too, since a resumed sequence prefills both again.
    prefill_offset: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens adopted from the cache (before any preemption)
    finish_reason: FinishReason | None = None  # why it ended, once FINISHED
    # Chain hashes of the full blocks, prompt and output, computed so far (vLLM:
    # Request.block_hashes). Tokens never change, so they stay valid across a preemption.
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
        """While prefilling: every token so far has its KV (the prompt's, or on resume the
        prompt's and the output's), so the next model call samples a new token."""
        return self.prefill_offset >= self.num_tokens

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

    # ---- its life: every change of status is one of these, named for what happens ----------

    def admit(self) -> None:
        """Into the running set: its prompt (after a preemption, prompt + output) prefills."""
        self.status = SequenceStatus.PREFILLING

    def advance_prefill(self, num_tokens: int) -> bool:
        """The KV of its first ``num_tokens`` tokens is in the pool, adopted or computed.
        Returns whether the prefill is over (then it decodes: the next model call samples)."""
        self.prefill_offset = num_tokens
        if self.is_prefill_done:
            self.status = SequenceStatus.RUNNING
        return self.is_prefill_done

    def append_token(self, token_id: int) -> None:
        """A new token; the request is finished at an eos id ("stop", first, as in vLLM) or at
        ``max_new_tokens`` ("length")."""
        self.generated_ids.append(token_id)
        if token_id in self.eos_token_ids:
            self._finish("stop")
        elif len(self.generated_ids) >= self.max_new_tokens:
            self._finish("length")

    def preempt(self) -> None:
        """Its blocks were taken back: it waits again, to prefill prompt + output anew."""
        self.status = SequenceStatus.PREEMPTED
        self.prefill_offset = 0
        self.num_preemptions += 1

    def abort(self) -> None:
        """Cancelled by its user: finished where it stands."""
        self._finish("abort")

    def _finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
