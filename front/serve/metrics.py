"""``GET /metrics``: the engine's figures in Prometheus text, under vLLM's metric names, so a
dashboard made for ``vllm serve`` reads this server too (vLLM's ``PrometheusStatLogger``).

``record`` is the ``AsyncLLM``'s ``on_round``: after each round, on the event loop, it gets the
engine's ``EngineStats`` and the round's outputs.

- gauges, from the stats as they are now: requests running and waiting, and the KV cache's
  usage, the share of blocks that requests hold (a cached block nobody holds counts as free:
  the next allocation may evict it);
- counters, advanced by what the stats gained since the last round: prompt tokens, the prefix
  cache's queries and hits (in tokens: every prompt token is a query, every token adopted from
  the cache a hit), preemptions; and the tokens generated, from the outputs;
- histograms, from the times each stream kept (``RequestStateStats``): time to first token at a
  request's first token, time per output token at each later one (the gap since the one
  before), end-to-end latency when it finishes (an aborted request's client is gone: none).

Each server has a registry of its own (not ``prometheus_client``'s global one), so the tests
can run several in one process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from common.stats import EngineStats

from .async_llm import Delivered

disable_created_metrics()  # as vLLM: no *_created series beside every counter

# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"


class Metrics:
    """The server's Prometheus metrics, labelled with the served model's name."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, total_blocks: int) -> None:
        self.registry = CollectorRegistry()
        self.total_blocks = total_blocks
        self._last = EngineStats()  # the stats of the last round: counters grow by the gain
        self._pool_hits = 0  # the pool's own prefix cache hits counted so far
        self.model_name = model_name

        def make(kind: type, name: str, doc: str, **extra: Any) -> Any:
            metric = kind(name, doc, ["model_name"], registry=self.registry, **extra)
            return metric.labels(model_name)

        self.running = make(Gauge, "vllm:num_requests_running", "Requests running (admitted).")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting (queued).")
        self.kv_usage = make(
            Gauge, "vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (1 = all)."
        )
        self.queries = make(
            Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.hits = make(
            Counter, "vllm:prefix_cache_hits", "Prompt tokens the prefix cache served."
        )
        self.preemptions = make(Counter, "vllm:num_preemptions", "Requests preempted.")
        # step14_10's second tier, as vLLM reports a KV connector's: its lookups in tokens, and
        # the bytes it moved each way (vLLM's transfer_type is "GPU_to_CPU" / "CPU_to_GPU").
        self.tier_queries = make(
            Counter,
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the second tier (past the pool's hits).",
        )
        self.tier_hits = make(
            Counter, "vllm:external_prefix_cache_hits", "Prompt tokens the second tier served."
        )
        self.tier_bytes = Counter(
            "vllm:kv_offload_total_bytes",
            "KV bytes moved between the pool and the second tier.",
            ["model_name", "transfer_type"],
            registry=self.registry,
        )
        self.tier_failures = make(
            Counter,
            "vllm:kv_offload_failures",
            "Second-tier operations that failed, entries refused, stores dropped (each a miss).",
        )
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of the requests.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.finished = Counter(
            "vllm:request_success",
            "Requests finished, by why: stop (eos, a stop id or string), length, abort.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = make(Histogram, TTFT, "Time to first token.", buckets=TTFT_BUCKETS)
        self.tpot = make(
            Histogram, TPOT, "Time per output token after the first.", buckets=TPOT_BUCKETS
        )
        self.e2e = make(Histogram, E2E, "End-to-end request latency.", buckets=E2E_BUCKETS)

    def record(self, stats: EngineStats, delivered: Delivered, now: float) -> None:
        """One round: the gauges as they are now, the counters by what the round added, and
        each request's times."""
        self.running.set(stats.requests_running)
        self.waiting.set(stats.requests_waiting)
        self.kv_usage.set(stats.blocks_used / self.total_blocks)
        last, self._last = self._last, stats
        new_prompt_tokens = stats.prompt_tokens - last.prompt_tokens
        self.prompt_tokens.inc(new_prompt_tokens)
        self.queries.inc(new_prompt_tokens)
        # The pool's own hits: the prompt tokens adopted, less those the tier gave. A block
        # loaded in one round may be adopted in the next, so the difference is taken over the
        # engine's life, and the counter only moves up.
        pool_hits = stats.cached_tokens - stats.external_prefix_cache_hits
        self.hits.inc(max(0, pool_hits - self._pool_hits))
        self._pool_hits = max(self._pool_hits, pool_hits)
        self._record_tier(stats, last)
        self.preemptions.inc(stats.preemptions - last.preemptions)
        for stream, output in delivered:
            times = stream.times
            self.generation_tokens.inc(len(output.new_token_ids))
            if output.new_token_ids and len(output.token_ids) == len(output.new_token_ids):
                self.ttft.observe(now - times.arrival)
            elif output.new_token_ids and times.previous_token is not None:
                self.tpot.observe((now - times.previous_token) / len(output.new_token_ids))
            if output.finished:
                reason = stream.ended_by or output.finish_reason  # a stop string: "stop"
                self.finished.labels(self.model_name, reason).inc()
                if reason != "abort":
                    self.e2e.observe(now - times.arrival)

    def _record_tier(self, stats: EngineStats, last: EngineStats) -> None:
        self.tier_queries.inc(
            stats.external_prefix_cache_queries - last.external_prefix_cache_queries
        )
        self.tier_hits.inc(stats.external_prefix_cache_hits - last.external_prefix_cache_hits)
        stored = stats.kv_offload_bytes_stored - last.kv_offload_bytes_stored
        loaded = stats.kv_offload_bytes_loaded - last.kv_offload_bytes_loaded
        self.tier_bytes.labels(self.model_name, "pool_to_tier").inc(stored)
        self.tier_bytes.labels(self.model_name, "tier_to_pool").inc(loaded)
        self.tier_failures.inc(stats.kv_offload_failures - last.kv_offload_failures)

    def render(self) -> bytes:
        return generate_latest(self.registry)
