"""pytest settings for the benchmark suites (``python -m pytest bench/suites/...``).

Saved runs go to ``bench/results/`` beside ``python -m bench``'s, not to pytest-benchmark's
``.benchmarks/`` in the current folder, so ``--benchmark-compare`` finds them from anywhere
(an explicit ``--benchmark-storage`` still wins). Torch runs one thread, as ``python -m bench``
does, for the same measured reason; ``--torch-threads N`` changes it.
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
