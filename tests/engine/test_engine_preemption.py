"""Preemption by recompute (vLLM v1's way): what happens when a running request finds no block.

It preempts the most recently admitted request (maybe itself), which gives every block back,
keeps its tokens, returns to the front of the queue and later prefills prompt + output again.
These tests hold the engine to it: the same tokens as the dense reference under any amount of
preemption, the same figures in every step, the victim always the youngest, the oldest always
progressing (every request finishes), no block lost, and no cached block whose KV was never
written.

Admission (by the first chunk, first come first served, nobody in a round that preempted) and
allocation on demand are in ``test_engine_memory.py``.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import cache

import pytest

from common.inputs import blocks_for_request
from common.status import SequenceStatus
from front.steps import load_step
from tests.helpers import (
    EngineFactory,
    guard_against_hangs,
    has_fix,
    reference_tokens,
    tiny_config,
    tokens,
)

BS = 4


# (pool blocks, max_running, prompts, max_new_tokens, eos picked from the reference or None)
SCENARIOS = {
    # long and short answers behind a shared prefix, a pool for about two of them
    "shared-prefix": (8, 4, [tokens(1, 8) + tokens(10 + i, 1 + i) for i in range(5)], 9, None),
    # unrelated prompts, the pool barely above the largest request
    "distinct": (6, 3, [tokens(20 + i, 3 + 2 * i) for i in range(4)], 10, None),
    # everyone may run, memory decides; eos ends some answers early
    "eos": (7, 8, [tokens(40 + i, 5) for i in range(6)], 12, 6),
    # one request at a time preempts nobody, however small the pool
    "serial": (5, 1, [tokens(60 + i, 6) for i in range(3)], 12, None),
}


def eos_for(cfg, prompts: list[list[int]], position: int | None) -> int | None:
    """A token the reference really produces at ``position`` of the first answer, so that some
    requests stop early."""
    if position is None:
        return None
    return reference_tokens(cfg, prompts[:1], position + 1)[0][position]


def run_scenario(step_name: str, name: str) -> tuple[list[list[int]], dict, list[str]]:
    total, max_running, prompts, max_new, eos_at = SCENARIOS[name]
    cfg = tiny_config(block_size=BS, total_blocks=total)
    step = load_step(step_name)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=max_running)
    guard_against_hangs(engine)
    outputs = engine.generate(prompts, max_new, eos_for(cfg, prompts, eos_at))
    return outputs, asdict(engine.stats), engine.ref_count_problems()


@cache
def step14_run(name: str) -> tuple[list[list[int]], dict, list[str]]:
    return run_scenario("step14", name)


def reference_for(name: str) -> list[list[int]]:
    total, _, prompts, max_new, eos_at = SCENARIOS[name]
    cfg = tiny_config(block_size=BS, total_blocks=total)
    eos = eos_for(cfg, prompts, eos_at)
    full = reference_tokens(cfg, prompts, max_new, eos)
    return full


@pytest.mark.parametrize("name", SCENARIOS)
def test_preemption_loses_nothing_and_changes_nothing(step, name: str) -> None:
    """Tokens equal the dense reference; the pool is sane at rest; every step reports exactly
    step14's figures, preemptions included (up to step14_8: step14_9's longer chunks take their
    blocks sooner, so who is preempted when, and what is recomputed, differ); and the scenario
    really preempts (except the one that runs one request at a time, which must never)."""
    outputs, stats, problems = run_scenario(step.__name__, name)
    assert outputs == reference_for(name)
    assert problems == []
    prompts = SCENARIOS[name][2]  # a resumed request is not a new one
    assert (stats["requests"], stats["prompt_tokens"]) == (len(prompts), sum(map(len, prompts)))
    assert stats["cached_tokens"] <= stats["prompt_tokens"]
    if not has_fix(step, "step14_9"):
        assert stats == step14_run(name)[1]
    if name == "serial":
        assert stats["preemptions"] == 0
    else:
        assert stats["preemptions"] > 0
        assert stats["resumed_cached_tokens"] > 0 or name == "distinct"


def seq_of(queue, request_id: int):
    (seq,) = [s for s in queue if s.seq_id == request_id]
    return seq


def test_the_youngest_running_request_is_preempted(make_engine: EngineFactory) -> None:
    """Three requests admitted in order A, B, C fill the pool while D waits; when A needs a
    block, C (the most recently admitted) goes back to the front of the queue, ahead of D,
    with its blocks freed and its tokens kept, while A and B keep theirs."""
    cfg = tiny_config(block_size=BS, total_blocks=6)
    engine = make_engine(cfg, max_running=3)
    prompts = [tokens(80 + i, 2 * BS - 1) for i in range(4)]  # two blocks each, a slot free
    ids = [engine.add_request(p, 6) for p in prompts]
    while engine.stats.preemptions == 0:
        tables_before = {s.seq_id: list(s.block_table) for s in engine.scheduler.running}
        engine.step()
    running = [s.seq_id for s in engine.scheduler.running]
    victim = seq_of(engine.scheduler.waiting, ids[2])
    assert running == ids[:2]
    assert list(engine.scheduler.waiting) == [victim, seq_of(engine.scheduler.waiting, ids[3])]
    assert victim.status is SequenceStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.block_table == [] and victim.prefill_offset == 0
    assert len(victim.generated_ids) >= 1, "a preempted request keeps what it generated"
    for seq in engine.scheduler.running:  # the older ones kept every block they had
        assert seq.block_table[: len(tables_before[seq.seq_id])] == tables_before[seq.seq_id]
    while engine.has_work:
        engine.step()
    want = reference_tokens(cfg, prompts, 6)
    assert [engine.pop_output(i) for i in ids] == want


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
def test_the_oldest_request_always_progresses(
    make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """A pool that holds exactly the largest request, everyone allowed to run: requests are
    preempted over and over, yet each finishes (make_engine fails a run that never ends) with
    the reference's tokens, cache on or off."""
    prompts = [tokens(110 + i, 3 + 3 * i) for i in range(5)]
    max_new = 7
    largest = max(blocks_for_request(len(p), max_new, BS) for p in prompts)
    cfg = tiny_config(block_size=BS, total_blocks=largest)
    engine = make_engine(cfg, max_running=5, enable_prefix_cache=enable_prefix_cache)
    assert engine.generate(prompts, max_new) == reference_tokens(cfg, prompts, max_new)
    assert engine.stats.preemptions > 0


def test_every_block_cached_in_a_round_was_written_in_it(step) -> None:
    """The trap of registering blocks before the forward pass (step14_7): a sequence preempted
    after its chunk was registered would leave a cached block whose KV is never written, and a
    later request would adopt garbage. In every step, every block that enters the cache in a
    round is in the block table of a sequence the model ran in that round."""
    cfg = tiny_config(block_size=BS, total_blocks=7)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=4)
    guard_against_hangs(engine)
    written: set[int] = set()
    model = engine.model
    real_forward, real_batched = model.forward, getattr(model, "forward_batched", None)

    def forward(chunk, block_table, start_pos):
        written.update(block_table)
        return real_forward(chunk, block_table, start_pos)

    def forward_batched(chunks, block_tables, start_positions, *shared, **rows):  # 14_8: shared
        written.update(b for table in block_tables for b in table)
        return real_batched(chunks, block_tables, start_positions, *shared, **rows)

    model.forward = forward
    if real_batched is not None:
        model.forward_batched = forward_batched
    cache = engine.kv_cache_manager.prefix_cache
    prompts = [tokens(300, 6) + tokens(310 + i, 1 + i) for i in range(5)]
    for p in prompts:
        engine.add_request(p, 9)
    while engine.has_work:
        before = {b for b in range(cfg.total_blocks) if b in cache}
        written.clear()
        engine.step()
        new = {b for b in range(cfg.total_blocks) if b in cache} - before
        assert new <= written
    assert engine.stats.preemptions > 0
