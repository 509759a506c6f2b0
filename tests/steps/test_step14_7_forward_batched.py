"""step14_7's fix: ``forward_batched``, every scheduled sequence of a round in one model call.

Before step14_7 the engine calls ``model(...)`` once per scheduled sequence per round. From
step14_7 ``forward_batched`` takes the tokens of many sequences as one flat batch; per layer,
every token's K/V is written before any sequence's attention reads the pool, so a block that
one sequence writes in a round can be read, in the same call, by a sequence that adopted it.
The specification: ``forward_batched`` gives the last-token logits and the KV pool of one
``forward`` per sequence, a reader sees what a writer later in the same batch writes, and the
engine makes one ``forward_batched`` call per round and no ``forward`` call (before the fix:
one ``forward`` per scheduled sequence).
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from tests.helpers import (
    EngineFactory,
    has_fix,
    log_schedules,
    reference_tokens,
    requires_fix,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size


# ---- the model: forward_batched ---------------------------------------------------------------


def run_history(model: torch.nn.Module, prompts: list[list[int]], tables: list[list[int]]):
    """Put each prompt's KV into the pool with per-sequence forward calls."""
    for prompt, table in zip(prompts, tables, strict=True):
        model(prompt, table, 0)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_forward_batched_equals_per_sequence_forward(step: ModuleType, num_kv_heads: int) -> None:
    """A mixed round — prefill chunks of several sizes and one-token chunks (decode rows, one
    padded batch), over contexts of different lengths and scattered block tables — gives the
    same last-token logits and the same KV pool as one ``forward`` per sequence."""
    requires_fix(step, "step14_7")
    cfg = tiny_config(num_kv_heads=num_kv_heads)
    rng = random.Random(7)
    history_lens, chunk_lens = (0, 5, 8, 13, 0, 0, 2), (4, 1, 3, 1, 9, 1, 1)
    histories = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in history_lens]
    chunks = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in chunk_lens]
    blocks = list(range(cfg.total_blocks))
    rng.shuffle(blocks)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(len(chunks))]
    batched, serial = step.TinyTransformerPaged(cfg), step.TinyTransformerPaged(cfg)
    for model in (batched, serial):
        run_history(model, [h for h in histories if h], [t for h, t in zip(histories, tables) if h])
    starts = [len(h) for h in histories]
    got = batched.forward_batched(chunks, tables, starts)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(batched.kv_pool_k, serial.kv_pool_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(batched.kv_pool_v, serial.kv_pool_v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reader_len", [1, 3], ids=["decode-reader", "chunk-reader"])
def test_forward_batched_writes_every_kv_before_any_attention(
    step: ModuleType, reader_len: int
) -> None:
    """A batch where the FIRST sequence reads, as context, a block the SECOND one writes in
    the same call: it must see that KV, as if the second had run before it (per layer, every
    token's K/V is written before any sequence's attention reads the pool)."""
    requires_fix(step, "step14_7")
    shared, own = tokens(580, BS), tokens(581, reader_len)
    batched, serial = step.TinyTransformerPaged(CFG), step.TinyTransformerPaged(CFG)
    got = batched.forward_batched([own, shared], [[5, 9], [5]], [BS, 0])
    writer = serial(shared, [5], 0)[-1]
    reader = serial(own, [5, 9], BS)[-1]
    torch.testing.assert_close(got, torch.stack([reader, writer]), rtol=0, atol=1e-10)


# ---- the engine: one call per round -----------------------------------------------------------


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
    scheduled = sum(len(ran) for ran in log)
    if has_fix(step, "step14_7"):
        assert calls == {"forward": 0, "forward_batched": len(log)}
    else:
        assert calls == {"forward": scheduled, "forward_batched": 0}
    assert scheduled == engine.stats.seqs_scheduled and len(log) == engine.stats.rounds


# ---- every shape of round ------------------------------------------------------------------


ROUNDS = {
    # chunk lengths, and the tokens each sequence already has in the pool
    "decode only, equal contexts": ((1, 1, 1, 1), (8, 8, 8, 8)),
    "decode only, ragged contexts": ((1, 1, 1), (3, 12, 7)),
    "prefill only, full chunks": ((4, 4, 4), (0, 4, 8)),
    "prefill only, ragged chunks": ((4, 2, 3), (0, 8, 5)),
    "prefill then decode rows": ((4, 3, 1, 1), (4, 0, 9, 2)),
    "decode rows between chunks": ((1, 4, 1, 2), (6, 0, 11, 8)),
    "one sequence, one token": ((1,), (0,)),
}


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("shape", list(ROUNDS))
def test_every_round_shape_matches_per_sequence_forward(
    step: ModuleType, shape: str, num_kv_heads: int
) -> None:
    """Every way a round can be shaped (decode rows only, prefill chunks only, both, in any
    order, ragged contexts) goes through ``forward_batched``'s padded attention paths and
    gives what one ``forward`` per sequence gives (float64: only a real difference shows)."""
    requires_fix(step, "step14_7")
    cfg = tiny_config(num_kv_heads=num_kv_heads)
    chunk_lens, history_lens = ROUNDS[shape]
    rng = random.Random(len(shape))
    blocks = list(range(cfg.total_blocks))
    rng.shuffle(blocks)
    tables = [blocks[i * 6 : (i + 1) * 6] for i in range(len(chunk_lens))]
    histories = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in history_lens]
    chunks = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in chunk_lens]
    batched, serial = step.TinyTransformerPaged(cfg), step.TinyTransformerPaged(cfg)
    for model in (batched, serial):
        for history, table in zip(histories, tables):
            if history:
                model(history, table, 0)
    starts = list(history_lens)
    got = batched.forward_batched(chunks, tables, starts)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(batched.kv_pool_k, serial.kv_pool_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(batched.kv_pool_v, serial.kv_pool_v, rtol=0, atol=1e-12)
