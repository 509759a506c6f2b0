"""Micro-benchmarks of the four model.py fixes: each operation in the step before the fix
against the step that fixes it, calling each step's own code.

    python -m pytest bench/suites/test_ops.py              # all: before/after, per size
    python -m pytest bench/suites/test_ops.py -k write_kv  # one operation
    python -m pytest bench/suites/test_ops.py --benchmark-group-by=param:op   # every size of an op

Sizes: T = 1 (a decode token), 16 (a prefill chunk of one block), 256 (a long chunk) new tokens,
over a context of 512 or 4096 tokens, with a shuffled (non-contiguous) block table.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from common.config import preset
from common.numbers import cdiv
from front.steps import available_steps, load_step

CFG = preset("bench", total_blocks=(4096 + 256) // 16 + 8)
CASES = [(t, ctx) for ctx in (512, 4096) for t in (1, 16, 256)]

# operation -> (step before the fix, step with the fix)
PAIRS = {
    "write_kv": ("step14", "step14_1"),
    "gather_kv": ("step14_1", "step14_2"),
    "attention": ("step14_2", "step14_3"),
    "causal_mask": ("step14_3", "step14_4"),
}
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(step_name: str) -> torch.nn.Module:
    if step_name not in available_steps():
        pytest.skip(f"{step_name} does not exist yet")
    if step_name not in _MODELS:
        _MODELS[step_name] = load_step(step_name).TinyTransformerPaged(CFG)
    return _MODELS[step_name]


def shuffled_block_table(num_tokens: int) -> list[int]:
    table = list(range(CFG.total_blocks))
    random.Random(0).shuffle(table)
    return table[: cdiv(num_tokens, CFG.block_size)]


def heads(n: int) -> torch.Tensor:
    return torch.randn(n, CFG.num_heads, CFG.d_head, generator=torch.Generator().manual_seed(n))


def write_kv_call(model, step_name: str, t: int, ctx: int) -> Callable[[], object]:
    table, start, k, v = shuffled_block_table(ctx), ctx - t, heads(t), heads(t)
    if step_name == "step14":
        return lambda: model._write_kv(0, k, v, table, start)
    # The slot mapping is part of the fix's cost (computed once per forward, shared by layers).
    return lambda: model._write_kv(0, k, v, model._slot_mapping(table, start, t))


def gather_kv_call(model, step_name: str, t: int, ctx: int) -> Callable[[], object]:
    table = shuffled_block_table(ctx)
    if step_name == "step14_1":
        return lambda: model._gather_kv(0, table, ctx)
    return lambda: model._gather_kv(0, model._slot_mapping(table, 0, ctx))


def attention_call(model, step_name: str, t: int, ctx: int) -> Callable[[], object]:
    q, keys, values = heads(t), heads(ctx), heads(ctx)
    return lambda: model._attention(q, keys, values, ctx - t)


def causal_mask_call(model, step_name: str, t: int, ctx: int) -> Callable[[], object]:
    return lambda: model._causal_mask(t, ctx - t)


CALLS = {
    "write_kv": write_kv_call,
    "gather_kv": gather_kv_call,
    "attention": attention_call,
    "causal_mask": causal_mask_call,
}


@pytest.mark.parametrize("case", CASES, ids=[f"T{t}-ctx{c}" for t, c in CASES])
@pytest.mark.parametrize("version", ["before", "after"])
@pytest.mark.parametrize("op", list(PAIRS))
def test_op(benchmark, op: str, version: str, case: tuple[int, int]) -> None:
    step_name = PAIRS[op][version == "after"]
    model = model_of(step_name)
    benchmark.group = f"{op} T={case[0]} ctx={case[1]}"
    benchmark.extra_info["step"] = step_name
    with torch.inference_mode():
        benchmark(CALLS[op](model, step_name, *case))


def observed(op: str, step_name: str, case: tuple[int, int]) -> list[torch.Tensor]:
    """What an operation produces: its result, or for the write, the pool it wrote."""
    model = model_of(step_name)
    with torch.inference_mode():
        for i, pool in enumerate((model.kv_pool_k, model.kv_pool_v)):  # same start in both
            gen = torch.Generator().manual_seed(i)
            pool.copy_(torch.randn(pool.shape, generator=gen, dtype=pool.dtype))
        result = CALLS[op](model, step_name, *case)()
        if op == "write_kv":
            return [model.kv_pool_k[0].clone(), model.kv_pool_v[0].clone()]
        if op == "causal_mask" and result is None:  # no mask (decode) = nothing masked
            return [torch.zeros(case[0], case[1], dtype=CFG.dtype)]
        return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("case", CASES, ids=[f"T{t}-ctx{c}" for t, c in CASES])
@pytest.mark.parametrize("op", list(PAIRS))
def test_fix_computes_the_same(op: str, case: tuple[int, int]) -> None:
    """The benchmarks compare like with like: before and after give the same numbers."""
    before, after = (observed(op, name, case) for name in PAIRS[op])
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
