"""The mutation check's table (``tools/mutants.py``) still describes today's code.

The full mutation run takes an hour, so it is not part of the suite; but a mutant whose text no
longer occurs in its file silently stops being checked, and one that does not parse is caught
by a ``SyntaxError``, not by a test. Both are cheap to see without running a single mutant.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from front.steps import STEPS

ROOT = Path(__file__).resolve().parents[2]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


TOOL = load_tool()


def test_mutant_ids_are_unique_and_name_a_step() -> None:
    ids = [m.id for m in TOOL.MUTANTS]
    assert len(ids) == len(set(ids))
    assert {m.step for m in TOOL.MUTANTS} <= set(STEPS)


@pytest.mark.parametrize("mutant", TOOL.MUTANTS, ids=lambda m: m.id)
def test_each_mutant_applies_once_and_still_parses(mutant, tmp_path: Path) -> None:
    """Each mutant's text occurs exactly once in its file (else ``--list`` calls it stale), it
    changes the file, and the mutated file is still Python: a mutant must be a bug the tests
    catch, not a file that cannot be imported."""
    original = (ROOT / mutant.path).read_text()
    copy = tmp_path / mutant.path
    copy.parent.mkdir(parents=True)
    copy.write_text(original)
    TOOL.plant(tmp_path, mutant)
    mutated = copy.read_text()
    assert mutated != original
    ast.parse(mutated, filename=mutant.path)
