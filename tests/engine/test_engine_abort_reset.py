"""``engine.abort(request_id)`` and ``engine.reset_prefix_cache()``, with vLLM's semantics.

abort cancels a queued or running request at once: its blocks go back (full ones stay cached),
nothing more is generated, it returns the ids generated so far, and other requests are not
disturbed. An id that is not queued or running raises KeyError. reset_prefix_cache empties the
cache when no request runs (True), and changes nothing while one does (False).
"""

from __future__ import annotations

import random

import pytest

from common.status import SequenceStatus
from tests.helpers import EngineFactory, reference_tokens, tiny_config

BS = 4
CFG = tiny_config(block_size=BS, total_blocks=64)
VOCAB = CFG.vocab_size


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def step_until(engine, done) -> None:
    while not done():
        assert engine.has_work, "the engine went idle before the moment the test waits for"
        engine.step()


def finish(engine) -> None:
    while engine.has_work:
        engine.step()


def seq_of(engine, request_id: int):
    (seq,) = [
        s for s in [*engine.scheduler.running, *engine.scheduler.waiting] if s.seq_id == request_id
    ]
    return seq


PHASES = ["queued", "mid-prefill", "decoding"]


@pytest.mark.parametrize("phase", PHASES)
def test_abort_at_every_phase(make_engine: EngineFactory, phase: str) -> None:
    """Abort one of two requests while it is queued, halfway through its prefill, or decoding:
    it returns exactly the reference's first tokens (none before its first one), its blocks go
    back, its full blocks stay cached, and the other request still gets the reference's tokens.
    """
    engine = make_engine(CFG, max_running=1 if phase == "queued" else 2)
    other, victim = tokens(1, 2 * BS + 1), tokens(2, 3 * BS + 2)
    other_id = engine.add_request(other, 8)
    victim_id = engine.add_request(victim, 8)
    if phase == "mid-prefill":
        step_until(engine, lambda: seq_of(engine, victim_id).prefill_offset >= BS)
    elif phase == "decoding":
        step_until(engine, lambda: len(seq_of(engine, victim_id).generated_ids) >= 3)
    else:
        engine.step()
    seq = seq_of(engine, victim_id)
    so_far = list(seq.generated_ids)
    full_blocks_before = seq.prefill_offset // BS if seq.generated_ids == [] else None
    assert engine.abort(victim_id) == so_far
    assert so_far == reference_tokens(CFG, [victim], 8)[0][: len(so_far)]
    assert seq.block_table == [] and seq.status is SequenceStatus.FINISHED
    with pytest.raises(KeyError):
        engine.abort(victim_id)
    with pytest.raises(KeyError):
        engine.pop_output(victim_id)  # an aborted request leaves no output behind
    finish(engine)
    assert engine.pop_output(other_id) == reference_tokens(CFG, [other], 8)[0]
    assert engine.ref_count_problems() == []
    if full_blocks_before:  # what it computed stays cached: the same prompt hits it now
        engine.reset_stats()
        engine.generate([victim], 1)
        assert engine.stats.cached_tokens >= full_blocks_before * BS


def test_abort_a_just_finished_request_is_a_key_error(make_engine: EngineFactory) -> None:
    """A finished request is no longer queued or running: abort refuses it, and its output is
    still there to pop."""
    engine = make_engine(CFG)
    rid = engine.add_request(tokens(3, 5), 2)
    finish(engine)
    with pytest.raises(KeyError):
        engine.abort(rid)
    assert engine.pop_output(rid) == reference_tokens(CFG, [tokens(3, 5)], 2)[0]


def test_abort_an_unknown_id_changes_nothing(make_engine: EngineFactory) -> None:
    engine = make_engine(CFG)
    rid = engine.add_request(tokens(4, 5), 3)
    engine.step()
    before = engine.stats
    with pytest.raises(KeyError):
        engine.abort(rid + 1)
    assert engine.stats == before
    finish(engine)
    assert engine.pop_output(rid) == reference_tokens(CFG, [tokens(4, 5)], 3)[0]


def test_abort_a_preempted_request(make_engine: EngineFactory) -> None:
    """A request preempted back to the queue can be aborted there too: it returns what it had
    generated before it was preempted, and holds no block."""
    cfg = tiny_config(block_size=BS, total_blocks=6)
    engine = make_engine(cfg, max_running=3)
    ids = [engine.add_request(tokens(10 + i, 2 * BS - 1), 6) for i in range(3)]
    step_until(engine, lambda: engine.stats.preemptions > 0)
    (victim,) = [s for s in engine.scheduler.waiting if s.status is SequenceStatus.PREEMPTED]
    got = engine.abort(victim.seq_id)
    assert got and got == victim.generated_ids
    finish(engine)
    for rid in ids:
        if rid != victim.seq_id:
            prompt = tokens(10 + ids.index(rid), 2 * BS - 1)
            assert engine.pop_output(rid) == reference_tokens(cfg, [prompt], 6)[0]


def test_reset_prefix_cache_at_rest_empties_it(make_engine: EngineFactory) -> None:
    """At rest, reset gives every cached block back to the free pool, and the next request,
    the same prompt as before, hits nothing and still gets the same tokens."""
    engine = make_engine(CFG)
    prompt = tokens(5, 3 * BS + 1)
    first = engine.generate([prompt], 3)
    assert engine.stats.blocks_cached > 0
    assert engine.reset_prefix_cache() is True
    assert engine.stats.blocks_cached == 0
    assert engine.stats.blocks_free == CFG.total_blocks
    engine.reset_stats()
    assert engine.generate([prompt], 3) == first
    assert engine.stats.requests_hit == 0 and engine.stats.cached_tokens == 0


def test_reset_prefix_cache_while_running_changes_nothing(make_engine: EngineFactory) -> None:
    engine = make_engine(CFG)
    prompt = tokens(6, 3 * BS + 1)
    engine.generate([prompt], 2)
    rid = engine.add_request(tokens(7, 2 * BS), 4)
    engine.step()
    before = engine.stats
    assert engine.reset_prefix_cache() is False
    assert engine.stats == before
    finish(engine)
    engine.pop_output(rid)
    engine.reset_stats()
    engine.generate([prompt], 2)
    assert engine.stats.requests_hit == 1, "the cache survived the refused reset"


def test_reset_prefix_cache_with_only_queued_requests(make_engine: EngineFactory) -> None:
    """Queued requests hold no block, so the cache may be emptied under them."""
    engine = make_engine(CFG)
    prompt = tokens(8, 2 * BS + 1)
    engine.generate([prompt], 2)
    rid = engine.add_request(prompt, 2)
    assert engine.reset_prefix_cache() is True
    finish(engine)
    assert engine.pop_output(rid) == reference_tokens(CFG, [prompt], 2)[0]
    assert engine.stats.requests_hit == 0


@pytest.mark.parametrize("phase", PHASES)
def test_aborting_the_last_request_is_reported_by_the_next_step(
    make_engine: EngineFactory, phase: str
) -> None:
    """With nothing else queued or running, an abort is still work: ``has_work`` stays True
    until the next ``step()`` hands back the request's end (finish_reason "abort", its tokens
    so far), so a ``while engine.has_work: engine.step()`` loop sees it. That step runs no
    model call, and the notice is handed out once."""
    engine = make_engine(CFG)
    rid = engine.add_request(tokens(5, 2 * BS + 1), 8)
    if phase == "mid-prefill":
        step_until(engine, lambda: seq_of(engine, rid).prefill_offset >= BS)
    elif phase == "decoding":
        step_until(engine, lambda: len(seq_of(engine, rid).generated_ids) >= 2)
    so_far = engine.abort(rid)
    assert engine.has_work
    rounds = engine.stats.rounds
    reported = []
    while engine.has_work:
        reported += engine.step()
    (output,) = reported
    assert (output.request_id, output.finished, output.finish_reason) == (rid, True, "abort")
    assert output.token_ids == so_far and output.new_token_ids == []
    assert engine.stats.rounds == rounds  # nothing ran: the round only reported
    assert engine.step() == [] and not engine.has_work
    assert engine.ref_count_problems() == []
