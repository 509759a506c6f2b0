"""PagedScheduler: who runs each round, and in what order.

The specification: at most ``max_running`` sequences run at once, and as many as can; waiting
requests are admitted first come, first served (the head of the queue is never overtaken); a
round returns the prefilling and the decoding sequences apart, and the engine runs every
prefill chunk of a round before any decode token. The scheduler does no memory operation: it
asks the engine's ``can_admit`` and moves sequences between its queues.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import (
    EngineFactory,
    life_in_rounds,
    log_schedules,
    reference_tokens,
    run_rounds,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size


# ---- max_running, first come first served ---------------------------------------------------


def test_scheduler_runs_max_running_at_most_and_at_least_when_it_can(
    make_engine: EngineFactory,
) -> None:
    """Continuous batching with max_running=3 and a roomy pool: every round runs exactly
    min(3, unfinished requests) sequences, refilled first come, first served as others finish.
    The expected count per round is simulated here from each request's life in rounds."""
    max_running, max_new = 3, 3
    lengths = [9, 1, 5, 13, 4, 7, 2]
    prompts = [tokens(100 + i, n) for i, n in enumerate(lengths)]  # nothing shared
    engine = make_engine(max_running=max_running)
    log = log_schedules(engine)
    assert engine.generate(prompts, max_new) == reference_tokens(CFG, prompts, max_new)

    queue = [(i, life_in_rounds(n, max_new)) for i, n in enumerate(lengths)]
    active: list[tuple[int, int]] = []
    expected = []
    while queue or active:
        while queue and len(active) < max_running:
            active.append(queue.pop(0))
        expected.append(sorted(i for i, _ in active))
        active = [(i, left - 1) for i, left in active if left > 1]
    got = [sorted(prefill + decode) for prefill, decode in log]
    assert got == expected
    assert max(len(ids) for ids in got) == max_running


def test_scheduler_unit_admits_up_to_max_running_in_order(step: ModuleType) -> None:
    """PagedScheduler alone: admission fills the running set to max_running, in arrival order,
    and a finished sequence's place goes to the next in the queue, not to an earlier one."""
    scheduler = step.PagedScheduler(max_running=2)
    seqs = [step.Sequence(i, [1, 2, 3], 4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
        assert seq.status is step.SequenceStatus.WAITING
    prefill, decode = scheduler.schedule()
    assert (prefill, decode) == (seqs[:2], [])
    assert all(s.status is step.SequenceStatus.PREFILLING for s in seqs[:2])
    assert [s.status for s in seqs[2:]] == [step.SequenceStatus.WAITING] * 2
    seqs[0].status = step.SequenceStatus.FINISHED
    seqs[1].status = step.SequenceStatus.RUNNING
    prefill, decode = scheduler.schedule()
    assert (prefill, decode) == ([seqs[2]], [seqs[1]])
    assert list(scheduler.waiting) == [seqs[3]]


def test_scheduler_head_of_queue_is_not_overtaken(step: ModuleType) -> None:
    """First come, first served: when the head of the queue does not fit, nobody behind it is
    admitted, even a request that would fit."""
    scheduler = step.PagedScheduler(max_running=4)
    big, small = step.Sequence(0, [1] * 20, 4), step.Sequence(1, [1], 1)
    scheduler.add(big)
    scheduler.add(small)
    asked = []

    def can_admit(seq) -> bool:
        asked.append(seq.seq_id)
        return seq is small

    assert scheduler.schedule(can_admit) == ([], [])
    assert asked == [0]
    assert list(scheduler.waiting) == [big, small]
    assert not scheduler.running and scheduler.has_work


def test_scheduler_refuses_max_running_below_one(step: ModuleType) -> None:
    with pytest.raises(ValueError, match="max_running"):
        step.PagedScheduler(0)


# ---- a round: every prefill chunk, then every decode token ----------------------------------


def test_a_round_runs_prefill_chunks_before_decode_tokens(make_engine: EngineFactory) -> None:
    """Within a round every prefill chunk comes before every decode token, in every step (so
    every step caches and adopts the same blocks). A decodes the token that completes its
    block 1 in the round B, which continues A's conversation, reaches block 1: B looks block 1
    up before A's decode token fills it, so B computes block 1 itself and adopts only block 0."""
    prompt_a = tokens(150, 2 * BS - 1)
    (first_token,) = reference_tokens(CFG, [prompt_a], 1)[0]
    prompt_b = [*prompt_a, first_token, 7]  # block 1 of B = block 1 of A once A decodes
    engine = make_engine(max_running=2)
    rid_a = engine.add_request(prompt_a, 3)
    engine.step()
    engine.step()  # A's last chunk: its first token; block 1 has 3 of its 4 slots
    engine.reset_stats()
    rid_b = engine.add_request(prompt_b, 2)
    engine.step()  # B: adopt block 0, compute block 1; then A decodes into its block 1
    assert (engine.stats.cached_tokens, engine.stats.computed_prefill_tokens) == (BS, BS)
    run_rounds(engine)
    assert engine.pop_output(rid_a) == reference_tokens(CFG, [prompt_a], 3)[0]
    assert engine.pop_output(rid_b) == reference_tokens(CFG, [prompt_b], 2)[0]
