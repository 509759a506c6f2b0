"""One row of ``python -m bench``'s table: a step (or a variant of one) and its runs.

Its own module so that the runner (``showcase.py``) and the printer (``report.py``) both
import it, and neither imports the other.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .harness import RunResult

# Rows whose slowest run took more than this many times their fastest are flagged "!".
SPREAD_FLAG = 1.5


@dataclass
class Row:
    """One line of the table: a step (or a variant of one) and its figures."""

    name: str
    fixes: str
    seconds: list[float]
    result: RunResult
    new_tokens: int

    @property
    def best(self) -> float:
        """The fastest run: the statistic of a deterministic workload (every run does the same
        work, so the time above the fastest is other programs' and the OS's)."""
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Slowest run / fastest run: 1.0 on a quiet machine."""
        return max(self.seconds) / self.best

    @property
    def flagged(self) -> bool:
        return self.spread > SPREAD_FLAG

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.best

    @property
    def gflops_per_second(self) -> float:
        return self.result.flops / self.best / 1e9
