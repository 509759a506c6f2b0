"""One cell of a table: a setting and its repeated runs, shown by its best run.

Every workload repeats the same work and shows each cell's best run (the fastest, or the least
busy): the time above it measures what else the machine was doing. A cell whose runs lie far
apart is flagged, since even its best run may have been slowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

# Cells whose slowest run took more than this many times their best are flagged "!".
SPREAD_FLAG = 1.5


class Timed(Protocol):
    """A run: what it took, in the seconds (or busy seconds) that rank runs."""

    @property
    def seconds(self) -> float: ...


S = TypeVar("S")
R = TypeVar("R", bound=Timed)


@dataclass
class Cell(Generic[S, R]):
    """``name`` (the table's first column), the ``setting`` it ran with, and its runs."""

    name: str
    setting: S
    runs: list[R] = field(default_factory=list)

    @property
    def best(self) -> R:
        return min(self.runs, key=lambda run: run.seconds)

    @property
    def spread(self) -> float:
        """Slowest run / best run: 1.0 on a quiet machine."""
        return max(run.seconds for run in self.runs) / self.best.seconds

    @property
    def flagged(self) -> bool:
        return self.spread > SPREAD_FLAG

    @property
    def seconds(self) -> list[float]:
        return [run.seconds for run in self.runs]


def rerun_hint() -> str:
    """What to do about a flagged cell, with one torch thread and with several."""
    if torch.get_num_threads() > 1:
        return "rerun with --threads 1 (several threads wait for each other on a busy machine)."
    return "rerun it when the machine is quieter (--steps names a few rows)."


def flagged_note(cells: list[Cell], what: str) -> list[str]:
    """The line that names the flagged cells, if any (``what``: the figure that differed)."""
    names = list(dict.fromkeys(cell.name for cell in cells if cell.flagged))
    if not names:
        return []
    return [
        f"! {what} more than {SPREAD_FLAG}x apart (slowest / fastest): {', '.join(names)}. "
        f"The machine was busy; the best run may still be too slow: {rerun_hint()}"
    ]


def markdown(titles: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A Markdown table that lines up in plain text too; the numbers (after ``left``) right."""
    widths = [max(len(row[i]) for row in [titles, *rows]) for i in range(len(titles))]

    def line(cells: list[str]) -> str:
        padded = [
            f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)]
    return "\n".join([line(titles), "|" + "|".join(rule) + "|", *(line(r) for r in rows)])
