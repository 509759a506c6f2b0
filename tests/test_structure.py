"""The tutorial's shape: each step is the one before it plus exactly one fix.

A learner runs ``diff -ru step14_3 step14_4`` and must see one idea; these tests fail as soon as
a change lands in a file that the design does not name for that step, or a shared fix reaches
only some of the steps.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from common.steps import FIXES, STEPS
from tests.conftest import STEP_NAMES

ROOT = Path(__file__).resolve().parent.parent
PAIRS = [(a, b) for a, b in pairwise(STEPS) if a in STEP_NAMES and b in STEP_NAMES]


def step_files(step_name: str) -> dict[str, bytes]:
    folder = ROOT / step_name
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[b for _, b in PAIRS])
def test_adjacent_steps_differ_only_in_the_named_files(before: str, after: str) -> None:
    old, new = step_files(before), step_files(after)
    assert old.keys() == new.keys(), "every step has the same files"
    changed = {name for name in new if old[name] != new[name]} - {"README.md"}
    assert changed == set(FIXES[after][0])


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_step_has_its_own_readme_and_the_shared_run_py(step_name: str) -> None:
    files = step_files(step_name)
    assert b"diff -ru" in files["README.md"] or step_name == "step14"
    assert files["run.py"] == step_files("step14")["run.py"]


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_no_step_names_itself_in_code(step_name: str) -> None:
    """Relative imports only, so that copying a step changes nothing but the fix."""
    for name, content in step_files(step_name).items():
        if name.endswith(".py"):
            assert step_name.encode() not in content, name


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
    if STEPS.index(step_name) >= STEPS.index("step14_6"):
        assert uses == []
    else:  # the inefficiency step14_6 removes is really there before it
        assert "self.block_manager._blocks" in uses
