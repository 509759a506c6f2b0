"""End to end: the same shared-prefix workload through every step's engine.

    python -m pytest bench/suites/test_e2e.py --benchmark-columns=median,rounds \
        --benchmark-sort=name

Each round serves all requests through a fresh engine, with continuous batching: a cold cache
(group "end to end"), or one that an earlier request behind the same prefix has warmed, as on a
server that has seen traffic (group "end to end, warm prefix"; the warm-up is not timed).
Group "memory pressure" serves ``python -m bench --workload pressure``'s requests: short
answers, each stopping at its own eos, asked with a long max_new_tokens in a small pool.
"""

from __future__ import annotations

from functools import cache

import pytest

from bench.batch import BatchRunner
from bench.models import bench_config, load_step_model
from bench.reference import Reference
from bench.workloads.pressure import Pressure
from bench.workloads.shared_prefix import SharedPrefix
from common.config import preset
from common.reference import ReferenceModel, reference_generate
from front.steps import available_steps, load_step
from front.workload import PRESSURE_EOS_AT, shared_prefix_prompts

WORKLOAD = SharedPrefix(
    num_requests=8, prefix_len=128, tail_len=16, max_new_tokens=16, max_running=8
)
CFG = bench_config(WORKLOAD)


@cache
def expected_tokens() -> list[list[int]]:
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    return reference_generate(ReferenceModel(CFG), prompts, WORKLOAD.max_new_tokens)


@pytest.mark.parametrize("step_name", available_steps())
def test_end_to_end(benchmark, step_name: str) -> None:
    runner = BatchRunner(load_step_model(step_name, CFG))
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    benchmark.group = "end to end"
    result = benchmark.pedantic(runner.run, args=(prompts, WORKLOAD), rounds=3, iterations=1)
    benchmark.extra_info["cached_tokens"] = result.cached_tokens
    assert result.outputs == expected_tokens()


@pytest.mark.parametrize("step_name", available_steps())
def test_end_to_end_warm_prefix(benchmark, step_name: str) -> None:
    """The same requests after one earlier request put the shared prefix in the cache: each
    round gets a fresh engine and its own warm-up (``setup``, untimed), then the timed serve."""
    runner = BatchRunner(load_step_model(step_name, CFG))
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    earlier = WORKLOAD.earlier_prompt(CFG.vocab_size)

    def warm_engine() -> tuple[tuple, dict]:
        return (runner.engine(WORKLOAD, earlier_prompt=earlier), prompts, WORKLOAD), {}

    benchmark.group = "end to end, warm prefix"
    result = benchmark.pedantic(runner.serve, setup=warm_engine, rounds=3, iterations=1)
    benchmark.extra_info["cached_tokens"] = result.cached_tokens
    assert result.outputs == expected_tokens()
    assert result.cached_tokens == WORKLOAD.num_requests * WORKLOAD.prefix_len  # whole prefix


HASH_PAIR = ("step14_4", "step14_5")
LONG_PROMPT_BLOCKS = 256


@pytest.mark.parametrize("step_name", [s for s in HASH_PAIR if s in available_steps()])
def test_long_prompt_hashing(benchmark, step_name: str) -> None:
    """step14_5's fix in isolation: one cold 4096-token prompt through the tiny model, where
    re-hashing the chain for every block (O(n^2) links) is a visible part of the request."""
    cfg = preset("tiny", block_size=16, total_blocks=LONG_PROMPT_BLOCKS + 2)
    step = load_step(step_name)
    model = step.TinyTransformerPaged(cfg)
    prompt = shared_prefix_prompts(1, LONG_PROMPT_BLOCKS * 16, 0, cfg.vocab_size)[0]
    benchmark.group = "long prompt, cold cache"

    def serve() -> list[list[int]]:
        return step.PagedPrefixCacheEngine(model).generate([prompt], 1)

    outputs = benchmark.pedantic(serve, rounds=3, iterations=1)
    assert outputs == reference_generate(reference_model_for(cfg), [prompt], 1)


@cache
def reference_model_for(cfg) -> ReferenceModel:
    return ReferenceModel(cfg)


PRESSURE = Pressure()  # 24 short prompts, max_new_tokens=64, 48 blocks, 8 at a time
PRESSURE_CFG = bench_config(PRESSURE, "demo", block_size=4)  # python -m bench's model


@cache
def pressure_requests() -> tuple[Pressure, list[list[int]], list[list[int]]]:
    """The workload with one eos per request (a token of the reference's own answer, as the
    bench picks it), its prompts, and the reference's tokens, each stopped at its eos."""
    reference, prompts = Reference(PRESSURE_CFG, None), PRESSURE.prompts(PRESSURE_CFG.vocab_size)
    workload = PRESSURE.with_eos(reference.tokens(prompts, PRESSURE_EOS_AT[1] + 1))
    return workload, prompts, reference.tokens(prompts, workload.max_new_tokens, workload.eos)


@pytest.mark.parametrize("step_name", available_steps())
def test_memory_pressure(benchmark, step_name: str) -> None:
    """Memory on demand in a pool where reserving each request's worst case would run two at
    a time: at least four per round on average, the reference's tokens."""
    workload, prompts, expected = pressure_requests()
    runner = BatchRunner(load_step_model(step_name, PRESSURE_CFG))
    benchmark.group = "memory pressure"
    result = benchmark.pedantic(runner.run, args=(prompts, workload), rounds=3, iterations=1)
    benchmark.extra_info["seqs_per_round"] = result.seqs_per_round
    benchmark.extra_info["preemptions"] = result.preemptions
    assert result.outputs == expected
    assert result.seqs_per_round >= 4
