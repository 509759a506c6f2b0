"""``/metrics`` beside step14_10's second tier: the pool's hits and the tier's, apart.

vLLM reports a KV connector's lookups as ``vllm:external_prefix_cache_queries``/``_hits`` and
keeps ``vllm:prefix_cache_hits`` for its own cache; here the same. A block loaded in one round
may be adopted in the next, and a resumed request's loads are not about its prompt: neither
may make a counter go down (Prometheus refuses it), nor lose a round's other metrics.
"""

from __future__ import annotations

import random

from common.kv_tiers import HostTier
from front.serve.metrics import Metrics
from front.steps import load_step
from tests.helpers import tiny_config
from tests.serve.server_process import metric


def test_the_pools_hits_and_the_tiers_are_counted_apart() -> None:
    """Waves of requests behind one prefix in a pool so small that requests are preempted and
    load their blocks back when they resume, then a new request that finds the prefix in the
    tier only; every round's stats recorded as the server does: the counters end equal to the
    engine's figures, the pool's hits being the adopted tokens the tier did not give."""
    step = load_step("step14_10")
    cfg = tiny_config(total_blocks=16)
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(cfg), max_running=4, kv_offloading_backend=HostTier(1 << 30)
    )
    metrics = Metrics("toy", cfg.total_blocks)
    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(cfg.vocab_size) for _ in range(n)]

    def serve(prompts: list[list[int]], max_new_tokens: int) -> None:
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens)
        while engine.has_work:
            engine.step()
            metrics.record(engine.stats, [], 0.0)  # raises if a counter would go down

    prefix = words(4 * cfg.block_size)
    for _ in range(6):  # preempted requests load their blocks back when they resume
        serve([prefix + words(4) for _ in range(4)], 12)
    serve([words(12) for _ in range(8)], 2)  # the prefix evicted from the pool
    serve([prefix + words(4)], 2)  # a new request loads it: the tier's hits
    stats, page = engine.stats, metrics.render().decode()
    assert stats.preemptions > 0 and stats.kv_offload_loads > 0, "the case must be exercised"
    tier_hits = stats.external_prefix_cache_hits
    assert metric(page, "vllm:external_prefix_cache_hits_total") == tier_hits > 0
    assert metric(page, "vllm:prefix_cache_hits_total") == stats.cached_tokens - tier_hits
    assert metric(page, "vllm:prefix_cache_queries_total") == stats.prompt_tokens
    loaded = metric(page, "vllm:kv_offload_total_bytes_total", transfer_type="tier_to_pool")
    assert loaded == stats.kv_offload_bytes_loaded > 0
