"""step14_6's fix: ``BlockManager.release()``, so the engine never pokes BlockManager's internals.

Before step14_6 the KV cache manager drops a finished request's references to the blocks it
adopted from the cache by decrementing ``block_manager._blocks[bid].ref_count`` itself. From
step14_6 ``release(bid)`` is the mirror of ``retain(bid)``, with the same checks (misuse
raises and changes nothing), and the engine uses only BlockManager's public methods. The
specification: ``release`` undoes ``retain``; from step14_6 no file of the step touches
``block_manager._...``, and before it the inefficiency is really there (in
``kv_cache_manager.py``, and nowhere else).
"""

from __future__ import annotations

import ast
from types import ModuleType

import pytest

from tests.helpers import (
    STEP_NAMES,
    assert_raises_unchanged,
    has_fix,
    requires_fix,
    step_files,
)

TOTAL = 6  # as in test_block_manager.py


def test_release_mirrors_retain(step: ModuleType) -> None:
    """``release`` drops the reference ``retain`` added; releasing a free block is misuse."""
    requires_fix(step, "step14_6")
    bm = step.BlockManager(TOTAL)
    (bid,) = bm.allocate(1)
    bm.retain(bid)
    bm.release(bid)
    assert bm.ref_count(bid) == 1
    assert bm.num_free == TOTAL - 1
    bm.free([bid])
    assert_raises_unchanged(bm, ValueError, lambda: bm.release(bid))


def private_block_manager_uses(source: str) -> list[str]:
    """``<...>.block_manager._something`` attribute accesses in a module's source."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "block_manager"
        ):
            uses.append(ast.unparse(node))
    return uses


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_engine_uses_block_manager_public_methods_only_from_step14_6(step_name: str) -> None:
    """The engine's memory bookkeeping (kv_cache_manager.py) pokes BlockManager's internals
    until step14_6 gives it release(); no other file of a step ever does."""
    files = step_files(step_name)
    others = [n for n in files if n.endswith(".py") and n != "kv_cache_manager.py"]
    assert all(private_block_manager_uses(files[n].decode()) == [] for n in others)
    uses = private_block_manager_uses(files["kv_cache_manager.py"].decode())
    if has_fix(step_name, "step14_6"):
        assert uses == []
    else:  # the inefficiency step14_6 removes is really there before it
        assert "self.block_manager._blocks" in uses
