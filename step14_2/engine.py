"""PagedPrefixCacheEngine: paged KV + block-granular prefix cache + chunked prefill +
continuous batching, in one loop.

Each round (``step``): the scheduler picks the running set; every prefilling sequence first
adopts whatever blocks of its prompt the cache already holds, then advances one chunk of
``block_size`` tokens (chunk = block, so chunk boundaries are cache boundaries); every decoding
sequence produces one token; finished sequences give their blocks back. Every block that fills
up, prompt or output, is cached at once, so the next sequence can adopt it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import torch

from common import hashing

from .block_manager import BlockManager
from .model import TinyTransformerPaged
from .prefix_cache import PrefixCache
from .scheduler import PagedScheduler, Sequence, SequenceStatus


@dataclass
class EngineStats:
    requests: int = 0  # requests whose prefill has started
    requests_hit: int = 0  # ... of which at least one block came from the cache
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache (adopted blocks)
    computed_prefill_tokens: int = 0  # prompt tokens the model computed
    computed_decode_tokens: int = 0  # generated tokens fed back through the model
    evictions: int = 0
    blocks_free: int = 0  # in the free pool
    blocks_cached: int = 0  # held by the prefix cache (maybe also by requests)
    blocks_used: int = 0  # held by running requests
    blocks_peak: int = 0  # the most blocks out of the free pool at once: the KV memory held

    @property
    def hit_rate(self) -> float:
        return self.requests_hit / self.requests if self.requests else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_tokens(self) -> int:
        """Tokens that went through the model: what the cache did not save."""
        return self.computed_prefill_tokens + self.computed_decode_tokens


class PagedPrefixCacheEngine:
    def __init__(
        self, model: TinyTransformerPaged, max_running: int = 8, enable_prefix_cache: bool = True
    ) -> None:
        self.model = model
        self.block_size = model.cfg.block_size
        self.block_manager = BlockManager(model.cfg.total_blocks)
        self.prefix_cache = (
            PrefixCache(self.block_manager, self.block_size) if enable_prefix_cache else None
        )
        self.scheduler = PagedScheduler(max_running)
        self._counters = EngineStats()
        self._reserved = 0  # blocks promised to admitted sequences that have not allocated yet
        self._next_id = 0
        self._outputs: dict[int, list[int]] = {}

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None
    ) -> int:
        """Queue a request; returns its id. Bad input raises ValueError and changes nothing."""
        prompt = self._validate(prompt_ids, max_new_tokens, eos_token_id)
        seq = Sequence(self._next_id, prompt, max_new_tokens, eos_token_id)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> None:
        """One round of continuous batching."""
        prefill_seqs, decode_seqs = self.scheduler.schedule(self._can_admit)
        for seq in prefill_seqs:
            self._do_prefill_step(seq)
        for seq in decode_seqs:
            self._do_decode_step(seq)
        for seq in prefill_seqs + decode_seqs:
            if seq.status is SequenceStatus.FINISHED:
                self._free_seq(seq)
                self._outputs[seq.seq_id] = seq.generated_ids

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None
    ) -> list[list[int]]:
        """Serve all prompts together (continuous batching); returns generated ids per prompt."""
        # All or nothing: validate every prompt before queueing any, then queue the validated
        # lists (a prompt given as a one-shot iterator could not be read twice).
        prompts = [self._validate(p, max_new_tokens, eos_token_id) for p in prompts]
        ids = [self.add_request(p, max_new_tokens, eos_token_id) for p in prompts]
        while self.has_work:
            self.step()
        return [self.pop_output(i) for i in ids]

    def pop_output(self, request_id: int) -> list[int]:
        """The generated ids of a finished request, handed out once (``add_request`` + ``step``
        users call this when the request is done)."""
        if request_id not in self._outputs:
            raise KeyError(f"request {request_id} has not finished, or its output was taken")
        return self._outputs.pop(request_id)

    def generate_serial(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None
    ) -> list[list[int]]:
        """Serve prompts one at a time, through the same engine and cache."""
        prompts = [self._validate(p, max_new_tokens, eos_token_id) for p in prompts]
        return [self.generate([p], max_new_tokens, eos_token_id)[0] for p in prompts]

    @property
    def stats(self) -> EngineStats:
        bm, cache = self.block_manager, self.prefix_cache
        cache_only = cache.num_evictable if cache is not None else 0
        return replace(
            self._counters,
            evictions=cache.num_evictions if cache is not None else 0,
            blocks_free=bm.num_free,
            blocks_cached=len(cache) if cache is not None else 0,
            blocks_used=bm.total_blocks - bm.num_free - cache_only,
            blocks_peak=bm.peak_used,
        )

    def reset_stats(self) -> None:
        """Zero the request/token counters (the cache, evictions and peak are kept)."""
        self._counters = EngineStats()

    def ref_count_problems(self) -> list[str]:
        """At rest every block is free (ref_count 0) or held by the cache alone (ref_count 1),
        free + cached = total, and no block is still reserved for a request (a leaked
        reservation would shrink the pool for good). Returns what breaks that (empty: sane)."""
        bm, problems = self.block_manager, []
        if self.has_work:
            return ["engine is not at rest"]
        if self._reserved:
            problems.append(f"{self._reserved} blocks still reserved with no request running")
        for block_id in range(bm.total_blocks):
            expected = 1 if self.prefix_cache is not None and block_id in self.prefix_cache else 0
            if bm.ref_count(block_id) != expected:
                problems.append(
                    f"block {block_id}: ref_count {bm.ref_count(block_id)}, expected {expected}"
                )
        cached = len(self.prefix_cache) if self.prefix_cache is not None else 0
        if bm.num_free + cached != bm.total_blocks:
            problems.append(f"free {bm.num_free} + cached {cached} != total {bm.total_blocks}")
        return problems

    # ---- admission and memory ---------------------------------------------------------------

    def _blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks for a request's whole life: every token whose KV is ever written (the last
        generated token is never fed back, so it needs no slot)."""
        return -(-(prompt_len + max_new_tokens - 1) // self.block_size)

    def _available_blocks(self) -> int:
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.block_manager.num_free + evictable - self._reserved

    def _can_admit(self, seq: Sequence) -> bool:
        """Admit only if the worst case (no cache hit) fits in free + evictable blocks, and
        reserve them: a running request can then never run out of memory."""
        need = self._blocks_needed(seq.prompt_len, seq.max_new_tokens)
        if need > self._available_blocks():
            return False
        self._reserved += need
        return True

    def _allocate(self, n: int) -> list[int]:
        shortfall = n - self.block_manager.num_free
        if shortfall > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(shortfall)
        return self.block_manager.allocate(n)

    def _allocate_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table to hold the KV of the sequence's first ``num_tokens`` tokens.

        A block is taken only when a chunk or a decode token first needs it (vLLM:
        ``allocate_slots``), out of the reservation made at admission, so this cannot fail.
        """
        missing = -(-num_tokens // self.block_size) - len(seq.block_table)
        if missing > 0:
            seq.block_table += self._allocate(missing)
            self._reserved -= missing

    def _start_sequence(self, seq: Sequence) -> None:
        """First prefill step: the request counts from here. Its blocks come as it needs them."""
        self._counters.requests += 1
        self._counters.prompt_tokens += seq.prompt_len

    # ---- the prefix cache -------------------------------------------------------------------

    def _adopt_cached_blocks(self, seq: Sequence) -> None:
        """Before each prefill chunk, take the prompt's next blocks from the cache where it has
        them, instead of computing them.

        Looking up at every chunk, not only at admission, lets requests that run together
        leapfrog through a shared prefix: each computes a block nobody has yet and adopts the
        ones the others computed, so every shared block is computed exactly once.
        """
        hits = self._lookup_prefix_cache(seq)
        for block_id in hits:  # a hit is zero copy: one more owner, nothing moves
            self.block_manager.retain(block_id)
        if hits and not seq.hit_block_ids:
            self._counters.requests_hit += 1
        seq.block_table += hits
        seq.hit_block_ids += hits
        seq.prefill_offset += len(hits) * self.block_size
        self._reserved -= len(hits)  # reserved for blocks that now need no allocation
        self._counters.cached_tokens += len(hits) * self.block_size

    def _lookup_prefix_cache(self, seq: Sequence) -> list[int]:
        """Block ids of the cached chain that continues the sequence's block table.

        The block holding the last prompt token is never taken from the cache: its logits give
        the first output token, so it is recomputed into a fresh block (shared blocks are
        read-only, and copy-on-write is never needed).
        """
        first = len(seq.block_table)  # prefill is block-aligned: the blocks it has so far
        last = (seq.prompt_len - 1) // self.block_size  # the last prompt token's block
        if self.prefix_cache is None or first >= last:
            return []
        block_hashes = hashing.hash_prefix_blocks(
            seq.prompt_ids[: last * self.block_size], self.block_size
        )
        parent_id = seq.block_table[-1] if seq.block_table else None
        tokens = seq.prompt_ids[first * self.block_size : last * self.block_size]
        return self.prefix_cache.match(block_hashes[first:last], tokens, parent_id)

    def _cache_full_block(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of the sequence's first ``num_tokens`` tokens is in the pool. If that just
        completed a block, prompt or output, name it by the chain hash of every token up to its
        end: a later request, or the next turn of this conversation, can then adopt it."""
        if self.prefix_cache is None or num_tokens % self.block_size:
            return
        block_idx, token_ids = num_tokens // self.block_size - 1, seq.token_ids
        block_hash = hashing.hash_prefix_blocks(token_ids[:num_tokens], self.block_size)[-1]
        parent_id = seq.block_table[block_idx - 1] if block_idx else None
        self.prefix_cache.insert(
            block_hash,
            seq.block_table[block_idx],
            token_ids[num_tokens - self.block_size : num_tokens],
            parent_id,
        )

    # ---- one round's work -------------------------------------------------------------------

    def _schedule_prefill_chunk(self, seq: Sequence) -> tuple[list[int], int]:
        """This round's prompt chunk and the position of its first token: adopt what the cache
        holds next, then make room for one block-sized chunk."""
        if seq.prefill_offset == 0:
            self._start_sequence(seq)
        self._adopt_cached_blocks(seq)
        start = seq.prefill_offset
        chunk = seq.prompt_ids[start : start + self.block_size]
        self._allocate_slots(seq, start + len(chunk))
        self._counters.computed_prefill_tokens += len(chunk)
        return chunk, start

    def _schedule_decode_token(self, seq: Sequence) -> tuple[list[int], int]:
        """The newest token, whose KV is not in the pool yet, and its position."""
        position = seq.num_tokens - 1
        self._allocate_slots(seq, position + 1)
        self._counters.computed_decode_tokens += 1
        return [seq.last_token_id], position

    def _do_prefill_step(self, seq: Sequence) -> None:
        chunk, start = self._schedule_prefill_chunk(seq)
        logits = self.model(chunk, seq.block_table, start)
        seq.prefill_offset = start + len(chunk)
        self._cache_full_block(seq, seq.prefill_offset)  # its KV is in the pool now
        if seq.is_prefill_done:
            seq.status = SequenceStatus.RUNNING
            seq.append_token(int(logits[-1].argmax()))

    def _do_decode_step(self, seq: Sequence) -> None:
        chunk, position = self._schedule_decode_token(seq)
        logits = self.model(chunk, seq.block_table, position)
        self._cache_full_block(seq, position + 1)  # output blocks are cached too
        seq.append_token(int(logits[-1].argmax()))

    def _free_seq(self, seq: Sequence) -> None:
        """Drop the request's references: adopted blocks go back to the cache's sole ownership,
        blocks it allocated are freed (those the cache took stay, with ref_count 1), and the
        part of its reservation it never used (an early eos) is returned."""
        if self.prefix_cache is not None:
            self.prefix_cache.touch(seq.block_table[::-1])  # tail first: evicted first
        for block_id in seq.hit_block_ids:
            self.block_manager._blocks[block_id].ref_count -= 1
        hits = set(seq.hit_block_ids)
        self.block_manager.free([b for b in seq.block_table if b not in hits])
        need = self._blocks_needed(seq.prompt_len, seq.max_new_tokens)
        self._reserved -= need - len(seq.block_table)
        seq.block_table = []

    # ---- input validation -------------------------------------------------------------------

    def _validate(
        self, prompt_ids: object, max_new_tokens: object, eos_token_id: object
    ) -> list[int]:
        vocab = self.model.cfg.vocab_size
        prompt = _as_token_list(prompt_ids)
        if not prompt:
            raise ValueError("prompt is empty: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if eos_token_id is not None and not (_is_int(eos_token_id) and 0 <= eos_token_id < vocab):
            raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab})")
        need = self._blocks_needed(len(prompt), int(max_new_tokens))
        if need > self.block_manager.total_blocks:
            raise ValueError(
                f"request needs {need} blocks ({len(prompt)} prompt + {max_new_tokens} new "
                f"tokens at block_size={self.block_size}) but the pool has only "
                f"{self.block_manager.total_blocks}: it could never run"
            )
        return prompt


def _is_int(x: object) -> bool:
    # ``type(x) is int`` answers the usual case at once; the ABC check is ~20x slower, which
    # shows when every token of every prompt is checked.
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _as_token_list(prompt_ids: object) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError("a prompt tensor must be 1-D with an integer dtype")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt_ids).__name__}")
    tokens = list(prompt_ids)
    if not all(_is_int(t) for t in tokens):
        raise ValueError("prompt token ids must be integers")
    return [int(t) for t in tokens]
