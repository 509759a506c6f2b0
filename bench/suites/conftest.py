"""pytest settings for the benchmark suites (``python -m pytest bench/suites/...``).

Runs saved with ``--benchmark-autosave`` or ``--benchmark-save=NAME`` go to ``bench/results/``,
next to what ``python -m bench`` writes, instead of pytest-benchmark's ``.benchmarks/`` in the
current directory; so ``--benchmark-compare`` finds them from wherever pytest was started. An
explicit ``--benchmark-storage`` still wins.

Torch runs one thread, as ``python -m bench`` does by default and for the same measured reason
(README, Benchmarks: on a busy 2-core machine two threads made single runs up to 100x
slower); ``--torch-threads N`` changes it (0: torch's default, one per core).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "benchmarks"
PLUGIN_DEFAULT_STORAGE = "file://./.benchmarks"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--torch-threads",
        type=int,
        default=1,
        help="torch CPU threads for the benchmarks (0: torch's default, one per core)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "benchmark_storage", None) == PLUGIN_DEFAULT_STORAGE:
        config.option.benchmark_storage = f"file://{RESULTS}"
    threads = config.getoption("torch_threads")
    if threads > 0:
        torch.set_num_threads(threads)
