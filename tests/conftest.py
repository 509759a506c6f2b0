"""Shared fixtures: every test that takes ``step`` runs once per step directory that exists."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from types import ModuleType

import pytest
import torch

from common.config import ModelConfig, preset
from common.reference import ReferenceModel, reference_generate
from common.steps import available_steps, load_step

STEP_NAMES = available_steps()

# The test model is tiny: a second thread only adds synchronisation, and on a busy 2-core
# machine it makes every small matmul wait (100x slower was seen).
torch.set_num_threads(1)


@pytest.fixture(params=STEP_NAMES)
def step(request: pytest.FixtureRequest) -> ModuleType:
    """A step package (``step.PagedPrefixCacheEngine``, ``step.TinyTransformerPaged``, ...)."""
    return load_step(request.param)


def tiny_config(**changes: object) -> ModelConfig:
    """The test model, in float64 unless told otherwise: there parity must be exact."""
    changes.setdefault("dtype", torch.float64)
    return preset("tiny", **changes)


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """A request's whole-life need, as the engine admits it: every token whose KV is written
    (the last generated token is never fed back)."""
    return -(-(prompt_len + max_new_tokens - 1) // block_size)


@cache
def reference_model(cfg: ModelConfig) -> ReferenceModel:
    return ReferenceModel(cfg)


def reference_tokens(
    cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None
) -> list[list[int]]:
    """The oracle's greedy tokens (the reference ignores block_size / total_blocks)."""
    oracle_cfg = cfg.replace(block_size=1, total_blocks=1)
    return reference_generate(reference_model(oracle_cfg), prompts, max_new_tokens, eos_token_id)


EngineFactory = Callable[..., object]

# More rounds than any test's workload needs, by far: an engine past it is stuck (a request that
# is never admitted or never finishes), and the test fails instead of hanging.
MAX_ROUNDS_PER_ENGINE = 5000


def guard_against_hangs(engine: object, max_rounds: int = MAX_ROUNDS_PER_ENGINE) -> None:
    """Make ``engine.step`` (and so ``generate``) fail once the engine has run ``max_rounds``."""
    real_step, rounds = engine.step, [0]

    def step() -> None:
        rounds[0] += 1
        if rounds[0] > max_rounds:
            raise AssertionError(
                f"the engine ran {max_rounds} rounds and still has work: a request is stuck "
                f"(never admitted, or never finishing)"
            )
        real_step()

    engine.step = step


@pytest.fixture
def make_engine(step: ModuleType) -> Iterator[EngineFactory]:
    """``make_engine(cfg=None, max_running=4, enable_prefix_cache=True)`` for this test's step.

    After the test, every engine it made that is at rest must have no leaked block: each block
    free (ref_count 0) or held by the cache alone (ref_count 1), free + cached = total. An engine
    that runs far more rounds than any test needs fails the test instead of hanging it.
    """
    engines = []

    def factory(
        cfg: ModelConfig | None = None, max_running: int = 4, enable_prefix_cache: bool = True
    ):
        model = step.TinyTransformerPaged(cfg or tiny_config())
        engine = step.PagedPrefixCacheEngine(
            model, max_running=max_running, enable_prefix_cache=enable_prefix_cache
        )
        guard_against_hangs(engine)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if not engine.has_work:
            assert engine.ref_count_problems() == []


def assert_engine_matches_reference(
    engine, prompts: list[list[int]], max_new_tokens: int, serial: bool = False
) -> list[list[int]]:
    """Generate with ``engine`` (batched or serial) and compare with the dense reference."""
    run = engine.generate_serial if serial else engine.generate
    outputs = run(prompts, max_new_tokens)
    assert outputs == reference_tokens(engine.model.cfg, prompts, max_new_tokens)
    return outputs
