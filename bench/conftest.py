"""pytest settings for the benchmark suites (``python -m pytest bench/...``).

Runs saved with ``--benchmark-autosave`` or ``--benchmark-save=NAME`` go to ``bench/results/``,
next to what ``python -m bench`` writes, instead of pytest-benchmark's ``.benchmarks/`` in the
current directory; so ``--benchmark-compare`` finds them from wherever pytest was started. An
explicit ``--benchmark-storage`` still wins.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent / "results" / "benchmarks"
PLUGIN_DEFAULT_STORAGE = "file://./.benchmarks"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "benchmark_storage", None) == PLUGIN_DEFAULT_STORAGE:
        config.option.benchmark_storage = f"file://{RESULTS}"
