"""step14_2's fix: the KV gather, one flat-index gather instead of a loop over blocks + cat.

Before step14_2 ``_gather_kv`` reads the context block by block (the last one only as far as
it is filled) and concatenates the pieces. From step14_2 the slots of every context position
are computed once per forward and one ``index_select`` reads them all, through the same flat
view of the pool the write uses. The specification: attention reads exactly the context's
slots, in position order, wherever the blocks lie (a slot outside them may hold anything, even
NaN, and the logits are still the reference's); the gather has no Python loop from step14_2 on,
and has one before it.

    python -m pytest bench/suites/test_ops.py -k gather_kv   # what the fix buys
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
    reference_model,
    tiny_config,
    tokens,
)

CFG = tiny_config()
BS = CFG.block_size
F64_REL_TOL = 1e-9  # as in test_model.py: only summation order differs


@pytest.mark.parametrize("table", [[11, 3, 7], [2, 1, 0]], ids=["scattered", "descending"])
def test_attention_reads_the_context_slots_and_nothing_else(
    step: ModuleType, table: list[int]
) -> None:
    """Every slot of the pool starts as NaN: a gather that reads one slot outside the
    context (the unfilled end of the last block, a block not in the table) turns the logits
    into NaN; one that reads the blocks out of order gives other logits than the reference."""
    prompt = tokens(810, 3 * BS - 1)
    model = step.TinyTransformerPaged(CFG)
    model.kv_pool_k.fill_(float("nan"))
    model.kv_pool_v.fill_(float("nan"))
    logits, start = [], 0
    for size in (5, 1, 3, 2):
        logits.append(model(prompt[start : start + size], table, start))
        start += size
    got, expected = torch.cat(logits), reference_model(CFG)(prompt)
    assert torch.isfinite(got).all(), "a slot outside the context was read"
    assert (got - expected).abs().max().item() <= F64_REL_TOL * expected.abs().max().item()


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_the_kv_gather_is_one_indexed_read_from_step14_2(step_name: str) -> None:
    loops = python_loops(function_tree(step_name, "model.py", "TinyTransformerPaged._gather_kv"))
    if has_fix(step_name, "step14_2"):
        assert loops == []
    else:  # the inefficiency step14_2 removes is really there before it
        assert loops, "the gather reads block by block before step14_2"
