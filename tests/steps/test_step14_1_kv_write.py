"""step14_1's fix: the KV write, one scatter instead of a per-token loop.

step14's ``_write_kv`` stores a chunk's K/V with one small indexed write per token, in every
layer. From step14_1 each token's physical slot, ``block_table[pos // bs] * bs + pos % bs``, is
computed once per forward (``_slot_mapping``, vLLM's ``slot_mapping``) and one advanced-indexing
assignment writes all of them. The specification: wherever a sequence's blocks lie and however
it is chunked, the K/V of position ``p`` lands in slot ``p % bs`` of block ``block_table[p //
bs]``, in every layer, and no other slot of the pool changes; the write has no Python loop from
step14_1 on, and has one before it.

    python -m pytest bench/suites/test_ops.py -k write_kv   # what the fix buys
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.helpers import (
    STEP_NAMES,
    function_tree,
    has_fix,
    python_loops,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size
SENTINEL = 7.25  # every slot holds it before the test writes: one still holding it is untouched


def run_chunks(model: torch.nn.Module, prompt: list[int], table: list[int], sizes: list[int]):
    start = 0
    for size in sizes:
        model(prompt[start : start + size], table, start)
        start += size


def test_each_tokens_kv_lands_in_its_slot_and_nowhere_else(step: ModuleType) -> None:
    """A 3-block sequence (the last block partial) in chunks that straddle blocks, once in
    blocks 0, 1, 2 and once in blocks 9, 2, 30: every position's K/V is in its slot of the
    scattered table, and every other slot of the pool, in every layer, is as it was."""
    prompt = tokens(800, 3 * BS - 1)
    table = [9, 2, 30]
    contiguous, scattered = step.TinyTransformerPaged(CFG), step.TinyTransformerPaged(CFG)
    for model in (contiguous, scattered):
        model.kv_pool_k.fill_(SENTINEL)
        model.kv_pool_v.fill_(SENTINEL)
    run_chunks(contiguous, prompt, list(range(len(table))), [3, 1, 5, 2])
    run_chunks(scattered, prompt, table, [3, 1, 5, 2])
    written = torch.zeros(CFG.total_blocks, BS, dtype=torch.bool)
    for pos in range(len(prompt)):
        written[table[pos // BS], pos % BS] = True
    for name in ("kv_pool_k", "kv_pool_v"):
        want, got = getattr(contiguous, name), getattr(scattered, name)
        for pos in range(len(prompt)):
            block, offset = table[pos // BS], pos % BS
            torch.testing.assert_close(
                got[:, block, offset], want[:, pos // BS, offset], rtol=0, atol=1e-12
            )
        assert (got[:, ~written] == SENTINEL).all(), f"{name}: a slot outside the table changed"
        assert not (got[:, written] == SENTINEL).any(), f"{name}: a position was not written"


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_the_kv_write_is_one_scatter_from_step14_1(step_name: str) -> None:
    loops = python_loops(function_tree(step_name, "model.py", "TinyTransformerPaged._write_kv"))
    if has_fix(step_name, "step14_1"):
        assert loops == []
    else:  # the inefficiency step14_1 removes is really there before it
        assert loops, "step14 writes the K/V token by token"
