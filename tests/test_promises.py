"""Promises of the engine's docstrings, READMEs and design that no other test pins exactly.

Each test names the promise it pins and checks an exact value computed here, from the request
sizes alone, rather than a property any implementation would have: a learner who breaks one of
these promises while changing the code must see a test fail.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from types import ModuleType

import pytest
import torch

from common import hashing
from tests.conftest import EngineFactory, blocks_needed, reference_tokens, tiny_config

CFG = tiny_config()
BS = CFG.block_size
VOCAB = CFG.vocab_size


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def log_schedules(engine) -> list[tuple[list[int], list[int]]]:
    """Wrap the engine's scheduler: each round logs the ids it scheduled, (prefill, decode)."""
    log: list[tuple[list[int], list[int]]] = []
    real = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        prefill, decode = real(*args, **kwargs)
        log.append(([s.seq_id for s in prefill], [s.seq_id for s in decode]))
        return prefill, decode

    engine.scheduler.schedule = schedule
    return log


def run_rounds(engine, limit: int = 1000) -> int:
    """Step until the engine is idle; returns the number of rounds."""
    rounds = 0
    while engine.has_work:
        assert rounds < limit, "the engine does not finish"
        engine.step()
        rounds += 1
    return rounds


def life_in_rounds(prompt_len: int, max_new: int, cached_blocks: int = 0) -> int:
    """Rounds a request runs once admitted: one per prefill chunk (the cached blocks need
    none), then one per decode token (the first comes out of the last prefill chunk)."""
    return -(-(prompt_len - cached_blocks * BS) // BS) + max_new - 1


def truncate_at(output: list[int], eos: int) -> list[int]:
    return output[: output.index(eos) + 1] if eos in output else output


# ---- the scheduler: max_running, FCFS --------------------------------------------------------


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


def test_engine_admission_is_exact_and_first_come_first_served(make_engine: EngineFactory) -> None:
    """A request is admitted only when its whole-life need fits in what is not yet reserved.

    Pool of 8, cache off: A needs 5 blocks (9 + 12 - 1 = 20 tokens), B exactly the 3 left
    (5 + 5 - 1 = 9 tokens), so both start in round one; C (1 block) must wait, and so must D
    behind it, until A or B is done, although their chunks would fit in the free blocks."""
    cfg = tiny_config(total_blocks=8)
    sizes = [(9, 12), (5, 5), (1, 1), (1, 1)]
    assert [blocks_needed(n, m, BS) for n, m in sizes] == [5, 3, 1, 1]
    engine = make_engine(cfg, enable_prefix_cache=False)
    log = log_schedules(engine)
    prompts = [tokens(200 + i, n) for i, (n, _) in enumerate(sizes)]
    ids = [engine.add_request(p, m) for p, (_, m) in zip(prompts, sizes)]
    engine.step()
    # a request counts from its first prefill chunk: the two still queued do not, yet
    assert (engine.stats.requests, engine.stats.prompt_tokens) == (2, 9 + 5)
    run_rounds(engine)
    assert log[0] == ([ids[0], ids[1]], [])
    life_b = life_in_rounds(5, 5)  # B finishes first: 2 + 4 = 6 rounds
    for round_ids in log[:life_b]:
        assert set(round_ids[0] + round_ids[1]) == {ids[0], ids[1]}
    assert ids[2] in log[life_b][0] and ids[3] in log[life_b][0]
    for prompt, (_, m), rid in zip(prompts, sizes, ids):
        assert engine.pop_output(rid) == reference_tokens(cfg, [prompt], m)[0]


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


# ---- stopping -----------------------------------------------------------------------------


def test_eos_as_the_first_generated_token_stops_with_exactly_that_token(
    make_engine: EngineFactory,
) -> None:
    """The first token comes out of the last prefill chunk; if it is eos the request is done,
    with that one token, and the others in the batch go on unaffected."""
    prompts = [tokens(300 + i, n) for i, n in enumerate((6, 1, 9, 4))]
    full = reference_tokens(CFG, prompts, 8)
    eos = full[2][0]
    want = [truncate_at(out, eos) for out in full]
    assert want[2] == [eos]
    assert make_engine(max_running=4).generate(prompts, 8, eos_token_id=eos) == want
    serial = make_engine(max_running=1).generate_serial(prompts, 8, eos_token_id=eos)
    assert serial == want


def test_request_stops_at_max_new_tokens_exactly(make_engine: EngineFactory) -> None:
    prompts = [tokens(310 + i, n) for i, n in enumerate((3, 8, 1))]
    for max_new in (1, 2, 5):
        outputs = make_engine().generate(prompts, max_new)
        assert [len(o) for o in outputs] == [max_new] * len(prompts)


# ---- reservations: what admission promised comes back -------------------------------------


POOL = 6
POOL_CFG = tiny_config(total_blocks=POOL)


def assert_whole_pool_request_starts_at_once(engine) -> None:
    """A request that needs every block of the pool must be admitted in its first round and
    run its exact life: nothing may stay reserved (or held) once the engine is idle."""
    prompt = tokens(400, (POOL - 1) * BS + 1)
    max_new = BS
    assert blocks_needed(len(prompt), max_new, BS) == POOL
    rid = engine.add_request(prompt, max_new)
    assert run_rounds(engine) == life_in_rounds(len(prompt), max_new)
    assert engine.pop_output(rid) == reference_tokens(POOL_CFG, [prompt], max_new)[0]


def test_early_eos_returns_the_unused_reservation(make_engine: EngineFactory) -> None:
    """A request admitted for the whole pool that stops at its first token (eos) gives every
    reserved block back: the next whole-pool request starts at once."""
    engine = make_engine(POOL_CFG)
    prompt = tokens(401, 3)
    max_new = POOL * BS - len(prompt) + 1
    assert blocks_needed(len(prompt), max_new, BS) == POOL
    eos = reference_tokens(POOL_CFG, [prompt], 1)[0][0]
    assert engine.generate([prompt], max_new, eos_token_id=eos) == [[eos]]
    assert_whole_pool_request_starts_at_once(engine)


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "nocache"])
def test_reservation_comes_back_after_hits_and_lazy_allocation(
    make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """Adopted blocks and allocated blocks both draw on the admission reservation; once their
    requests are done nothing stays reserved, so a whole-pool request still starts at once
    (evicting what the cache kept)."""
    engine = make_engine(POOL_CFG, enable_prefix_cache=enable_prefix_cache)
    shared = tokens(402, 2 * BS)
    prompts = [[*shared, 1], [*shared, 2, 3], [*shared, 4]]
    assert engine.generate_serial(prompts, 2) == reference_tokens(POOL_CFG, prompts, 2)
    assert engine.generate(prompts, 2) == reference_tokens(POOL_CFG, prompts, 2)
    if enable_prefix_cache:
        assert engine.stats.cached_tokens > 0
    assert_whole_pool_request_starts_at_once(engine)


def test_allocation_is_lazy_and_never_beyond_the_reservation(make_engine: EngineFactory) -> None:
    """One request alone, cache off: after each round it holds exactly the blocks its KV
    needs so far (ceil(tokens with KV / block_size)), never more than admission reserved."""
    engine = make_engine(enable_prefix_cache=False)
    total = CFG.total_blocks
    prompt, max_new = tokens(410, 3 * BS + 1), BS + 2
    need = blocks_needed(len(prompt), max_new, BS)
    rid = engine.add_request(prompt, max_new)
    held = []
    while engine.has_work:
        engine.step()
        held.append(engine.stats.blocks_used)
        assert engine.stats.blocks_free == total - held[-1]
    kv_tokens = [min((r + 1) * BS, len(prompt)) for r in range(-(-len(prompt) // BS))]
    kv_tokens += [len(prompt) + d for d in range(1, max_new)]
    expected = [-(-n // BS) for n in kv_tokens]
    expected[-1] = 0  # the last round finishes the request: everything is back
    assert held == expected
    assert max(held) == need
    assert len(engine.pop_output(rid)) == max_new


# ---- EngineStats: exact block and token figures ---------------------------------------------


def test_blocks_used_counts_cached_blocks_that_requests_hold(make_engine: EngineFactory) -> None:
    """blocks_used is every block a running request holds, each once, cached or not.

    P leaves two cached blocks. Then Q and R, both behind P's two blocks, start together: each
    adopts the two shared blocks and allocates one of its own, so 2 + 1 + 1 blocks are in use,
    2 of them cached, and everything else is free."""
    engine = make_engine()
    total = CFG.total_blocks
    shared = tokens(500, 2 * BS)
    engine.generate([[*shared, 1]], 1)  # KV for 2 * BS + 1 tokens: 2 full blocks, cached
    assert (engine.stats.blocks_cached, engine.stats.blocks_used) == (2, 0)
    assert engine.stats.blocks_free == total - 2
    engine.reset_stats()
    q, r = [*shared, 2, 3], [*shared, 4, 5]
    ids = [engine.add_request(p, 4) for p in (q, r)]
    expected = [
        (4, 2),  # each adopts the 2 shared blocks and prefills its 2-token tail into its own
        (4, 2),  # decode at position 2 * BS + 2: the own block has 3 of its 4 slots
        (4, 4),  # decode at 2 * BS + 3: each own block is full and cached, still held
    ]
    for used, cached in expected:
        engine.step()
        stats = engine.stats
        assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (
            used,
            cached,
            total - used,
        )
    assert (engine.stats.requests_hit, engine.stats.cached_tokens) == (2, 4 * BS)
    run_rounds(engine)  # a fourth block each, partial, freed when they finish
    stats = engine.stats
    assert (stats.blocks_used, stats.blocks_cached, stats.blocks_free) == (0, 4, total - 4)
    assert [len(engine.pop_output(i)) for i in ids] == [4, 4]


def test_block_figures_at_rest_after_one_request(make_engine: EngineFactory) -> None:
    """After one request the cache holds every full block of its KV (prompt and output), the
    partial last block is free again, and free + cached = total."""
    for prompt_len, max_new in ((1, 1), (BS, 1), (BS, 2), (2 * BS + 3, 7)):
        engine = make_engine()
        engine.generate([tokens(510, prompt_len)], max_new)
        cached = (prompt_len + max_new - 1) // BS
        stats = engine.stats
        assert (stats.blocks_cached, stats.blocks_free, stats.blocks_used) == (
            cached,
            CFG.total_blocks - cached,
            0,
        )


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


def test_token_hit_rate_of_the_chapter_demo(make_engine: EngineFactory) -> None:
    """Served one at a time, the demo's first request misses and the nine others adopt the
    3-block prefix: token_hit_rate is 9 * 3 blocks / all prompt tokens. Hot, all ten hit, and
    each adopts every full block of its prompt but the one holding its last token."""
    from common.workload import demo_prompts

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


# ---- the prefix cache's eviction order, in the engine ---------------------------------------


def test_finished_request_touches_its_blocks_tail_first(make_engine: EngineFactory) -> None:
    """_free_seq marks a finished request's blocks most recently used tail first, so that in
    LRU order a chain's tail comes before its head (evicted first), whatever PrefixCache.evict
    does on its own."""
    engine = make_engine()
    touched: list[list[int]] = []
    real = engine.kv_cache_manager.prefix_cache.touch

    def touch(block_ids):
        touched.append(list(block_ids))
        return real(block_ids)

    engine.kv_cache_manager.prefix_cache.touch = touch
    prompt = tokens(530, 3 * BS + 2)
    engine.generate([prompt], BS)
    chain = engine.kv_cache_manager.prefix_cache.match(
        hashing.hash_prefix_blocks(prompt, BS), prompt
    )
    assert len(chain) == 3
    assert [b for call in touched for b in call if b in chain] == chain[::-1]


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
    assert all(len(prefill) + len(decode) == 1 for prefill, decode in log)
    lives = [life_in_rounds(len(p), 3) for p in prompts]
    lives[2] = life_in_rounds(len(prompt), 3, cached_blocks=2)
    assert len(log) == sum(lives)
    assert engine.stats.cached_tokens == 2 * BS


def test_sequence_moves_waiting_prefilling_running_finished(make_engine: EngineFactory) -> None:
    """Each round advances a prefilling sequence by one block-sized chunk (prefill_offset is
    the prompt tokens with KV, never more than the prompt), then it decodes one token per
    round, then it is FINISHED with its blocks released."""
    engine = make_engine()
    prompt, max_new = tokens(560, 2 * BS + 3), 3
    engine.add_request(prompt, max_new)
    (seq,) = engine.scheduler.waiting
    assert seq.status.name == "WAITING" and seq.prefill_offset == 0
    seen = []
    while engine.has_work:
        engine.step()
        seen.append((seq.status.name, seq.prefill_offset, len(seq.generated_ids)))
    assert seen == [
        ("PREFILLING", BS, 0),
        ("PREFILLING", 2 * BS, 0),
        ("RUNNING", len(prompt), 1),
        ("RUNNING", len(prompt), 2),
        ("FINISHED", len(prompt), 3),
    ]
    assert seq.block_table == []


def test_sequence_unit(step: ModuleType) -> None:
    """Sequence's own bookkeeping: token stream, last token, prefill done, when it finishes."""
    seq = step.Sequence(0, [1, 2, 3], max_new_tokens=3, eos_token_ids=frozenset({9, 7}))
    assert (seq.prompt_len, seq.num_tokens, seq.last_token_id) == (3, 3, 3)
    assert not seq.is_prefill_done
    seq.prefill_offset = 3
    assert seq.is_prefill_done
    seq.status = step.SequenceStatus.RUNNING
    seq.append_token(4)
    assert (seq.token_ids, seq.num_tokens, seq.last_token_id) == ([1, 2, 3, 4], 4, 4)
    assert seq.status is step.SequenceStatus.RUNNING
    seq.append_token(9)  # eos
    assert seq.status is step.SequenceStatus.FINISHED
    capped = step.Sequence(1, [1], max_new_tokens=2)
    capped.status = step.SequenceStatus.RUNNING
    capped.append_token(0)
    assert capped.status is step.SequenceStatus.RUNNING
    capped.append_token(0)
    assert capped.status is step.SequenceStatus.FINISHED


def test_sequence_hash_chain_is_the_chain_hash_of_its_tokens(step: ModuleType) -> None:
    """From step14_5 a Sequence keeps its blocks' chain hashes (prompt and output alike):
    extending it to n blocks gives exactly common.hashing's first n hashes, and a later, longer
    extension keeps the earlier links."""
    if not hasattr(step.Sequence, "extend_block_hashes"):
        pytest.skip("the hash chain on Sequence arrives in step14_5")
    prompt = tokens(590, 2 * BS + 1)
    seq = step.Sequence(0, prompt, max_new_tokens=BS + 3)
    seq.extend_block_hashes(1, BS)
    assert seq.block_hashes == hashing.hash_prefix_blocks(prompt, BS)[:1]
    for t in tokens(591, BS + 3):
        seq.generated_ids.append(t)
    seq.extend_block_hashes(3, BS)  # block 2 runs into the output
    assert seq.block_hashes == hashing.hash_prefix_blocks(seq.token_ids, BS)[:3]
    seq.extend_block_hashes(2, BS)
    assert len(seq.block_hashes) == 3


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


def test_model_calls_per_round(make_engine: EngineFactory, step: ModuleType) -> None:
    """step14 to step14_6 call the model once per scheduled sequence per round; step14_7 makes
    one forward_batched call per round for all of them, and never calls forward."""
    engine = make_engine(max_running=3)
    calls = {"forward": 0, "forward_batched": 0}
    for name in calls:
        real = getattr(engine.model, name, None)
        if real is None:
            continue

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(engine.model, name, counting)
    log = log_schedules(engine)
    prompts = [tokens(600 + i, n) for i, n in enumerate((9, 2, 5, 12))]
    assert engine.generate(prompts, 4) == reference_tokens(CFG, prompts, 4)
    scheduled = sum(len(prefill) + len(decode) for prefill, decode in log)
    if hasattr(step.TinyTransformerPaged, "forward_batched"):
        assert calls == {"forward": 0, "forward_batched": len(log)}
    else:
        assert calls == {"forward": scheduled, "forward_batched": 0}


# ---- forward_batched (step14_7): every write before any read, per layer ----------------------


@pytest.mark.parametrize("reader_len", [1, 3], ids=["decode-reader", "chunk-reader"])
def test_forward_batched_writes_every_kv_before_any_attention(
    step: ModuleType, reader_len: int
) -> None:
    """A batch where the FIRST sequence reads, as context, a block the SECOND one writes in
    the same call: it must see that KV, as if the second had run before it (per layer, every
    token's K/V is written before any sequence's attention reads the pool)."""
    if not hasattr(step.TinyTransformerPaged, "forward_batched"):
        pytest.skip("forward_batched arrives in step14_7")
    shared, own = tokens(580, BS), tokens(581, reader_len)
    batched, serial = step.TinyTransformerPaged(CFG), step.TinyTransformerPaged(CFG)
    got = batched.forward_batched([own, shared], [[5, 9], [5]], [BS, 0])
    writer = serial(shared, [5], 0)[-1]
    reader = serial(own, [5, 9], BS)[-1]
    torch.testing.assert_close(got, torch.stack([reader, writer]), rtol=0, atol=1e-10)
