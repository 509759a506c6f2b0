"""Real servers in subprocesses, and reading what they say (the fixtures are in
``conftest.py``).

- ``ServerProcess``: ``python -m <step>.serve`` on a free port (``--port 0``): started, its
  "serving on" line awaited, stopped by a signal, always killed in the end;
- ``metric``: one series of ``/metrics``; ``sse_events``: the events of a streamed answer;
- the checkpoint's recipe and the flags every test server runs with.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from front.options import EngineOptions
from tests.helpers import ROOT, SUBPROCESS_TIMEOUT_S

API_KEY = "test-key"
SERVED_NAME = "toy-chat"
CONTEXT = 2048  # the checkpoint's max_position_embeddings
# The engine as every test server runs it: float64, where batching changes no logit, so a
# sampled token never flips between a request served alone and one served with 15 others.
ENGINE = EngineOptions(dtype="float64", block_size=4, max_running=16)
ENGINE_FLAGS = ["--dtype", "float64", "--block-size", "4", "--max-running", "16"]  # the same
ENGINE_OVERRIDES = ENGINE.model_overrides()  # from_pretrained's, for the engine offline


class ServerProcess:
    """``python -m <step>.serve`` in a subprocess, on a free port (``--port 0``)."""

    def __init__(self, step_name: str, checkpoint: Path, *flags: str) -> None:
        self.step_name = step_name
        command = [sys.executable, "-m", f"{step_name}.serve", "--model", str(checkpoint)]
        self.process = subprocess.Popen(
            [*command, "--port", "0", *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.url = self._wait_until_serving()

    def _wait_until_serving(self) -> str:
        """The URL of its "serving on" line (read on a thread, so a silent hang times out)."""
        found: list[str] = []

        def read() -> None:
            for line in self.process.stdout:  # type: ignore[union-attr]
                self.stdout.append(line)
                match = re.search(r"serving on (http://\S+)", line)
                if match:
                    found.append(match.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(SUBPROCESS_TIMEOUT_S)
        if not found:
            self.kill()
            raise AssertionError(f"no server: {''.join(self.stdout)}{self.process.stderr.read()}")
        return found[0]

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Send ``sig`` and wait: its exit status and everything it wrote on stderr."""
        self.process.send_signal(sig)
        return self.wait()

    def wait(self) -> tuple[int, str]:
        try:
            _, err = self.process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        finally:
            self.kill()
        return self.process.returncode, err

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    def children(self) -> list[int]:
        """The ids of the processes it started (its engine's), read from Linux's /proc."""
        return [pid for pid in all_pids() if parent_of(pid) == self.process.pid]


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); None
    when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2].split()


def parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def is_running(pid: int) -> bool:
    """The process exists and has not ended (an ended one nobody reaped is a zombie, Z)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


# ---- reading what a server says --------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series of a Prometheus text page (0 when it is not there yet)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(f'{key}="{val}"' in series for key, val in labels.items()):
                return float(value)
    return 0.0


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON of each ``data:`` event of a server-sent stream, until ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def tiny_engine(step_name: str) -> Any:
    """A step's engine on the test model (``tests.helpers.TINY``): what an engine process
    builds, from a name (a function of a module: it pickles)."""
    from front.steps import load_step
    from tests.helpers import TINY

    step = load_step(step_name)
    return step.PagedPrefixCacheEngine(step.TinyTransformerPaged(TINY))
