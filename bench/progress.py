"""A status line on stderr while ``python -m bench`` works on something slow.

A big workload can spend minutes in one row, and the table is printed only at the end. So while
a task runs longer than ``DELAY_S``, one line on stderr says what runs and for how long
(``step14_3: run 2/3, 1,024 tokens computed, 41 s``), redrawn every second, erased at its end.
It is off when stderr is not a terminal and with ``--quiet``; stdout only ever gets whole
lines, once the status line is erased, so the two never garble each other.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

DELAY_S = 2.0  # a task is shown once it has run this long
INTERVAL_S = 1.0  # then redrawn this often
CLEAR_LINE = "\r\x1b[K"  # back to the line's start, erase to its end


class Task:
    """One task's status: ``note`` (``run 2/3``), and ``live``, a figure read at each redraw."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.note = ""
        self.live: Callable[[], str] | None = None
        self.start = time.perf_counter()

    def line(self) -> str:
        parts = [self.note] if self.note else []
        live = self.live() if self.live is not None else ""
        if live:
            parts.append(live)
        parts.append(f"{time.perf_counter() - self.start:.0f} s")
        return f"  {self.label}: {', '.join(parts)}"


class Progress:
    """Status lines for slow tasks, on ``stream`` (stderr) when it is a terminal."""

    def __init__(
        self,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        delay: float | None = None,
        interval: float | None = None,
    ) -> None:
        """``enabled`` None: on when ``stream`` is a terminal. ``delay`` / ``interval``
        default to ``DELAY_S`` / ``INTERVAL_S`` (read now, so a test can change them)."""
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.delay = DELAY_S if delay is None else delay
        self.interval = INTERVAL_S if interval is None else interval

    @contextmanager
    def task(self, label: str) -> Iterator[Task]:
        """Show ``label`` (and the task's note) while the block runs longer than the delay."""
        task = Task(label)
        if not self.enabled:
            yield task
            return
        done, shown = threading.Event(), threading.Event()
        ticker = threading.Thread(target=self._tick, args=(task, done, shown), daemon=True)
        ticker.start()
        try:
            yield task
        finally:
            done.set()
            ticker.join()
            if shown.is_set():
                self._write(CLEAR_LINE)

    def _tick(self, task: Task, done: threading.Event, shown: threading.Event) -> None:
        """The background thread: wait out the delay, then redraw until the task is done."""
        if done.wait(self.delay):
            return
        while True:
            shown.set()
            self._write(CLEAR_LINE + task.line())
            if done.wait(self.interval):
                return

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
