"""step14_8's fix, beyond the chapter: cascade attention, the shared prefix read once per round.

Up to step14_7 every sequence of a round gathers its whole context in every layer, so a prefix
that all of them share is read once per sequence. From step14_8 the engine counts the leading
blocks that every running sequence holds (``KVCacheManager.num_common_prefix_blocks``, from the
reference counts, reading one block table), and ``forward_batched`` attends to them once for
every query of the round, to each sequence's own blocks apart, and merges the two by their
log-sum-exp. The specification: the same logits as one ``forward`` per sequence (float64, to
1e-10) in every shape of round; the merge is exact; the prefix's K/V is read once per layer;
the count is exactly the blocks every sequence's table starts with, up to the first chunk, and
it reads one table whatever the pool.
"""

from __future__ import annotations

import importlib
import math
import random
from types import ModuleType

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.helpers import (
    EngineFactory,
    has_fix,
    random_shared_prefix_prompts,
    reference_tokens,
    requires_fix,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size


def model_module(step: ModuleType) -> ModuleType:
    return importlib.import_module(f"{step.__name__}.model")


# ---- the model: forward_batched with shared blocks ---------------------------------------------

# Chunk lengths, and each sequence's own tokens already in the pool after the shared blocks:
# four or more sequences, none with more of its own than three blocks (the prefix is longer),
# so that reading the prefix once pays (use_cascade_attention).
ROUNDS = {
    "decode only": ((1, 1, 1, 1), (3, 9, 5, 0)),
    "decode, own context empty": ((1, 1, 1, 1), (0, 6, 2, 0)),
    "prefill chunks, ragged": ((4, 2, 3, 4), (0, 4, 7, 8)),
    "prefill then decode rows": ((4, 3, 1, 1, 1), (4, 0, 9, 2, 11)),
    "decode rows between chunks": ((1, 4, 1, 2), (6, 0, 11, 8)),
}
SHARED = 3  # blocks: 12 tokens, more than any sequence's own part above


def shared_round(cfg, num_shared: int, shape: str, seed: int = 0):
    """A round of sequences that all start with the same ``num_shared`` blocks: their models
    (one per path) with every history in the pool, and the round's chunks, tables, starts."""
    chunk_lens, own_lens = ROUNDS[shape]
    rng = random.Random(seed)
    blocks = list(range(cfg.total_blocks))
    rng.shuffle(blocks)
    shared, rest = blocks[:num_shared], blocks[num_shared:]
    per_seq = 5  # own blocks per table: room for the longest history and chunk
    tables = [shared + rest[i * per_seq : (i + 1) * per_seq] for i in range(len(chunk_lens))]
    prefix = [rng.randrange(cfg.vocab_size) for _ in range(num_shared * cfg.block_size)]
    histories = [prefix + [rng.randrange(cfg.vocab_size) for _ in range(n)] for n in own_lens]
    chunks = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in chunk_lens]
    starts = [len(h) for h in histories]
    return histories, chunks, tables, starts


def models_with_histories(step: ModuleType, cfg, histories, tables, count: int):
    """``count`` identical models, each with every history written through its table."""
    models = [step.TinyTransformerPaged(cfg) for _ in range(count)]
    for model in models:
        for history, table in zip(histories, tables):
            if history:
                model(history, table, 0)
    return models


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("num_shared", [SHARED, SHARED + 1])
@pytest.mark.parametrize("shape", list(ROUNDS))
def test_cascade_equals_per_sequence_forward(
    step: ModuleType, shape: str, num_shared: int, num_kv_heads: int
) -> None:
    """Every shape of round, cascaded, gives the last-token logits and the KV pool of one
    ``forward`` per sequence (float64: only a real difference shows), and the logits of the
    same round without cascading (step14_7's padded attention); and it read the shared blocks
    once per layer."""
    requires_fix(step, "step14_8")
    cfg = tiny_config(num_kv_heads=num_kv_heads)
    histories, chunks, tables, starts = shared_round(cfg, num_shared, shape, seed=num_kv_heads)
    cascaded, padded, serial = models_with_histories(step, cfg, histories, tables, 3)
    with PoolReads(cascaded) as reads:
        got = cascaded.forward_batched(chunks, tables, starts, num_shared)
    assert reads.slots == cascade_reads(cfg, num_shared, chunks, starts)
    flat = padded.forward_batched(chunks, tables, starts)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(got, flat, rtol=0, atol=1e-10)
    torch.testing.assert_close(cascaded.kv_pool_k, serial.kv_pool_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(cascaded.kv_pool_v, serial.kv_pool_v, rtol=0, atol=1e-12)


def cascade_reads(cfg, num_shared: int, chunks, starts) -> int:
    """Slots a cascaded round reads from the pools: per layer and for K and V, the shared
    blocks once, and each sequence's own part (padded to the longest)."""
    shared_len = num_shared * cfg.block_size
    own_len = max(s + len(c) for s, c in zip(starts, chunks)) - shared_len
    return 2 * cfg.num_layers * (shared_len + len(chunks) * own_len)


def grids(step: ModuleType, chunks) -> list[list[int]]:
    """The round's attention grids, by sequence: one grid until step14_9; from it on, chunks
    longer than a block attend on grids of their own, by length (its ``chunk_groups``)."""
    if not has_fix(step, "step14_9"):
        return [list(range(len(chunks)))]
    return model_module(step).chunk_groups([len(chunk) for chunk in chunks], CFG.block_size)


def whole_context_reads(cfg, chunks, starts) -> int:
    """Slots a padded round reads: every sequence's whole context, padded to the longest."""
    return 2 * cfg.num_layers * len(chunks) * max(s + len(c) for s, c in zip(starts, chunks))


def test_cascade_in_float32_stays_within_the_suites_tolerance(step: ModuleType) -> None:
    """float32: the cascaded logits are those of per-sequence ``forward`` within float32 noise,
    and every row's argmax (the greedy token) is the same."""
    requires_fix(step, "step14_8")
    cfg = tiny_config(dtype=torch.float32)
    histories, chunks, tables, starts = shared_round(cfg, SHARED, "prefill then decode rows")
    cascaded, serial = models_with_histories(step, cfg, histories, tables, 2)
    got = cascaded.forward_batched(chunks, tables, starts, SHARED)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    "num_seqs, own_tokens, cascaded",
    [(4, 12, True), (3, 12, False), (4, 13, False)],
    ids=["four-short", "three", "own-longer"],
)
def test_cascade_only_where_reading_the_prefix_once_pays(
    step: ModuleType, num_seqs: int, own_tokens: int, cascaded: bool
) -> None:
    """Decode rows behind three shared blocks (12 tokens) read the prefix once when at least
    four sequences share it and none has more of its own than that; otherwise each reads its
    whole context, as in step14_7 (there the fused kernel over whole contexts is faster). The
    logits are the same either way."""
    requires_fix(step, "step14_8")
    rng = random.Random(num_seqs + own_tokens)
    prefix = [rng.randrange(CFG.vocab_size) for _ in range(SHARED * BS)]
    own = [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in range(own_tokens)]
    histories = [prefix + own[own_tokens - 1 - i] for i in range(num_seqs)]  # longest first
    chunks = [[rng.randrange(CFG.vocab_size)] for _ in range(num_seqs)]
    starts = [len(h) for h in histories]
    tables = [list(range(SHARED)) + [10 * (i + 1) + j for j in range(4)] for i in range(num_seqs)]
    model, padded = models_with_histories(step, CFG, histories, tables, 2)
    with PoolReads(model) as reads:
        got = model.forward_batched(chunks, tables, starts, SHARED)
    if cascaded:
        assert reads.slots == cascade_reads(CFG, SHARED, chunks, starts)
    else:
        assert reads.slots == whole_context_reads(CFG, chunks, starts)
    torch.testing.assert_close(
        got, padded.forward_batched(chunks, tables, starts), rtol=0, atol=1e-10
    )


class PoolReads(TorchFunctionMode):
    """Counts the slots read out of a model's KV pools by ``index_select`` while active (one
    slot: a token's K, or its V, of every K/V head; a read of one head counts its share)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.pools = {model.kv_pool_k.untyped_storage().data_ptr(): model.kv_pool_k}
        self.pools[model.kv_pool_v.untyped_storage().data_ptr()] = model.kv_pool_v
        self.slot_size = model.cfg.num_kv_heads * model.cfg.d_head
        self.slots = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "index_select" and args[0].untyped_storage().data_ptr() in self.pools:
            self.slots += out.numel() // self.slot_size
        return out


@pytest.mark.parametrize(
    "tables, starts, why",
    [
        ([[5, 9], [6, 9]], [4, 4], "do not share their first 1 blocks"),
        ([[5, 9], [5, 7]], [3, 4], "reach past a chunk's first token"),
    ],
)
def test_shared_blocks_that_are_not_are_refused(step, tables, starts, why) -> None:
    """Blocks called shared must be the same blocks in every table and lie before every chunk;
    otherwise attention over them would mix sequences or miss the causal mask."""
    requires_fix(step, "step14_8")
    model = step.TinyTransformerPaged(CFG)
    with pytest.raises(ValueError, match=why):
        model.forward_batched([[1], [2]], tables, starts, 1)


# ---- the merge -----------------------------------------------------------------------------


@pytest.mark.parametrize("gap", [0.0, 50.0, 800.0], ids=["close", "far", "beyond-exp"])
def test_merging_two_partial_attentions_is_attention_over_both(step: ModuleType, gap) -> None:
    """Attention over keys A and B, computed apart and merged by their log-sum-exp, is softmax
    attention over A and B together (float64, to 1e-12), also when one part's scores exceed the
    other's by more than ``exp`` can hold (800: e^800 overflows float64)."""
    requires_fix(step, "step14_8")
    m = model_module(step)
    gen = torch.Generator().manual_seed(3)
    d = 9  # the last dimension lifts the second part's scores by ``gap``
    q = torch.randn(2, 5, d, generator=gen, dtype=torch.float64)
    keys = torch.randn(2, 11, d, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 11, d, generator=gen, dtype=torch.float64)
    q[..., -1], keys[..., -1] = 1.0, 0.0
    keys[:, 4:, -1] = gap * math.sqrt(d)
    mask = torch.ones(2, 5, 11, dtype=torch.bool)
    mask[1, 2, 6:] = False  # and a row that reads only part of the second
    scores = (q / math.sqrt(d)) @ keys.transpose(1, 2)
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
    q = q / math.sqrt(d)
    a = m.partial_attention(q, keys[:, :4], values[:, :4], mask[..., :4])
    b = m.partial_attention(q, keys[:, 4:], values[:, 4:], mask[..., 4:])
    got = m.merge_attention(a, b)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(m.merge_attention(b, a), want, rtol=0, atol=1e-12)


# ---- the engine: which blocks every row shares --------------------------------------------------


def record_rounds(engine) -> list[tuple[list[list[int]], list[int], int]]:
    """Wrap ``forward_batched``: each round logs its block tables (as they were), chunk
    starts and number of shared blocks."""
    log, real = [], engine.model.forward_batched

    def forward_batched(chunks, tables, starts, num_shared=0, **rows):
        log.append(([list(t) for t in tables], list(starts), num_shared))
        return real(chunks, tables, starts, num_shared, **rows)

    engine.model.forward_batched = forward_batched
    return log


def common_leading_blocks(tables: list[list[int]]) -> int:
    """How many leading block ids every table has in common, by comparing them all."""
    n = 0
    while all(len(t) > n and t[n] == tables[0][n] for t in tables):
        n += 1
    return n


@pytest.mark.parametrize("enable_prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_each_round_shares_exactly_the_common_leading_blocks(
    step: ModuleType, make_engine: EngineFactory, enable_prefix_cache: bool
) -> None:
    """Over random prompt sets (several prefixes, a pool tight enough to preempt, cold and hot
    rounds), every round's shared blocks are exactly the blocks that every table starts with,
    up to the block of the earliest chunk's first token, counted from the reference counts; a
    lone sequence shares nothing. Every request still gets the reference's tokens."""
    requires_fix(step, "step14_8")
    rng, cascaded = random.Random(8), 0
    for _ in range(12):
        prompts = random_shared_prefix_prompts(rng, CFG.vocab_size, max_prompts=6, max_groups=2)
        engine = make_engine(
            tiny_config(total_blocks=rng.choice([14, 64])),
            max_running=rng.choice([2, 4, 6]),
            enable_prefix_cache=enable_prefix_cache,
        )
        log = record_rounds(engine)
        for _ in range(2):  # cold, then hot
            assert engine.generate(prompts, 5) == reference_tokens(CFG, prompts, 5)
        for tables, starts, num_shared in log:
            common = common_leading_blocks(tables) if len(tables) > 1 else 0
            assert num_shared == min(common, min(starts) // BS)
            cascaded += num_shared > 0
    assert cascaded > 20 if enable_prefix_cache else cascaded == 0


def test_counting_the_shared_blocks_reads_one_table(step: ModuleType) -> None:
    """``num_common_prefix_blocks`` asks for the reference count of the table's leading blocks
    until one is not held by every running sequence: one table, never the pool, whatever the
    number of sequences."""
    requires_fix(step, "step14_8")
    for running, pool in ((3, 64), (8, 5000)):
        manager = step.KVCacheManager(pool, BS, enable_prefix_cache=True)
        prompt = tokens(820, 5 * BS)
        seqs = [step.Sequence(i, prompt + tokens(830 + i, 3), 4) for i in range(running)]
        for seq in seqs:
            hits = manager.get_computed_blocks(seq)
            assert manager.allocate_slots(seq, seq.num_tokens, hits)
            for n in range(BS, seq.num_tokens + 1, BS):
                manager.cache_blocks(seq, n)
        asked = record_ref_count_calls(manager.block_manager)
        assert manager.num_common_prefix_blocks(seqs[-1], running) == 5
        assert asked == seqs[-1].block_table[:6]  # the five shared blocks and the first own


def record_ref_count_calls(block_manager) -> list[int]:
    """Wrap ``block_manager.ref_count``: the block ids it is asked about, in order."""
    asked, real = [], block_manager.ref_count

    def ref_count(block_id: int) -> int:
        asked.append(block_id)
        return real(block_id)

    block_manager.ref_count = ref_count
    return asked


def test_a_shared_prefix_workload_reads_the_prefix_once_per_round(
    step: ModuleType, make_engine: EngineFactory
) -> None:
    """Six requests behind a three-block prefix, all at once. The first round computes the
    prefix (leapfrogging: nothing is shared yet); after it, every round of four or more
    requests reads the prefix once per layer in step14_8, and every round reads each request's
    whole context in step14_7. The tokens are the reference's."""
    requires_fix(step, "step14_7")
    engine = make_engine(max_running=6)
    prompts = [tokens(840, SHARED * BS) + tokens(850 + i, 1 + i) for i in range(6)]
    rounds, real = [], engine.model.forward_batched

    def forward_batched(chunks, tables, starts, *shared, **rows):
        with PoolReads(engine.model) as reads:
            logits = real(chunks, tables, starts, *shared, **rows)
        rounds.append((chunks, starts, reads.slots))
        return logits

    engine.model.forward_batched = forward_batched
    assert engine.generate(prompts, 4) == reference_tokens(CFG, prompts, 4)
    for i, (chunks, starts, slots) in enumerate(rounds):
        expected = 0
        for grid in grids(step, chunks):  # from step14_9 on, long chunks attend apart
            mine, at = [chunks[j] for j in grid], [starts[j] for j in grid]
            if has_fix(step, "step14_8") and i > 0 and len(mine) >= 4:
                expected += cascade_reads(CFG, SHARED, mine, at)
            else:
                expected += whole_context_reads(CFG, mine, at)
        assert slots == expected, i
    assert sum(len(chunks) >= 4 for chunks, _, _ in rounds[1:]) >= 3  # the 3 decode rounds
