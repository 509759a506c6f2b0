"""step14_9's fix, beyond the chapter: prefill in chunks of many blocks under a token budget.

Up to step14_8 a prefilling sequence computes one chunk of ``block_size`` tokens a round (the
chapter's chunk = block), so a long prompt goes through the model a block at a time, in matmuls
of ``block_size`` rows per sequence. From step14_9 a round computes up to
``max_num_batched_tokens`` tokens (vLLM's name): one for each decoding sequence first, then the
prefilling ones, oldest first, each taking the rest of its prompt if the budget has room for
it, else the whole blocks it has room for. The specification: a chunk ends on a block boundary
unless it ends the prompt; a round never computes more than the budget, and never leaves a
decoding sequence out; a sequence admitted later in a round adopts the blocks an earlier chunk
of the same round registered, so every shared block is still computed once; the tokens are the
dense reference's and every figure but the rounds' is step14_8's; a long chunk attends on a
grid of its own, so the round's decode rows are not padded to its length; a budget the engine
cannot work with is refused by name. Before the fix, every chunk is one block.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from types import ModuleType

import pytest
import torch
from torch.overrides import TorchFunctionMode

from common.observer import RoundObserver
from common.status import SequenceStatus
from front.steps import load_step
from front.workload import shared_prefix_prompts
from tests.helpers import (
    budget_args,
    has_fix,
    prefill_chunk,
    random_shared_prefix_prompts,
    reference_tokens,
    requires_fix,
    same_work_figures,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size


class Rounds(RoundObserver):
    """Each round's chunks, as the engine schedules them: (request, first token, tokens, its
    tokens in all), and the blocks each request adopted and cached, in order."""

    def __init__(self) -> None:
        self.chunks: list[list[tuple[int, int, int, int]]] = []
        self.moves: list[list[tuple[str, int, list[int]]]] = []

    def round_started(self) -> None:
        self.chunks.append([])
        self.moves.append([])

    def scheduled(self, seq, start: int, num_tokens: int) -> None:
        self.chunks[-1].append((seq.seq_id, start, num_tokens, seq.num_tokens))

    def allocated(self, seq, adopted: list[int], new: list[int], evicted: list[int]) -> None:
        self.moves[-1].append(("adopt", seq.seq_id, list(adopted)))

    def cached(self, seq, block_index: int, taken: bool) -> None:
        if taken:
            self.moves[-1].append(("cache", seq.seq_id, [seq.block_table[block_index]]))


def watched(engine) -> Rounds:
    rounds = Rounds()
    engine.observer.add(rounds)
    return rounds


# ---- the fix: chunks of many blocks ------------------------------------------------------------


def test_a_prompt_prefills_in_chunks_of_the_budget(step: ModuleType, make_engine) -> None:
    """A lone 4.5-block prompt: one block a round up to step14_8 (5 prefill rounds); from
    step14_9, under a budget of 2 blocks, two blocks a round and then the last half block (3
    rounds), and under the default budget the whole prompt at once (1 round)."""
    prompt = tokens(900, 4 * BS + 2)
    expected = reference_tokens(CFG, [prompt], 3)
    for args, chunks in [
        (budget_args(step, 2 * BS), [2 * BS, 2 * BS, 2]),
        ({}, [len(prompt)]),
    ]:
        engine = make_engine(**args)
        rounds = watched(engine)
        assert engine.generate([prompt], 3) == expected
        prefill = [n for chunks_of_round in rounds.chunks for _, _, n, _ in chunks_of_round]
        prefill = prefill[: len(prefill) - 2]  # the two decode tokens
        if has_fix(step, "step14_9"):
            assert prefill == chunks
        else:
            assert prefill == [BS, BS, BS, BS, 2]


def test_the_model_sees_a_long_chunk_in_one_call(step: ModuleType, make_engine) -> None:
    """The point of the fix: a 16-block prompt goes through ``forward_batched`` as one chunk of
    64 rows from step14_9 (the linear layers' matmuls are 64 rows tall), as 16 chunks of one
    block before."""
    requires_fix(step, "step14_7")
    engine = make_engine()
    rows = []
    real = engine.model.forward_batched

    def forward_batched(chunks, *args, **kwargs):
        rows.append([len(chunk) for chunk in chunks])
        return real(chunks, *args, **kwargs)

    engine.model.forward_batched = forward_batched
    prompt = tokens(901, 16 * BS)
    assert engine.generate([prompt], 2) == reference_tokens(CFG, [prompt], 2)
    if has_fix(step, "step14_9"):
        assert rows == [[16 * BS], [1]]
    else:
        assert rows == [[BS]] * 16 + [[1]]


class AttentionRows(TorchFunctionMode):
    """The query rows handed to ``scaled_dot_product_attention`` while active, padding
    included (per K/V head: grid sequences x query rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.rows += args[0].shape[0] * args[0].shape[2]
        return func(*args, **(kwargs or {}))


def test_a_long_chunk_does_not_pad_the_decode_rows(step: ModuleType) -> None:
    """A round of an 8-block chunk and three decode rows: up to step14_8 one padded grid, each
    decode row padded to the chunk's 32 rows (4 x 32 per layer); from step14_9 on the long
    chunk attends on a grid of its own (32 + 3). The logits are those of one ``forward`` per
    sequence, in the round's order."""
    requires_fix(step, "step14_7")
    histories = [tokens(940 + i, n) for i, n in enumerate((0, 5, 9, 2))]
    chunks = [tokens(950, 8 * BS), [7], [8], [9]]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    batched, serial = step.TinyTransformerPaged(CFG), step.TinyTransformerPaged(CFG)
    for model in (batched, serial):
        for history, table in zip(histories, tables):
            if history:
                model(history, table, 0)
    starts = [len(h) for h in histories]
    with AttentionRows() as counted:
        got = batched.forward_batched(chunks, tables, starts)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    per_layer = 8 * BS + 3 if has_fix(step, "step14_9") else 4 * 8 * BS
    assert counted.rows == CFG.num_layers * per_layer


def test_before_step14_9_the_engine_takes_no_budget(step: ModuleType) -> None:
    """The option is step14_9's: an earlier engine has no such argument."""
    model = step.TinyTransformerPaged(CFG)
    if has_fix(step, "step14_9"):
        engine = step.PagedPrefixCacheEngine(model, max_num_batched_tokens=64)
        assert engine.max_num_batched_tokens == 64
        assert step.PagedPrefixCacheEngine(model).max_num_batched_tokens == 512
    else:
        with pytest.raises(TypeError, match="max_num_batched_tokens"):
            step.PagedPrefixCacheEngine(model, max_num_batched_tokens=64)


# ---- the budget: its rules, round by round -------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_every_round_keeps_the_rules_of_the_budget(step: ModuleType, seed: int) -> None:
    """Random requests arriving over the rounds, random budgets: a round computes at most the
    budget; every decoding request computes its token in every round (decode tokens count
    first, and are never left out); a chunk ends on a block boundary or at the end of the
    request's tokens; and a prefill chunk is cut short only when the budget left had no room
    for the next block. The tokens are the reference's."""
    requires_fix(step, "step14_9")
    rng = random.Random(seed)
    max_running, block_size = rng.randint(1, 5), rng.choice([2, 4, 8])
    budget = block_size + max_running - 1 + rng.choice([0, 1, block_size, 3 * block_size])
    cfg = tiny_config(block_size=block_size, total_blocks=256)
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(cfg), max_running=max_running, max_num_batched_tokens=budget
    )
    rounds = watched(engine)
    prompts = random_shared_prefix_prompts(rng, cfg.vocab_size, max_prefix=40, max_tail=12)
    arrivals = sorted(rng.randint(0, 6) for _ in prompts)
    ids, decoding = [], set()
    for round_ in range(1000):
        while arrivals and arrivals[0] <= round_:
            arrivals.pop(0)
            ids.append(engine.add_request(prompts[len(ids)], 5))
        if not engine.has_work and not arrivals:
            break
        running = engine.scheduler.running
        before = {s.seq_id for s in running if s.status is SequenceStatus.RUNNING}
        engine.step()
        chunks = rounds.chunks[-1]
        assert sum(n for _, _, n, _ in chunks) <= budget
        assert before <= {seq_id for seq_id, _, _, _ in chunks}, "a decode row was left out"
        prefill = [c for c in chunks if c[0] not in before]
        decode_tokens = len(chunks) - len(prefill)
        for seq_id, start, n, total in prefill:
            end = start + n
            assert end % block_size == 0 or end == total, (seq_id, start, n, total)
            if end < total:  # cut: the next block did not fit in what the budget had left
                used = sum(c[2] for c in prefill[: prefill.index((seq_id, start, n, total))])
                assert budget - decode_tokens - used - n < block_size
        decoding |= before
    assert [engine.pop_output(i) for i in ids] == reference_tokens(cfg, prompts, 5)
    assert decoding, "the scenario decoded while it prefilled"


def test_decode_rows_count_first(step: ModuleType, make_engine) -> None:
    """Three requests decoding and a long prompt arriving: under a budget of 3 blocks, each
    round gives the three their token and the prompt what is left (two blocks), not the whole
    budget."""
    requires_fix(step, "step14_9")
    engine = make_engine(max_running=4, max_num_batched_tokens=3 * BS)
    rounds = watched(engine)
    short = [tokens(910 + i, BS) for i in range(3)]
    for prompt in short:
        engine.add_request(prompt, 20)
    engine.step()  # the three prompts, one chunk each
    long_id = engine.add_request(tokens(920, 10 * BS), 2)
    engine.step()
    got = sorted((n, seq_id == long_id) for seq_id, _, n, _ in rounds.chunks[-1])
    assert got == [(1, False)] * 3 + [(2 * BS, True)]


def test_a_preempted_decoders_token_stays_set_aside_for_the_round(
    step: ModuleType, make_engine
) -> None:
    """The decode tokens are set aside at the round's start, and a decoding request preempted
    later in the round keeps its: A decodes and needs a block, the pool has none, so V (the
    youngest, decoding) goes, and X's prefill chunk is cut from 13 - 2 tokens (two blocks), not
    from the 13 - 1 left once V is gone (three blocks would fit: V gave back four). A departure
    from vLLM, which never counted V; step14_9's README says so."""
    requires_fix(step, "step14_9")
    engine = make_engine(max_running=4, enable_prefix_cache=False, max_num_batched_tokens=13)
    rounds = watched(engine)
    a, x, v = (
        engine.add_request(tokens(930 + i, n), m)
        for i, (n, m) in enumerate([(BS, 40), (50 * BS, 2), (1, 40)])
    )
    while True:  # until A's next token starts a block, and V holds four blocks
        running = {seq.seq_id: seq for seq in engine.scheduler.running}
        seq_a, seq_x, seq_v = (running.get(i) for i in (a, x, v))
        if seq_v is not None and (seq_a.num_tokens - 1) % BS == 0 and len(seq_v.block_table) >= 4:
            break
        engine.step()
    assert seq_x.status is SequenceStatus.PREFILLING and seq_v.status is SequenceStatus.RUNNING
    block_manager = engine.kv_cache_manager.block_manager
    held = block_manager.allocate(block_manager.num_free)  # another tenant takes the rest
    engine.step()
    block_manager.free(held)
    assert seq_v.status is SequenceStatus.PREEMPTED and engine.stats.preemptions == 1
    chunks = {seq_id: n for seq_id, _, n, _ in rounds.chunks[-1]}
    assert chunks == {a: 1, x: 2 * BS}


# ---- sharing: every shared block still computed once -------------------------------------------


def test_a_later_request_adopts_what_an_earlier_chunk_of_the_round_cached(
    step: ModuleType, make_engine
) -> None:
    """Two requests behind a 5-block prefix, a budget of 4 blocks: the first computes blocks
    0-3, then in the next round block 4 and its tail; the second, admitted in that round,
    adopts all five blocks, block 4 registered by the first's chunk moments before. The model
    sees the prefix once."""
    requires_fix(step, "step14_9")
    prompts = shared_prefix_prompts(2, 5 * BS, 2, CFG.vocab_size, seed=5)
    engine = make_engine(max_running=2, max_num_batched_tokens=4 * BS)
    rounds = watched(engine)
    assert engine.generate(prompts, 3) == reference_tokens(CFG, prompts, 3)
    first, second = rounds.moves[1][:2], rounds.moves[1][2:]
    cached_by_first = [b for kind, seq_id, blocks in first for b in blocks if kind == "cache"]
    adopted = next(blocks for kind, _, blocks in second if kind == "adopt")
    assert len(adopted) == 5 and cached_by_first and cached_by_first[0] == adopted[4]
    s = engine.stats
    assert s.computed_prefill_tokens == 5 * BS + 2 * 2
    assert s.cached_tokens == 5 * BS and s.requests_hit == 1


def test_the_same_work_as_step14_8_in_fewer_rounds(step: ModuleType) -> None:
    """The bench's shape at a test's size, all admitted at once: step14_8's tokens and every
    figure but the rounds', in fewer rounds."""
    requires_fix(step, "step14_9")
    prompts = shared_prefix_prompts(8, 8 * BS, 2 * BS, CFG.vocab_size, seed=6)
    results = {}
    for name in ("step14_8", step.__name__):
        other = load_step(name)
        engine = other.PagedPrefixCacheEngine(other.TinyTransformerPaged(CFG), max_running=8)
        results[name] = engine.generate(prompts, 6), asdict(engine.stats)
    (old_tokens, old), (new_tokens, new) = results["step14_8"], results[step.__name__]
    assert new_tokens == old_tokens == reference_tokens(CFG, prompts, 6)
    assert same_work_figures(new, step) == same_work_figures(old, step)
    assert new["rounds"] < old["rounds"]


# ---- a budget the engine cannot work with -------------------------------------------------------


@pytest.mark.parametrize("bad", [0, BS + 2, 12.0, "64", True, None])
def test_a_budget_too_small_or_not_an_int_is_refused(step: ModuleType, bad: object) -> None:
    """At least a block beside every other running request's decode token (block_size +
    max_running - 1 = 7 here), an int; ``ValueError`` naming the field otherwise (None: the
    default)."""
    requires_fix(step, "step14_9")
    model = step.TinyTransformerPaged(CFG)
    if bad is None:
        assert step.PagedPrefixCacheEngine(model, max_running=4, max_num_batched_tokens=bad)
        return
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be an int >= .* = 7"):
        step.PagedPrefixCacheEngine(model, max_running=4, max_num_batched_tokens=bad)


def test_the_default_budget_grows_with_max_running(step: ModuleType) -> None:
    """512 tokens, or more when max_running needs them: the default never refuses."""
    requires_fix(step, "step14_9")
    model = step.TinyTransformerPaged(CFG)
    assert step.PagedPrefixCacheEngine(model, max_running=600).max_num_batched_tokens == 603
    assert prefill_chunk(step.PagedPrefixCacheEngine(model)) == 512


def test_the_smallest_budget_still_serves_everyone(step: ModuleType, make_engine) -> None:
    """The least budget (a block beside three decode tokens): requests of every length
    finish with the reference's tokens."""
    requires_fix(step, "step14_9")
    engine = make_engine(max_running=4, max_num_batched_tokens=BS + 3)
    prompts = [tokens(930 + i, n) for i, n in enumerate((1, 3 * BS + 1, 7, 2 * BS, 5 * BS + 3))]
    assert engine.generate(prompts, 6) == reference_tokens(CFG, prompts, 6)
