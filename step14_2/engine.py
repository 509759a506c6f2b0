"""PagedPrefixCacheEngine: paged KV + block-granular prefix cache + chunked prefill +
continuous batching, in one loop.

Each round (``step``): the scheduler picks the running set; every prefilling sequence first
adopts whatever blocks of its prompt the cache already holds, then advances one chunk of
``block_size`` tokens (chunk = block, so chunk boundaries are cache boundaries); every decoding
sequence produces one token; finished sequences give their blocks back. Every block that fills
up, prompt or output, is cached at once, so the next sequence can adopt it. Every memory
operation is the KV cache manager's (``kv_cache_manager.py``); this file is the round loop,
the public API and the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.inputs import Request, check_request

from .kv_cache_manager import KVCacheManager
from .model import TinyTransformerPaged
from .scheduler import PagedScheduler
from .sequence import Sequence, SequenceStatus


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
        self.kv_cache_manager = KVCacheManager(
            model.cfg.total_blocks, self.block_size, enable_prefix_cache
        )
        self.scheduler = PagedScheduler(max_running)
        self._counters = EngineStats()
        self._next_id = 0
        self._outputs: dict[int, list[int]] = {}

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: object = None
    ) -> int:
        """Queue a request; returns its id. ``eos_token_id``: None, one id or a collection of
        ids (the request stops at any). Bad input raises ValueError and changes nothing."""
        return self._queue(check_request(prompt_ids, max_new_tokens, eos_token_id, self.model.cfg))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> None:
        """One round of continuous batching."""
        prefill_seqs, decode_seqs = self.scheduler.schedule(self.kv_cache_manager.can_admit)
        for seq in prefill_seqs:
            self._do_prefill_step(seq)
        for seq in decode_seqs:
            self._do_decode_step(seq)
        for seq in prefill_seqs + decode_seqs:
            if seq.status is SequenceStatus.FINISHED:
                self.kv_cache_manager.free(seq)
                self._outputs[seq.seq_id] = seq.generated_ids

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: object = None
    ) -> list[list[int]]:
        """Serve all prompts together (continuous batching); returns generated ids per prompt."""
        requests = self._check_all(prompts, max_new_tokens, eos_token_id)
        return self._run([self._queue(r) for r in requests])

    def generate_serial(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: object = None
    ) -> list[list[int]]:
        """Serve prompts one at a time, through the same engine and cache."""
        requests = self._check_all(prompts, max_new_tokens, eos_token_id)
        return [self._run([self._queue(r)])[0] for r in requests]

    def pop_output(self, request_id: int) -> list[int]:
        """The generated ids of a finished request, handed out once (``add_request`` + ``step``
        users call this when the request is done)."""
        if request_id not in self._outputs:
            raise KeyError(f"request {request_id} has not finished, or its output was taken")
        return self._outputs.pop(request_id)

    @property
    def stats(self) -> EngineStats:
        bm, cache = self.kv_cache_manager.block_manager, self.kv_cache_manager.prefix_cache
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
        """What is wrong with the pool at rest (empty: every block free or cached alone)."""
        if self.has_work:
            return ["engine is not at rest"]
        return self.kv_cache_manager.ref_count_problems()

    # ---- requests in, outputs out -----------------------------------------------------------

    def _check_all(self, prompts: object, max_new_tokens: object, eos: object) -> list[Request]:
        """Every prompt checked before any is queued: a bad one leaves the engine untouched.
        The checked requests are what gets queued (a one-shot iterator is read once)."""
        if isinstance(prompts, (str, bytes)):
            raise ValueError("prompts must be a list of prompts (lists of token ids), not text")
        return [check_request(p, max_new_tokens, eos, self.model.cfg) for p in prompts]

    def _queue(self, request: Request) -> int:
        seq = Sequence(
            self._next_id, request.prompt_ids, request.max_new_tokens, request.eos_token_ids
        )
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def _run(self, request_ids: list[int]) -> list[list[int]]:
        while self.has_work:
            self.step()
        return [self.pop_output(i) for i in request_ids]

    # ---- one round's work -------------------------------------------------------------------

    def _schedule_prefill_chunk(self, seq: Sequence) -> tuple[list[int], int]:
        """This round's prompt chunk and the position of its first token.

        Before each chunk, not only at admission, the sequence adopts the next blocks the cache
        already holds: requests that run together then leapfrog through a shared prefix, each
        computing a block nobody has yet, so every shared block is computed exactly once.
        """
        if seq.prefill_offset == 0:  # the request counts from its first prefill step
            self._counters.requests += 1
            self._counters.prompt_tokens += seq.prompt_len
        hits = self.kv_cache_manager.get_computed_blocks(seq)
        if hits and not seq.hit_block_ids:
            self._counters.requests_hit += 1
        self._counters.cached_tokens += len(hits) * self.block_size
        start = seq.prefill_offset + len(hits) * self.block_size
        chunk = seq.prompt_ids[start : start + self.block_size]
        self.kv_cache_manager.allocate_slots(seq, start + len(chunk), hits)
        seq.prefill_offset = start
        self._counters.computed_prefill_tokens += len(chunk)
        return chunk, start

    def _schedule_decode_token(self, seq: Sequence) -> tuple[list[int], int]:
        """The newest token, whose KV is not in the pool yet, and its position."""
        position = seq.num_tokens - 1
        self.kv_cache_manager.allocate_slots(seq, position + 1)
        self._counters.computed_decode_tokens += 1
        return [seq.last_token_id], position

    def _do_prefill_step(self, seq: Sequence) -> None:
        chunk, start = self._schedule_prefill_chunk(seq)
        logits = self.model(chunk, seq.block_table, start)
        seq.prefill_offset = start + len(chunk)
        self.kv_cache_manager.cache_blocks(seq, seq.prefill_offset)  # its KV is in the pool now
        if seq.is_prefill_done:
            seq.status = SequenceStatus.RUNNING
            seq.append_token(int(logits[-1].argmax()))

    def _do_decode_step(self, seq: Sequence) -> None:
        chunk, position = self._schedule_decode_token(seq)
        logits = self.model(chunk, seq.block_table, position)
        self.kv_cache_manager.cache_blocks(seq, position + 1)  # output blocks are cached too
        seq.append_token(int(logits[-1].argmax()))
