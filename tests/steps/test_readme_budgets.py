"""The steps' READMEs stay short enough to read: step14's holds the chapter's ideas in at most
420 lines, each later step's holds its one fix in at most 180 (the problem, the fix, why it
computes the same, one measured result with its command, how vLLM does it). Measurement tables
and tool how-tos live in docs/ (docs/measurements.md, docs/tools.md, docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, STEP_NAMES

FIRST_STEP_BUDGET = 420  # step14: the whole engine, the chapter, the walk-throughs
LATER_STEP_BUDGET = 180  # step14_1 on: one fix each


def budget(step_name: str) -> int:
    return FIRST_STEP_BUDGET if step_name == STEP_NAMES[0] else LATER_STEP_BUDGET


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_step_readme_is_within_its_line_budget(step_name: str) -> None:
    lines = (ROOT / step_name / "README.md").read_text().count("\n")
    assert lines <= budget(step_name), (
        f"{step_name}/README.md has {lines} lines, over its budget of {budget(step_name)}: "
        "move measurement tables and tool how-tos to docs/"
    )


def test_the_first_step_is_step14() -> None:
    """The larger budget belongs to the chapter's engine, and only to it."""
    assert STEP_NAMES[0] == "step14"
