"""Random scenarios: hundreds of seeded workloads, every step against the dense reference.

Each seed draws a whole scenario — prompts with shared prefixes, block size, a pool from barely
enough to roomy, max_running, max_new_tokens, cache on or off, batched or serial, sometimes a
second (hot) round on the same engine — so that combinations nobody thought to write by hand
(one-token prompts, full-prompt hits, evictions mid-run, exact block multiples) are covered.
The reference for a seed is computed once and shared by every step, and so are step14's
``EngineStats``: every later step must report exactly the same figures (batching changes speed,
never sharing).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from functools import cache
from types import ModuleType

import pytest

from common.config import ModelConfig
from common.steps import load_step
from common.workload import random_shared_prefix_prompts
from tests.conftest import (
    STEP_NAMES,
    EngineFactory,
    blocks_needed,
    reference_tokens,
    tiny_config,
)

# At least 300 scenarios in all, however many steps exist (ceil(320 / 8) = 40 per step).
SEEDS_PER_STEP = math.ceil(320 / len(STEP_NAMES))


@dataclass(frozen=True)
class Scenario:
    prompts: tuple[tuple[int, ...], ...]
    block_size: int
    total_blocks: int
    max_running: int
    max_new_tokens: int
    enable_prefix_cache: bool
    serial: bool
    hot_round: bool

    @property
    def cfg(self) -> ModelConfig:
        return tiny_config(block_size=self.block_size, total_blocks=self.total_blocks)

    @property
    def prompt_lists(self) -> list[list[int]]:
        return [list(p) for p in self.prompts]


def draw_pool(rng: random.Random, needs: list[int]) -> int:
    """From the smallest legal pool (the largest request alone) to one where all fit at once."""
    smallest, roomy = max(needs), sum(needs) + 2
    return rng.choice([smallest, rng.randint(smallest, roomy), roomy])


@cache
def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    vocab = tiny_config().vocab_size
    prompts = random_shared_prefix_prompts(rng, vocab, max_prompts=6, max_prefix=20, max_tail=8)
    block_size, max_new = rng.randint(1, 8), rng.randint(1, 8)
    needs = [blocks_needed(len(p), max_new, block_size) for p in prompts]
    return Scenario(
        prompts=tuple(tuple(p) for p in prompts),
        block_size=block_size,
        total_blocks=draw_pool(rng, needs),
        max_running=rng.randint(1, 6),
        max_new_tokens=max_new,
        enable_prefix_cache=rng.random() < 0.8,
        serial=rng.random() < 0.25,
        hot_round=rng.random() < 0.4,
    )


@cache
def expected_tokens(seed: int) -> tuple[tuple[int, ...], ...]:
    """The oracle's tokens for a seed, computed once however many steps run it."""
    case = scenario(seed)
    outputs = reference_tokens(case.cfg, case.prompt_lists, case.max_new_tokens)
    return tuple(tuple(o) for o in outputs)


def run_round(engine, case: Scenario) -> list[list[int]]:
    run = engine.generate_serial if case.serial else engine.generate
    return run(case.prompt_lists, case.max_new_tokens)


def new_engine(step: ModuleType, case: Scenario):
    return step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(case.cfg),
        max_running=case.max_running,
        enable_prefix_cache=case.enable_prefix_cache,
    )


@cache
def step14_stats(seed: int) -> tuple[dict, ...]:
    """step14's stats after each round of a seed's scenario: what every step must report."""
    case = scenario(seed)
    engine = new_engine(load_step("step14"), case)
    rounds = []
    for _ in range(2 if case.hot_round else 1):
        run_round(engine, case)
        rounds.append(asdict(engine.stats))
    return tuple(rounds)


def assert_stats_consistent(engine, case: Scenario, rounds: int, outputs: list[list[int]]) -> None:
    """Counters add up, the engine is at rest, and a disabled cache never claims a hit."""
    stats, prompts = engine.stats, case.prompt_lists
    assert stats.requests == rounds * len(prompts)
    assert stats.prompt_tokens == rounds * sum(len(p) for p in prompts)
    assert 0 <= stats.cached_tokens < stats.prompt_tokens  # the last token is always computed
    assert stats.cached_tokens + stats.computed_prefill_tokens == stats.prompt_tokens
    assert stats.computed_decode_tokens == rounds * sum(len(o) - 1 for o in outputs)
    assert stats.requests_hit <= stats.requests
    assert stats.blocks_used == 0
    assert stats.blocks_free + stats.blocks_cached == case.total_blocks
    assert engine.ref_count_problems() == []
    if not case.enable_prefix_cache:
        assert stats.requests_hit == stats.cached_tokens == stats.blocks_cached == 0


@pytest.mark.parametrize("seed", range(SEEDS_PER_STEP))
def test_random_scenario_matches_reference(make_engine: EngineFactory, seed: int) -> None:
    """Whatever the memory, batching and cache settings, the tokens are the reference's."""
    case = scenario(seed)
    engine = make_engine(
        case.cfg, max_running=case.max_running, enable_prefix_cache=case.enable_prefix_cache
    )
    expected = [list(o) for o in expected_tokens(seed)]
    assert run_round(engine, case) == expected
    stats = [asdict(engine.stats)]
    if case.hot_round:
        hits_before = engine.stats.requests_hit
        assert run_round(engine, case) == expected
        stats.append(asdict(engine.stats))
        assert_hot_round_hits(engine, case, engine.stats.requests_hit - hits_before)
    assert_stats_consistent(engine, case, len(stats), expected)
    assert tuple(stats) == step14_stats(seed)


def assert_hot_round_hits(engine, case: Scenario, hot_hits: int) -> None:
    """Without eviction, every prompt longer than a block finds at least its first block in the
    cache on the second round (whoever computed it first in round one stored it)."""
    if not case.enable_prefix_cache:
        assert hot_hits == 0
    elif engine.stats.evictions == 0:
        assert hot_hits == sum(len(p) > case.block_size for p in case.prompts)
