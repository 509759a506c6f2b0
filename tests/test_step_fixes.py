"""Tests of what particular steps change: each fix does what its README claims."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from common import hashing
from common.steps import STEPS
from tests.conftest import EngineFactory, reference_tokens, tiny_config


def is_at_or_after(step: ModuleType, name: str) -> bool:
    return STEPS.index(step.__name__) >= STEPS.index(name)


def count_hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``common.hashing.hash_block`` (every chain link goes through it) with a counter."""
    calls, real = [0], hashing.hash_block

    def counting(parent_hash: int, token_ids: list[int]) -> int:
        calls[0] += 1
        return real(parent_hash, token_ids)

    monkeypatch.setattr(hashing, "hash_block", counting)
    return calls


def test_each_full_block_is_hashed_once_from_step14_5(
    step: ModuleType, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24-block prompt (plus 3 tokens) and 2 new tokens: 25 full blocks in all (the first
    decode token completes block 24). From step14_5 each is hashed once, cold or hot."""
    cfg = tiny_config()
    bs, num_blocks = cfg.block_size, 24
    prompt = [random.Random(5).randrange(cfg.vocab_size) for _ in range(num_blocks * bs + 3)]
    full_blocks = (len(prompt) + 2 - 1) // bs  # every token but the last generated has KV
    lookup_blocks = (len(prompt) - 1) // bs  # blocks before the last prompt token's block
    calls = count_hash_calls(monkeypatch)
    engine = make_engine(cfg)
    counts = []
    for _ in range(2):  # cold, then hot
        calls[0] = 0
        assert engine.generate([prompt], 2) == reference_tokens(cfg, [prompt], 2)
        counts.append(calls[0])
    print(f"{step.__name__}: hash_block calls for a {num_blocks}-block prompt, cold/hot: {counts}")
    if is_at_or_after(step, "step14_5"):
        assert counts == [full_blocks, full_blocks]
    else:
        # Cold: each of the 24 chunks that may still hit re-hashes the 24 lookup blocks, and
        # caching block i re-hashes the chain 0..i. Hot: one lookup hits all 24, then block 24
        # is cached after the first decode token.
        rehash_chains = full_blocks * (full_blocks + 1) // 2
        assert counts == [
            lookup_blocks * lookup_blocks + rehash_chains,
            lookup_blocks + full_blocks,
        ]


def run_history(model: torch.nn.Module, prompts: list[list[int]], tables: list[list[int]]):
    """Put each prompt's KV into the pool with per-sequence forward calls."""
    for prompt, table in zip(prompts, tables, strict=True):
        model(prompt, table, 0)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_forward_batched_equals_per_sequence_forward(step: ModuleType, num_kv_heads: int) -> None:
    """A mixed round — prefill chunks of several sizes and one-token chunks (decode rows, one
    padded batch), over contexts of different lengths and scattered block tables — gives the
    same last-token logits and the same KV pool as one ``forward`` per sequence."""
    if not hasattr(step.TinyTransformerPaged, "forward_batched"):
        pytest.skip("forward_batched arrives in step14_7")
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
