"""The tutorial's shape: each step is the one before it plus exactly one fix.

A learner runs ``diff -ru step14_3 step14_4`` and must see one idea; these tests fail as soon as
a change lands in a file that the design does not name for that step, or a shared fix reaches
only some of the steps. (That each step's fix is really there, and the inefficiency it removes
really there before it, is checked by the step's own file, ``test_step14_*.py``.)
"""

from __future__ import annotations

from itertools import pairwise

import pytest

from common.steps import FIXES, STEPS
from tests.helpers import STEP_NAMES, step_files

PAIRS = [(a, b) for a, b in pairwise(STEPS) if a in STEP_NAMES and b in STEP_NAMES]


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
