"""Every shared block is computed once, in every step, batched or not.

A sequence adopts cached blocks whenever its prefill reaches them, so requests that start
together leapfrog through a common prefix; full output blocks are cached too, so a follow-up turn
reuses the whole conversation. Batching may change speed, never sharing: every step reports the
same ``EngineStats`` on the same requests, and the tokens are always the dense reference's.
(From step14_9 on, a prefill chunk is as long as the round's token budget allows, so fewer
rounds run and the first request behind a new prefix computes it alone: ``ROUND_FIGURES`` differ,
every other figure is the same.)
"""

from __future__ import annotations

from dataclasses import asdict
from functools import cache
from types import ModuleType

import pytest

from common.numbers import cdiv
from front.steps import load_step
from front.workload import demo_prompts, shared_prefix_prompts
from tests.helpers import (
    EngineFactory,
    budget_args,
    has_fix,
    reference_tokens,
    same_work_figures,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size


def count_model_tokens(model) -> list[int]:
    """Wrap the model's entry points on this instance; the list's one item counts every token
    that goes through a forward pass (the engine's own counters are not trusted here)."""
    counted = [0]

    def wrap(name: str) -> None:
        real = getattr(model, name)

        def counting(chunks, *args, **kwargs):
            flat = chunks if name == "forward" else [t for chunk in chunks for t in chunk]
            counted[0] += len(flat)
            return real(chunks, *args, **kwargs)

        setattr(model, name, counting)

    wrap("forward")
    if hasattr(model, "forward_batched"):
        wrap("forward_batched")
    return counted


def check_counters(stats, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """What the counters must say, from the requests alone: every prompt token is adopted or
    computed, and every generated token but the last is fed back once."""
    assert stats.requests == len(prompts)
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.cached_tokens + stats.computed_prefill_tokens == stats.prompt_tokens
    assert stats.computed_decode_tokens == sum(len(o) - 1 for o in outputs)
    assert stats.computed_tokens == stats.computed_prefill_tokens + stats.computed_decode_tokens


# ---- leapfrogging: a prefix nobody has cached, shared by requests that start together -----


@pytest.mark.parametrize("num_requests", [2, 3, 8])
@pytest.mark.parametrize("tail", [1, BS])
def test_requests_admitted_together_compute_each_shared_block_once(
    step: ModuleType, make_engine: EngineFactory, num_requests: int, tail: int
) -> None:
    """N requests behind a 5-block prefix, all admitted in the first round: the model sees the
    prefix once plus every request's own tail, and every request hits (even the first, which
    adopts the blocks the others computed while it computed block 0).

    From step14_9 on, under a budget of 3 blocks a round: the first computes blocks 0-2, then
    3-4 and its tail, and the next ones, admitted as the budget allows, adopt all five (two of
    them registered by the first's chunk earlier in the same round); the first hits nothing."""
    prefix_blocks, max_new = 5, 3
    prompts = shared_prefix_prompts(num_requests, prefix_blocks * BS, tail, CFG.vocab_size, seed=3)
    engine = make_engine(CFG, max_running=num_requests, **budget_args(step, 3 * BS))
    counted = count_model_tokens(engine.model)
    outputs = engine.generate(prompts, max_new)
    assert outputs == reference_tokens(CFG, prompts, max_new)
    prefill = prefix_blocks * BS + num_requests * tail
    assert counted[0] == prefill + num_requests * (max_new - 1)
    stats = engine.stats
    check_counters(stats, prompts, outputs)
    assert stats.computed_prefill_tokens == prefill
    assert stats.cached_tokens == (num_requests - 1) * prefix_blocks * BS
    # each adopts blocks the others computed; from step14_9 on, all but the first
    assert stats.requests_hit == num_requests - has_fix(step, "step14_9")
    own_blocks = cdiv(prefix_blocks * BS + tail + max_new - 1, BS) - prefix_blocks
    all_at_once = prefix_blocks + num_requests * own_blocks  # the prefix once
    if has_fix(step, "step14_9"):  # the budget staggers the later requests' starts
        assert prefix_blocks + own_blocks < stats.blocks_peak <= all_at_once
    else:
        assert stats.blocks_peak == all_at_once


def test_without_the_cache_every_request_holds_its_own_prefix(make_engine: EngineFactory) -> None:
    """The control for the memory figure: the same requests with the cache off hold N copies."""
    prompts = shared_prefix_prompts(3, 5 * BS, 2, CFG.vocab_size, seed=3)
    engine = make_engine(CFG, max_running=3, enable_prefix_cache=False)
    assert engine.generate(prompts, 3) == reference_tokens(CFG, prompts, 3)
    assert engine.stats.blocks_peak == 3 * cdiv(5 * BS + 2 + 3 - 1, BS)
    assert engine.stats.computed_prefill_tokens == 3 * (5 * BS + 2)


def test_leapfrogging_finishes_the_shared_prefill_in_fewer_rounds(
    step: ModuleType, make_engine: EngineFactory
) -> None:
    """Two requests behind an 8-block prefix: alone, one needs 9 prefill rounds; together they
    split the prefix and both produce their first token after 5 rounds (4 blocks each + tail).

    From step14_9 on, under a budget of 2 blocks a round, one alone needs 5 rounds (2 blocks a
    round, then its last token): the second costs no round more, since in the fifth it adopts
    the whole prefix and computes only its own token beside the first's last one."""
    prompts = shared_prefix_prompts(2, 8 * BS, 1, CFG.vocab_size, seed=4)
    engine = make_engine(CFG, max_running=2, **budget_args(step, 2 * BS))
    ids = [engine.add_request(p, 2) for p in prompts]
    engine.step()
    rounds = 1
    while not all(s.generated_ids for s in engine.scheduler.running):
        engine.step()
        rounds += 1
    assert rounds == 5
    while engine.has_work:
        engine.step()
    assert [engine.pop_output(i) for i in ids] == reference_tokens(CFG, prompts, 2)


# ---- output blocks are cached: a conversation's next turn -----------------------------------


@pytest.mark.parametrize(
    ("first_len", "max_new"),
    [(10, 9), (3 * BS, BS + 1), (2 * BS + 1, 2 * BS - 1), (1, 3)],
    ids=["mid-block", "prompt-aligned", "history-aligned", "one-token"],
)
def test_second_turn_reuses_prompt_and_output(
    make_engine: EngineFactory, first_len: int, max_new: int
) -> None:
    """Turn two's prompt is turn one's prompt + output + a new message: every full block of
    the history (all of it but the last generated token, which was never fed back) is a hit."""
    first, message = tokens(first_len, first_len), tokens(-1, 5)
    engine = make_engine(CFG)
    (answer,) = engine.generate([first], max_new)
    history = first + answer + message
    engine.reset_stats()
    (second,) = engine.generate([history], max_new)
    assert second == reference_tokens(CFG, [history], max_new)[0]
    full_history_blocks = (len(first) + len(answer) - 1) // BS
    assert engine.stats.cached_tokens == full_history_blocks * BS
    assert engine.stats.requests_hit == (full_history_blocks > 0)


def test_output_block_is_not_cached_before_it_is_full(make_engine: EngineFactory) -> None:
    """Only full blocks are named: a block still waiting for slots is never in the cache."""
    engine = make_engine(CFG)
    engine.generate([[1] * (BS - 1)], 1)  # KV for BS-1 tokens: no block is full
    assert engine.stats.blocks_cached == 0
    engine.generate([[2] * (BS - 1)], 2)  # the first output token completes block 0
    assert engine.stats.blocks_cached == 1


# ---- the same stats in every step -----------------------------------------------------------


def multi_turn(engine, max_new: int = 5) -> list[list[int]]:
    """Three conversations, two turns each, all turns of a round batched together."""
    firsts = shared_prefix_prompts(3, 2 * BS, 3, CFG.vocab_size, seed=9)
    answers = engine.generate(firsts, max_new)
    seconds = [f + a + [7, 8, 9] for f, a in zip(firsts, answers)]
    return answers + engine.generate(seconds, max_new)


def tight_pool(engine) -> list[list[int]]:
    prompts = shared_prefix_prompts(6, 3 * BS, 5, CFG.vocab_size, seed=10)
    prompts += shared_prefix_prompts(4, 2 * BS, 2, CFG.vocab_size, seed=11)
    return engine.generate(prompts, 4)


def showcase(engine) -> list[list[int]]:
    """The showcase's shape at a test's size: 16 requests, an 8-block prefix, 8 running."""
    return engine.generate(shared_prefix_prompts(16, 8 * BS, BS, CFG.vocab_size, seed=12), 4)


def early_eos(engine) -> list[list[int]]:
    """Requests that stop at an eos part-way: they never take the blocks they did not need, and
    their partly filled output blocks are never cached. The eos is a token the reference
    produces, so that some requests really do stop early."""
    prompts = shared_prefix_prompts(6, 2 * BS + 1, 3, CFG.vocab_size, seed=13)
    eos = reference_tokens(CFG, prompts[:1], 3)[0][2]
    outputs = engine.generate(prompts, 2 * BS, eos_token_id=eos)
    assert outputs == reference_tokens(CFG, prompts, 2 * BS, eos_token_id=eos)
    assert min(map(len, outputs)) < 2 * BS
    return outputs


def demo(engine) -> list[list[int]]:
    prompts = demo_prompts(CFG.vocab_size, block_size=BS)
    return engine.generate_serial(prompts, 4) + engine.generate_serial(prompts, 4)


def demo_batched(engine) -> list[list[int]]:
    return engine.generate(demo_prompts(CFG.vocab_size, block_size=BS), 4)


WORKLOADS = {
    "demo": (demo, {}),
    "demo-batched": (demo_batched, {}),
    "showcase": (showcase, {"max_running": 8}),
    "multi-turn": (multi_turn, {}),
    "tight-pool": (tight_pool, {"cfg": tiny_config(total_blocks=12), "max_running": 3}),
    "early-eos": (early_eos, {"cfg": tiny_config(total_blocks=24), "max_running": 6}),
}


def run_workload(step: ModuleType, name: str) -> tuple[list[list[int]], dict]:
    run, options = WORKLOADS[name]
    model = step.TinyTransformerPaged(options.get("cfg", CFG))
    engine = step.PagedPrefixCacheEngine(model, max_running=options.get("max_running", 4))
    outputs = run(engine)
    assert engine.ref_count_problems() == []
    return outputs, asdict(engine.stats)


@cache
def baseline(name: str) -> tuple[list[list[int]], dict]:
    """step14's tokens and stats: the figures every later step must reproduce exactly."""
    return run_workload(load_step("step14"), name)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_step_reports_the_same_stats(step: ModuleType, name: str) -> None:
    outputs, stats = run_workload(step, name)
    step14_outputs, step14_stats = baseline(name)
    assert outputs == step14_outputs
    assert same_work_figures(stats, step) == same_work_figures(step14_stats, step)
    assert stats["computed_decode_tokens"] > 0


def test_showcase_reuses_every_shared_block(step: ModuleType) -> None:
    """The showcase's shape reuses the maximum: 15 of 16 requests' prefix tokens (every one
    hits; from step14_9 on the first computes the prefix alone, and the 15 others hit)."""
    _, stats = run_workload(step, "showcase")
    assert stats["cached_tokens"] == 15 * 8 * BS
    assert stats["computed_prefill_tokens"] == 8 * BS + 16 * BS
    assert stats["requests_hit"] == 16 - has_fix(step, "step14_9")
