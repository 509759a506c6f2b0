"""step14_3's fix: attention over all heads in one batched matmul instead of a loop over heads.

Before step14_3 ``_attention`` computes one head at a time. From step14_3 heads are the batch
dimension of one matmul, and the ``group`` query heads that share a K/V head (grouped-query
attention) are stacked so that each K/V head is read once. The specification: query head ``h``
attends, causally, with K/V head ``h // group`` and only with it, with the numbers of the
per-head computation written out below (multi-head, grouped-query and multi-query alike, a
chunk or one decode token); the attention has no Python loop from step14_3 on, and has one
before it.

    python -m pytest bench/suites/test_ops.py -k attention   # what the fix buys
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.helpers import STEP_NAMES, function_tree, has_fix, python_loops, tiny_config


def per_head_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, group: int
) -> torch.Tensor:
    """The definition, one head at a time: query ``i`` (at ``start_pos + i``) attends to keys
    ``0 .. start_pos + i`` of K/V head ``h // group``."""
    num_queries, d_head = q.shape[0], q.shape[2]
    key_pos = torch.arange(keys.shape[0])
    visible = key_pos[None, :] <= start_pos + torch.arange(num_queries)[:, None]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = q[:, h] @ keys[:, h // group].T / math.sqrt(d_head)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[:, h] = probs @ values[:, h // group]
    return out


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa-4-per-kv", "mqa"])
@pytest.mark.parametrize(("num_queries", "start_pos"), [(5, 6), (1, 10)], ids=["chunk", "decode"])
def test_each_query_head_attends_with_its_own_kv_head(
    step: ModuleType, heads: tuple[int, int], num_queries: int, start_pos: int
) -> None:
    num_heads, num_kv_heads = heads
    cfg = tiny_config(num_heads=num_heads, num_kv_heads=num_kv_heads)
    gen = torch.Generator().manual_seed(num_heads + num_kv_heads)
    context = start_pos + num_queries
    q = torch.randn(num_queries, num_heads, cfg.d_head, generator=gen, dtype=torch.float64)
    keys, values = (
        torch.randn(context, num_kv_heads, cfg.d_head, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    got = step.TinyTransformerPaged(cfg)._attention(q, keys, values, start_pos)
    want = per_head_attention(q, keys, values, start_pos, cfg.num_queries_per_kv)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_attention_is_one_batched_matmul_from_step14_3(step_name: str) -> None:
    loops = python_loops(function_tree(step_name, "model.py", "TinyTransformerPaged._attention"))
    if has_fix(step_name, "step14_3"):
        assert loops == []
    else:  # the inefficiency step14_3 removes is really there before it
        assert loops, "attention runs head by head before step14_3"
