"""The chapter's demo (``python -m <step>.run``) in every step: the figures it must print."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import STEP_NAMES


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_demo_prints_the_chapter_figures(step_name: str, capsys: pytest.CaptureFixture) -> None:
    run = importlib.import_module(f"{step_name}.run")
    assert run.main(["--max-new-tokens", "4"]) == 0, "a check printed ❌"
    out = capsys.readouterr().out
    assert "Round 1 (cold cache), serial" in out and "hit rate 90% (9/10)" in out
    assert "Round 2 (hot cache), serial" in out and "hit rate 100% (10/10)" in out
    assert out.count("✅") == 4 and "❌" not in out
