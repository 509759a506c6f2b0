"""step14_10's second tier at a real size (``smollm2-135m``'s shapes, seeded random weights):
what a block costs loaded from the tier against computed, and what the write-through costs
the engine's rounds.

    python -m pytest bench/suites/test_tier.py --benchmark-columns=median,min,max,rounds

- ``test_block``: ``n`` blocks (1, or 32: a 512-token prompt) computed, as one chunk through the
  model's forward (the lone block at the end of a 512-token context), or loaded: the whole
  path from a host tier (``KVOffload.lookup``: the tier's get, the entry's decoding and its
  checks; then ``load``: the copy into the pool), or the copy alone. And ``store``: what a round
  pays to write blocks through (the copy out of the pool; the writer thread does the rest).
  Per block: the median over ``n`` (``extra_info["blocks"]``).
- ``test_rounds_tier_off_and_on``: the same requests (distinct prompts: every block they fill
  is written through) through a fresh engine with the tier off and one with it on (host
  memory), in turn; ``extra_info`` gives the median prefill round and decode round of each.

When the benchmarks are disabled (CI runs the suites as tests), the same cases run once on the
small ``bench`` preset: they check the code and time nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import cache

import pytest
import torch

from common.config import ModelConfig, preset
from common.hashing import hash_prefix_blocks
from common.kv_offload import KVOffload
from common.kv_tiers import GIB, HostTier
from front.steps import available_steps, load_step

STEP = "step14_10"
BLOCKS = (1, 32)  # a block; a 512-token prompt's
OPS = ("compute", "load (tier get + decode + copy)", "load (copy)", "store (copy out)")
ROUND_REQUESTS, ROUND_PROMPT, ROUND_NEW = 8, 128, 8  # 64 blocks written through


@pytest.fixture(scope="module")
def cfg(request: pytest.FixtureRequest) -> ModelConfig:
    if STEP not in available_steps():
        pytest.skip(f"{STEP} does not exist yet")
    name = "bench" if request.config.getoption("benchmark_disable") else "smollm2-135m"
    return preset(name, block_size=16, total_blocks=2 * 32 + 8)


@cache
def model_of(cfg: ModelConfig) -> torch.nn.Module:
    return load_step(STEP).TinyTransformerPaged(cfg)


def tokens(n: int, cfg: ModelConfig, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()


def stored_offload(model: torch.nn.Module, ids: list[int]) -> tuple[KVOffload, list[int]]:
    """A host tier holding the blocks of ``ids`` (pool blocks 0 ... n-1, random K/V), written
    through and flushed; and their chain hashes."""
    bs, n = model.cfg.block_size, len(ids) // model.cfg.block_size
    for i, pool in enumerate((model.kv_pool_k, model.kv_pool_v)):
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(i)))
    hashes = hash_prefix_blocks(ids, bs)
    parents = [None, *hashes[:-1]]
    blocks = [(hashes[i], parents[i], tuple(ids[i * bs : (i + 1) * bs]), i) for i in range(n)]
    offload = KVOffload(HostTier(GIB), model)
    offload.store(blocks)
    offload.flush()
    return offload, hashes


def block_call(model: torch.nn.Module, op: str, n: int) -> Callable[[], object]:
    """One timed call of ``op`` on ``n`` blocks."""
    cfg, bs = model.cfg, model.cfg.block_size
    ids = tokens(32 * bs, cfg)
    if op == "compute":  # n blocks as one chunk: the last n blocks of a 512-token context
        start = (32 - n) * bs
        table = list(range(32))
        return lambda: model.forward(ids[start:], table, start)
    offload, hashes = stored_offload(model, ids)
    chunk, free = ids[: n * bs], list(range(32, 32 + n))  # loaded into other pool blocks
    entries = offload.lookup(hashes[:n], chunk, None, limit=n)
    assert len(entries) == n
    if op == "load (copy)":
        return lambda: offload.load(entries, free)
    return lambda: offload.load(offload.lookup(hashes[:n], chunk, None, limit=n), free)


@pytest.mark.parametrize("n", BLOCKS, ids=[f"{n}-blocks" for n in BLOCKS])
@pytest.mark.parametrize("op", OPS)
def test_block(benchmark, cfg: ModelConfig, op: str, n: int) -> None:
    model = model_of(cfg)
    benchmark.group = f"{n} block(s), {cfg.num_layers} layers of {cfg.d_model}"
    benchmark.extra_info["blocks"] = n
    rounds = 5 if op == "compute" else 50
    with torch.inference_mode():
        if op != "store (copy out)":
            benchmark.pedantic(block_call(model, op, n), rounds=rounds, warmup_rounds=1)
            return
        # A fresh KVOffload each call (made untimed), so every call copies its blocks out; the
        # writer threads of the calls before it still encode and put beside it, as in a server.
        ids, bs = tokens(n * cfg.block_size, cfg), cfg.block_size
        hashes = hash_prefix_blocks(ids, bs)
        blocks = [(hashes[i], None, tuple(ids[i * bs : (i + 1) * bs]), i) for i in range(n)]

        def fresh() -> tuple[tuple, dict]:
            return (KVOffload(HostTier(GIB), model),), {}

        benchmark.pedantic(lambda offload: offload.store(blocks), setup=fresh, rounds=rounds)


def test_a_loaded_block_is_the_computed_one(cfg: ModelConfig) -> None:
    """The load benchmarks move the bytes the store took: a block out of the tier is the one
    written through, bit for bit."""
    model = model_of(cfg)
    ids = tokens(4 * cfg.block_size, cfg)
    with torch.inference_mode():
        offload, hashes = stored_offload(model, ids)
        before = model.kv_pool_k[:, :4].clone(), model.kv_pool_v[:, :4].clone()
        offload.load(offload.lookup(hashes, ids, None, limit=4), [40, 41, 42, 43])
        assert torch.equal(model.kv_pool_k[:, 40:44], before[0])
        assert torch.equal(model.kv_pool_v[:, 40:44], before[1])


def test_rounds_tier_off_and_on(benchmark, cfg: ModelConfig) -> None:
    """A round with the tier on pays the copy out of the pool for the blocks it filled; the
    encoding and the put run on the writer thread beside the next rounds. Each call serves the
    requests twice, through a fresh engine with the tier off and one with it on, in turn (which
    goes first alternates), round by round: on a shared machine both see the same moment.
    ``extra_info``: the median round of each kind over every call, each tier: a prefill round
    (it computes prompt tokens, and with the tier on writes 32 blocks through) and a decode
    round (it writes none)."""
    model = model_of(cfg)
    step = load_step(STEP)
    prompts = [tokens(ROUND_PROMPT, cfg, seed=1 + i) for i in range(ROUND_REQUESTS)]
    times: dict[tuple[str, str], list[float]] = {}
    stores: list[int] = []

    def serve(tier: str) -> None:
        backend = {"kv_offloading_backend": HostTier(GIB)} if tier == "on" else {}
        engine = step.PagedPrefixCacheEngine(model, max_running=ROUND_REQUESTS, **backend)
        for prompt in prompts:
            engine.add_request(prompt, ROUND_NEW)
        while engine.has_work:
            computed = engine.stats.computed_prefill_tokens
            start = time.perf_counter()
            engine.step()
            kind = "prefill" if engine.stats.computed_prefill_tokens > computed else "decode"
            times.setdefault((tier, kind), []).append(time.perf_counter() - start)
        if engine.kv_cache_manager.offload is not None:
            engine.kv_cache_manager.offload.flush()  # between the engines, untimed
            stores.append(engine.stats.kv_offload_stores)

    def both() -> None:
        order = ("off", "on") if len(stores) % 2 == 0 else ("on", "off")
        for tier in order:
            serve(tier)

    benchmark.group = f"rounds, {ROUND_REQUESTS} requests of {ROUND_PROMPT} tokens"
    benchmark.pedantic(both, rounds=6, iterations=1)
    for (tier, kind), seconds in sorted(times.items()):
        benchmark.extra_info[f"{kind}_round_ms_tier_{tier}"] = round(
            statistics.median(seconds) * 1000, 1
        )
    blocks = ROUND_REQUESTS * ROUND_PROMPT // cfg.block_size
    assert stores and set(stores) == {blocks}  # every prompt block written through, once
