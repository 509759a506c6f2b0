"""The tutorial's shape: each step is the one before it plus exactly one fix.

A learner runs ``diff -ru step14_3 step14_4`` and must see one idea; these tests fail as soon as
a change lands in a file that the design does not name for that step, or a shared fix reaches
only some of the steps. (That each step's fix is really there, and the inefficiency it removes
really there before it, is checked by the step's own file, ``test_step14_*.py``.)
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from common.front.steps import FIXES, STEPS
from tests.helpers import ROOT, STEP_NAMES, step_files

PAIRS = [(a, b) for a, b in pairwise(STEPS) if a in STEP_NAMES and b in STEP_NAMES]


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[b for _, b in PAIRS])
def test_adjacent_steps_differ_only_in_the_named_files(before: str, after: str) -> None:
    old, new = step_files(before), step_files(after)
    assert old.keys() == new.keys(), "every step has the same files"
    changed = {name for name in new if old[name] != new[name]} - {"README.md"}
    assert changed == set(FIXES[after][0])


# A step's entry points: front ends of a few lines each, the same in every step.
ENTRY_POINTS = ("run.py", "serve.py")


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_step_has_its_own_readme_and_the_shared_entry_points(step_name: str) -> None:
    files = step_files(step_name)
    assert b"diff -ru" in files["README.md"] or step_name == "step14"
    for name in ENTRY_POINTS:
        assert files[name] == step_files("step14")[name], name


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_no_step_names_itself_in_code(step_name: str) -> None:
    """Relative imports only, so that copying a step changes nothing but the fix."""
    for name, content in step_files(step_name).items():
        if name.endswith(".py"):
            assert step_name.encode() not in content, name


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules a file imports (relative imports resolved)."""
    package = path.relative_to(ROOT).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def is_front_end_or_step(name: str) -> bool:
    return name.startswith("common.front") or name.split(".")[0] in STEPS or name == "bench"


CORE = sorted(p for p in (ROOT / "common").glob("*.py"))


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_imports_no_front_end_and_no_step(path: Path) -> None:
    """``common/`` is what a step is built on: it imports neither the front ends
    (``common/front/``) nor a step, so imports run one way, front ends -> steps -> core."""
    assert not [name for name in imported_modules(path) if is_front_end_or_step(name)]


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_a_steps_engine_imports_only_its_own_files_and_the_core(step_name: str) -> None:
    """Every file of a step but its entry points (``run.py``, ``serve.py``: front ends) imports
    the core of ``common/`` and its own step's files (relatively), never a front end or another
    step."""
    for path in sorted((ROOT / step_name).glob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        outside = {
            name
            for name in imported_modules(path)
            if is_front_end_or_step(name) and name.split(".")[0] != step_name
        }
        assert not outside, (path.name, outside)
        assert not any(name.startswith("common.front") for name in imported_modules(path))
