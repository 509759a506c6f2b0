"""PagedScheduler: the queues of continuous batching, and the order a round runs them in.

The specification: at most ``max_running`` sequences run at once, and as many as can; waiting
requests are admitted first come, first served (the head of the queue is never overtaken); the
most recently admitted is the first to be preempted, and goes back to the front of the queue;
a round runs the running sequences oldest first, then the newly admitted. The scheduler does no
memory operation: it only moves sequences between its queues.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import (
    EngineFactory,
    life_in_rounds,
    log_schedules,
    prefill_chunk,
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

    chunk = prefill_chunk(engine)
    queue = [(i, life_in_rounds(n, max_new, chunk=chunk)) for i, n in enumerate(lengths)]
    active: list[tuple[int, int]] = []
    expected = []
    while queue or active:
        while queue and len(active) < max_running:
            active.append(queue.pop(0))
        expected.append(sorted(i for i, _ in active))
        active = [(i, left - 1) for i, left in active if left > 1]
    got = [sorted(ran) for ran in log]
    assert got == expected
    assert max(len(ids) for ids in got) == max_running


def test_scheduler_unit_admits_up_to_max_running_in_order(step: ModuleType) -> None:
    """PagedScheduler alone: the head of the queue is offered while the running set has room,
    admission takes it (PREFILLING), and a finished sequence's place goes to the next in the
    queue, not to an earlier one."""
    scheduler = step.PagedScheduler(max_running=2)
    seqs = [step.Sequence(i, [1, 2, 3], 4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
        assert seq.status is step.SequenceStatus.WAITING
    for seq in seqs[:2]:
        assert scheduler.next_waiting() is seq
        scheduler.admit(seq)
    assert scheduler.next_waiting() is None, "max_running reached"
    assert scheduler.running == seqs[:2]
    assert all(s.status is step.SequenceStatus.PREFILLING for s in seqs[:2])
    assert [s.status for s in seqs[2:]] == [step.SequenceStatus.WAITING] * 2
    seqs[0].status = step.SequenceStatus.FINISHED
    scheduler.remove_finished()
    assert scheduler.running == [seqs[1]]
    assert scheduler.next_waiting() is seqs[2]
    with pytest.raises(ValueError, match="head of the queue"):
        scheduler.admit(seqs[3])
    assert list(scheduler.waiting) == seqs[2:]


def test_scheduler_unit_offers_only_the_head_of_the_queue(step: ModuleType) -> None:
    """First come, first served: only the head is ever offered for admission; what is behind
    it waits, whatever its size (the engine then leaves the head waiting if it does not fit)."""
    scheduler = step.PagedScheduler(max_running=4)
    big, small = step.Sequence(0, [1] * 20, 4), step.Sequence(1, [1], 1)
    scheduler.add(big)
    scheduler.add(small)
    assert scheduler.next_waiting() is big
    with pytest.raises(ValueError):
        scheduler.admit(small)
    assert list(scheduler.waiting) == [big, small]
    assert not scheduler.running and scheduler.has_work


def test_scheduler_unit_preempts_the_youngest_to_the_front(step: ModuleType) -> None:
    """preempt() takes the most recently admitted running sequence back to the front of the
    queue, to start its prefill again; it keeps its output and counts the preemption."""
    scheduler = step.PagedScheduler(max_running=3)
    seqs = [step.Sequence(i, [1, 2, 3], 4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    for seq in seqs[:3]:
        scheduler.admit(seq)
    seqs[2].generated_ids, seqs[2].prefill_offset = [7], 3
    assert scheduler.preempt() is seqs[2]
    assert scheduler.running == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2], seqs[3]]
    assert seqs[2].status is step.SequenceStatus.PREEMPTED
    assert (seqs[2].prefill_offset, seqs[2].num_preemptions, seqs[2].generated_ids) == (0, 1, [7])
    assert scheduler.preempt() is seqs[1]
    assert list(scheduler.waiting) == [seqs[1], seqs[2], seqs[3]]


def test_scheduler_unit_removes_a_queued_or_running_sequence(step: ModuleType) -> None:
    """remove() (what abort uses) takes a sequence out of either queue; an id in neither is a
    KeyError that changes nothing."""
    scheduler = step.PagedScheduler(max_running=1)
    seqs = [step.Sequence(i, [1], 1) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.admit(seqs[0])
    assert scheduler.remove(2) is seqs[2] and scheduler.remove(0) is seqs[0]
    with pytest.raises(KeyError):
        scheduler.remove(0)
    assert (scheduler.running, list(scheduler.waiting)) == ([], [seqs[1]])


def test_scheduler_refuses_max_running_below_one(step: ModuleType) -> None:
    with pytest.raises(ValueError, match="max_running"):
        step.PagedScheduler(0)


# ---- a round: the running sequences oldest first, then the newly admitted ------------------


def test_a_round_runs_its_sequences_oldest_first(make_engine: EngineFactory) -> None:
    """Within a round the sequences run in admission order, in every step (so every step
    caches and adopts the same blocks, and a preemption victim, the youngest, is never one that
    already ran). A decodes the token that completes its block 1 in the round in which B, which
    continues A's conversation, is admitted: A runs first, so B finds blocks 0 and 1 cached,
    adopts both and computes only its last token."""
    prompt_a = tokens(150, 2 * BS - 1)
    (first_token,) = reference_tokens(CFG, [prompt_a], 1)[0]
    prompt_b = [*prompt_a, first_token, 7]  # block 1 of B = block 1 of A once A decodes
    engine = make_engine(max_running=2)
    log = log_schedules(engine)
    rid_a = engine.add_request(prompt_a, 3)
    engine.step()
    engine.step()  # A's last chunk: its first token; block 1 has 3 of its 4 slots
    engine.reset_stats()
    rid_b = engine.add_request(prompt_b, 2)
    engine.step()  # A decodes into its block 1, which fills up; then B adopts blocks 0 and 1
    assert log[-1] == [rid_a, rid_b]
    assert (engine.stats.cached_tokens, engine.stats.computed_prefill_tokens) == (2 * BS, 1)
    run_rounds(engine)
    assert engine.pop_output(rid_a) == reference_tokens(CFG, [prompt_a], 3)[0]
    assert engine.pop_output(rid_b) == reference_tokens(CFG, [prompt_b], 2)[0]
