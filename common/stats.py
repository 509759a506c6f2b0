"""EngineStats: what an engine did and where its blocks are. The same in every step, because
batching changes speed, never what is shared: every step reports the same figures on the same
requests (the tests hold them to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineStats:
    # Requests, counted once each, when their first chunk is scheduled. The cache figures are
    # about prompts: with the prefix cache off, nothing is ever hit or adopted.
    requests: int = 0
    requests_hit: int = 0  # ... of which at least one prompt block came from the cache
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache (adopted blocks)
    # What went through the model (a resumed sequence's prefill included).
    computed_prefill_tokens: int = 0
    computed_decode_tokens: int = 0  # generated tokens fed back through the model
    # Memory pressure: a preempted sequence gives its blocks back, then prefills its prompt and
    # output again, adopting what the cache still holds of them.
    preemptions: int = 0
    resumed_cached_tokens: int = 0  # tokens a resumed sequence got back from the cache
    rounds: int = 0  # rounds that ran at least one sequence
    seqs_scheduled: int = 0  # sequences run, summed over the rounds
    # The queues now (vLLM's num_running_reqs / num_waiting_reqs: a server's gauges).
    requests_running: int = 0  # admitted: prefilling or decoding
    requests_waiting: int = 0  # queued, new or preempted
    # The pool now (evictions and blocks_peak: since the engine was made).
    evictions: int = 0
    blocks_free: int = 0  # in the free pool
    blocks_cached: int = 0  # held by the prefix cache (maybe also by requests)
    blocks_used: int = 0  # held by running requests
    blocks_peak: int = 0  # the most blocks out of the free pool at once: the KV memory held
    # step14_10's second tier (since the engine was made; zero without one). vLLM counts a KV
    # connector's lookups in tokens: queries asked of the tier, hits found there (and loaded,
    # so also counted in cached_tokens). Blocks loaded and stored, their bytes, and failures:
    # a tier that failed, an entry refused (corrupt, foreign), a store dropped.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_loads: int = 0
    kv_offload_stores: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_failures: int = 0

    @property
    def hit_rate(self) -> float:
        return self.requests_hit / self.requests if self.requests else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def seqs_per_round(self) -> float:
        """How many sequences a round ran, on average: what memory let the batch hold."""
        return self.seqs_scheduled / self.rounds if self.rounds else 0.0

    @property
    def computed_tokens(self) -> int:
        """Tokens that went through the model: what the cache did not save."""
        return self.computed_prefill_tokens + self.computed_decode_tokens

    def count_prefill_chunk(self, seq: Any, adopted: int, computed: int, hit: bool) -> None:
        """A prefill chunk of a step's ``seq`` was scheduled: ``adopted`` tokens from the cache,
        ``computed`` by the model, ``hit``: its first adoption. A request counts from its first
        chunk; cache figures are about its prompt (the request's own too: vLLM's
        ``num_cached_tokens``), and a resumed sequence's adoption is counted apart (it is what
        makes recompute cheap)."""
        self.computed_prefill_tokens += computed
        if seq.num_preemptions:
            self.resumed_cached_tokens += adopted
            return
        if seq.prefill_offset == 0:
            self.requests += 1
            self.prompt_tokens += seq.prompt_len
        self.requests_hit += hit
        self.cached_tokens += adopted
        seq.num_cached_tokens += adopted
