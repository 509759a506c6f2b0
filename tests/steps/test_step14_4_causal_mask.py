"""step14_4's fix: the causal mask, one broadcast comparison, and none at all for decode.

Before step14_4 ``_causal_mask`` fills the mask row by row, even for a one-token decode step,
whose single query may see the whole context anyway. From step14_4 one comparison of query
positions (a column) against key positions (a row) builds it, and a decode step gets no mask
(``None``). The specification: query ``i`` of a chunk starting at ``start_pos`` sees keys
``0 .. start_pos + i`` and no later one, so no row of a chunk's logits depends on a later token
of the chunk; a decode token gets no mask from step14_4 on (an all-visible row before it); the
mask has no Python loop from step14_4 on, and has one before it.

    python -m pytest bench/suites/test_ops.py -k causal_mask   # what the fix buys
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
INF = float("inf")


def test_query_i_sees_keys_up_to_its_own_position(step: ModuleType) -> None:
    mask = step.TinyTransformerPaged(CFG)._causal_mask(3, 2)
    expected = torch.tensor(
        [[0, 0, 0, -INF, -INF], [0, 0, 0, 0, -INF], [0, 0, 0, 0, 0]], dtype=CFG.dtype
    )
    assert torch.equal(mask, expected)


def test_a_decode_token_gets_no_mask_from_step14_4(step: ModuleType) -> None:
    mask = step.TinyTransformerPaged(CFG)._causal_mask(1, 5)
    if has_fix(step, "step14_4"):
        assert mask is None
    else:  # before step14_4 the one row is built anyway, and hides nothing
        assert torch.equal(mask, torch.zeros(1, 6, dtype=CFG.dtype))


def test_no_row_of_a_chunk_sees_a_later_token(step: ModuleType) -> None:
    """The same 7-token chunk behind one cached block, twice, with only its last token
    changed: every earlier row's logits are exactly as they were, the last row's are not."""
    prompt = tokens(830, BS + 7)
    table = [5, 1, 8]
    changed = [*prompt[:-1], (prompt[-1] + 1) % CFG.vocab_size]
    rows = []
    for ids in (prompt, changed):
        model = step.TinyTransformerPaged(CFG)
        model(ids[:BS], table, 0)
        rows.append(model(ids[BS:], table, BS))
    assert torch.equal(rows[0][:-1], rows[1][:-1])
    assert not torch.allclose(rows[0][-1], rows[1][-1])


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_the_mask_is_one_comparison_from_step14_4(step_name: str) -> None:
    loops = python_loops(function_tree(step_name, "model.py", "TinyTransformerPaged._causal_mask"))
    if has_fix(step_name, "step14_4"):
        assert loops == []
    else:  # the inefficiency step14_4 removes is really there before it
        assert loops, "the mask is built row by row before step14_4"
