"""PagedPrefixCacheEngine's public API, the same in every step.

The specification: ``add_request`` / ``step`` / ``has_work`` / ``pop_output`` drive the engine
round by round (an idle step changes nothing; each output is handed out once); ``generate``
serves prompts together and ``generate_serial`` one at a time through the same cache, both
handing every output back in prompt order; ``ref_count_problems`` names what is wrong with a
pool at rest; ``EngineStats``' rates are the ratios they name, and ``reset_stats`` zeroes the
request counters only. Memory figures (admission, blocks) are in ``test_engine_memory.py``.
"""

from __future__ import annotations

from dataclasses import asdict
from types import ModuleType

import pytest

from common.observer import RoundObserver
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
VOCAB = CFG.vocab_size


# ---- the step API ---------------------------------------------------------------------------


def test_has_work_and_an_idle_step(make_engine: EngineFactory) -> None:
    """A fresh engine has no work and an idle step() changes nothing; a queued request is work
    until its last round, and its output waits for pop_output."""
    engine = make_engine()
    assert not engine.has_work
    before = engine.stats
    engine.step()
    assert engine.stats == before and not engine.has_work
    rid = engine.add_request([1, 2, 3], 2)
    assert engine.has_work
    engine.step()
    assert engine.has_work
    engine.step()
    assert not engine.has_work
    assert engine.pop_output(rid) == reference_tokens(CFG, [[1, 2, 3]], 2)[0]
    engine.step()
    assert not engine.has_work


def test_pop_output_hands_each_result_out_once(make_engine: EngineFactory) -> None:
    engine = make_engine()
    rid = engine.add_request([1, 2, 3], 2)
    with pytest.raises(KeyError, match="not finished"):
        engine.pop_output(rid)
    while engine.has_work:
        engine.step()
    assert engine.pop_output(rid) == reference_tokens(engine.model.cfg, [[1, 2, 3]], 2)[0]
    with pytest.raises(KeyError):
        engine.pop_output(rid)


def test_generate_hands_out_every_output_and_keeps_none(make_engine: EngineFactory) -> None:
    """generate returns the outputs in prompt order, however the requests finish, and takes
    them: none is left for pop_output. Requests queued before keep theirs."""
    engine = make_engine(max_running=2)
    queued = engine.add_request([5, 6], 1)
    prompts = [tokens(540, 14), [7], tokens(541, 3)]
    ids_before = queued
    outputs = engine.generate(prompts, 3)
    assert outputs == reference_tokens(CFG, prompts, 3)
    assert engine.pop_output(queued) == reference_tokens(CFG, [[5, 6]], 1)[0]
    for rid in range(ids_before + 1, ids_before + 1 + len(prompts)):
        with pytest.raises(KeyError):
            engine.pop_output(rid)


def test_generate_serial_runs_one_request_at_a_time(make_engine: EngineFactory) -> None:
    """generate_serial: one request at a time (no round runs two), through the same cache
    (the second identical prompt adopts the first's blocks), same tokens as generate."""
    engine = make_engine(max_running=4)
    log = log_schedules(engine)
    prompt = tokens(550, 2 * BS + 1)
    prompts = [prompt, tokens(551, 5), prompt]
    outputs = engine.generate_serial(prompts, 3)
    assert outputs == reference_tokens(CFG, prompts, 3)
    assert all(len(ran) == 1 for ran in log)
    chunk = prefill_chunk(engine)
    lives = [life_in_rounds(len(p), 3, chunk=chunk) for p in prompts]
    lives[2] = life_in_rounds(len(prompt), 3, cached_blocks=2, chunk=chunk)
    assert len(log) == sum(lives)
    assert engine.stats.cached_tokens == 2 * BS


def test_ref_count_problems_reports_what_is_broken(make_engine: EngineFactory) -> None:
    """ref_count_problems is empty at rest and names the broken block otherwise: a block with
    an owner too many, a block held outside the cache, or an engine that is not at rest."""
    engine = make_engine()
    engine.generate([tokens(570, BS + 1)], 1)
    assert engine.ref_count_problems() == []
    (cached,) = [b for b in range(CFG.total_blocks) if b in engine.kv_cache_manager.prefix_cache]
    engine.kv_cache_manager.block_manager.retain(cached)
    problems = engine.ref_count_problems()
    assert len(problems) == 1 and f"block {cached}" in problems[0]
    engine.kv_cache_manager.block_manager.free([cached])
    (leaked,) = engine.kv_cache_manager.block_manager.allocate(1)
    problems = engine.ref_count_problems()
    assert any(f"block {leaked}" in p for p in problems)
    assert any("free" in p and "cached" in p for p in problems)
    engine.kv_cache_manager.block_manager.free([leaked])
    engine.add_request([1], 1)
    assert engine.ref_count_problems() == ["engine is not at rest"]
    run_rounds(engine)
    assert engine.ref_count_problems() == []


# ---- EngineStats: rates and resets ----------------------------------------------------------


def test_hit_rates_are_the_ratios_they_name(step: ModuleType) -> None:
    """hit_rate = requests_hit / requests, token_hit_rate = cached_tokens / prompt_tokens,
    computed_tokens = computed prefill + computed decode; no request, no rate (0.0)."""
    stats = step.EngineStats(
        requests=8,
        requests_hit=6,
        prompt_tokens=200,
        cached_tokens=48,
        computed_prefill_tokens=152,
        computed_decode_tokens=21,
    )
    assert stats.hit_rate == 6 / 8
    assert stats.token_hit_rate == 48 / 200
    assert stats.computed_tokens == 173
    assert step.EngineStats().hit_rate == step.EngineStats().token_hit_rate == 0.0


def test_rounds_and_sequences_per_round_are_counted_as_they_run(
    step: ModuleType, make_engine: EngineFactory
) -> None:
    """rounds counts the rounds that ran a sequence, seqs_scheduled the sequences they ran, and
    seqs_per_round is their ratio, not rounded. Two requests of 3 and 2 rounds side by side (2
    and 2 from step14_9 on, whose first chunk holds a whole short prompt): 3 rounds, 5
    sequences run; an idle step() adds nothing."""
    engine = make_engine(max_running=2)
    chunk = prefill_chunk(engine)
    lives = [life_in_rounds(BS + 1, 2, chunk=chunk), life_in_rounds(1, 2, chunk=chunk)]
    assert lives == ([3, 2] if chunk == BS else [2, 2])
    engine.generate([tokens(560, BS + 1), tokens(561, 1)], 2)
    engine.step()
    stats = engine.stats
    assert (stats.rounds, stats.seqs_scheduled) == (max(lives), sum(lives))
    assert stats.seqs_per_round == sum(lives) / max(lives)
    assert step.EngineStats(rounds=4, seqs_scheduled=6).seqs_per_round == 1.5
    assert step.EngineStats().seqs_per_round == 0.0


def test_token_hit_rate_of_the_chapter_demo(make_engine: EngineFactory) -> None:
    """Served one at a time, the demo's first request misses and the nine others adopt the
    3-block prefix: token_hit_rate is 9 * 3 blocks / all prompt tokens. Hot, all ten hit, and
    each adopts every full block of its prompt but the one holding its last token."""
    from front.workload import demo_prompts

    engine = make_engine()
    prompts = demo_prompts(VOCAB, block_size=BS)
    prompt_tokens = sum(len(p) for p in prompts)
    cold = 9 * 3 * BS
    hot = sum((len(p) - 1) // BS * BS for p in prompts)  # every full block but the last
    for hits, cached in ((9, cold), (10, hot)):
        engine.reset_stats()
        engine.generate_serial(prompts, 2)
        stats = engine.stats
        assert (stats.cached_tokens, stats.prompt_tokens) == (cached, prompt_tokens)
        assert stats.token_hit_rate == cached / prompt_tokens
        assert stats.hit_rate == hits / 10
        assert stats.computed_prefill_tokens == prompt_tokens - cached


def test_reset_stats_keeps_the_cache_and_the_eviction_count(make_engine: EngineFactory) -> None:
    """reset_stats zeroes the request and token counters only: the cached blocks, the block
    figures and the eviction history stay, and the next request still hits."""
    engine = make_engine(tiny_config(total_blocks=4))
    first, second = tokens(520, 2 * BS + 1), tokens(521, 2 * BS + 1)
    engine.generate([first], 1)
    engine.generate([second], BS)  # needs 3 blocks with 2 free: evicts one of first's
    before = engine.stats
    assert before.evictions == 1 and before.blocks_cached > 0
    engine.reset_stats()
    after = asdict(engine.stats)
    kept = {"evictions", "blocks_free", "blocks_cached", "blocks_used", "blocks_peak"}
    assert after == {k: v if k in kept else 0 for k, v in asdict(before).items()}
    engine.generate([[*second[: 2 * BS], 9]], 1)
    assert engine.stats.cached_tokens == 2 * BS


# ---- what a server reads: cached tokens per request, the queues, watchers ----------------------


def test_each_output_carries_its_requests_cached_tokens(make_engine: EngineFactory) -> None:
    """``RequestOutput.num_cached_tokens`` (vLLM's name): the prompt tokens a request adopted
    from the cache. Summed over the requests it is ``stats.cached_tokens``; a request with
    nothing to share reports 0, and every output of a request reports the same count."""
    engine = make_engine()
    prefix = tokens(700, 3 * BS)
    first = engine.add_request(prefix + tokens(701, 2), 3)
    while engine.has_work:
        assert all(out.num_cached_tokens == 0 for out in engine.step())
    engine.pop_output(first)
    ids = [engine.add_request(prefix + tokens(702 + i, 1 + i), 3) for i in range(2)]
    alone = engine.add_request(tokens(800, 2 * BS + 1), 3)
    counts: dict[int, set[int]] = {}
    while engine.has_work:
        for out in engine.step():
            counts.setdefault(out.request_id, set()).add(out.num_cached_tokens)
    assert counts == {ids[0]: {3 * BS}, ids[1]: {3 * BS}, alone: {0}}
    assert engine.stats.cached_tokens == 2 * 3 * BS


def test_stats_count_the_running_and_the_waiting(make_engine: EngineFactory) -> None:
    """``requests_running`` / ``requests_waiting`` are the queues now (vLLM's gauges)."""
    engine = make_engine(max_running=2)
    for i in range(5):
        engine.add_request(tokens(900 + i, 3), 4)
    assert (engine.stats.requests_running, engine.stats.requests_waiting) == (0, 5)
    engine.step()
    assert (engine.stats.requests_running, engine.stats.requests_waiting) == (2, 3)
    while engine.has_work:
        engine.step()
        s = engine.stats
        assert s.requests_running <= 2 and s.requests_running + s.requests_waiting <= 5
    assert (engine.stats.requests_running, engine.stats.requests_waiting) == (0, 0)


class EventLog(RoundObserver):
    """Writes down every event's name, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str):
        if name in vars(RoundObserver) and not name.startswith("_"):
            return lambda *args: self.events.append(name)
        return super().__getattribute__(name)


def test_two_observers_hear_every_event_and_each_can_leave(make_engine: EngineFactory) -> None:
    """Several watchers at once (a server's metrics and the trace): each is told every event,
    in the same order; one removed hears nothing more while the other goes on; attaching the
    same watcher twice, or removing a stranger, is refused."""
    engine = make_engine()
    first, second = EventLog(), EventLog()
    engine.observer.add(first)
    engine.observer.add(second)
    with pytest.raises(ValueError):
        engine.observer.add(first)
    engine.generate([tokens(1000, 2 * BS + 1), tokens(1001, 3)], 3)
    assert first.events == second.events and {"round_started", "freed"} <= set(first.events)
    engine.observer.remove(first)
    heard = len(first.events)
    engine.generate([tokens(1002, 3)], 2)
    assert len(first.events) == heard and len(second.events) > heard
    with pytest.raises(ValueError):
        engine.observer.remove(first)


def test_snapshot_shows_the_pool_and_is_a_copy(make_engine: EngineFactory) -> None:
    """``engine.snapshot()``: the free count, every ref_count, what the cache holds and each
    request's table, consistent with one another (ref_count = tables holding it + the cache);
    changing it changes nothing in the engine."""
    engine = make_engine(max_running=2)
    prefix = tokens(1100, 2 * BS)
    for i in range(3):
        engine.add_request(prefix + tokens(1101 + i, 3), 8)
    for _ in range(3):
        engine.step()
    snap = engine.snapshot()
    assert len(snap.running) == 2 and len(snap.waiting) == 1
    holders = snap.holders
    for block, count in snap.ref_counts.items():
        assert count == len(holders.get(block, ())) + (block in snap.cached)
    assert snap.num_free + len(snap.ref_counts) == snap.total_blocks
    snap.ref_counts.clear()
    assert engine.snapshot().ref_counts and engine.snapshot() == snap.__class__(
        **{**vars(engine.snapshot())}
    )
    while engine.has_work:
        engine.step()
    rest = engine.snapshot()
    assert rest.running == rest.waiting == {} and set(rest.ref_counts) == set(rest.cached)
