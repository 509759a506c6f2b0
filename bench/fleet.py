"""Replicas of a step's server and ``vllm-router`` in front of them, as processes of this
machine (``--workload replicas``; docs/scale-out.md shows the same commands by hand).

- ``Server``: ``python -m <step>.serve`` on a free port; ``metrics()`` reads its ``/metrics``;
  ``Replica``: a server whose KV cache events are published on a free ZMQ port
  (``--kv-events-config``);
- ``RedisServer``: a ``redis-server`` on a free port, the second tier a fleet shares;
- ``Router``: ``vllm-router --policy P`` over the replicas' URLs, its log in a file (its own
  evidence of what it decided), its Prometheus page read before it stops; ``kv_aware`` is fed
  every replica's events (``--kv-event-source URL=tcp://...``) and the pool's block size.

Every process is started with ``Popen`` and ended by its own id (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.errors import MissingPackageError, UserError

from .endpoint import httpx_module

START_TIMEOUT_S = 300  # a replica loads its model, the router waits for every worker
STOP_TIMEOUT_S = 30
ROUTER = "vllm-router"
POLICIES = ("round_robin", "cache_aware", "kv_aware")  # the ones this project measured


class FleetError(UserError):
    """A replica or the router could not start: one line, with the end of its output."""


def free_port() -> int:
    """A TCP port of this machine no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_path() -> str:
    """The ``vllm-router`` command (``pip install -e '.[cluster]'``)."""
    path = shutil.which(ROUTER) or shutil.which(ROUTER, path=str(Path(sys.executable).parent))
    if path is None:
        raise MissingPackageError(
            f"--workload replicas needs {ROUTER}: pip install -e '.[cluster]'"
        )
    return path


class Process:
    """A child process whose output goes to ``log``; ended by its own id."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log
        with log.open("w") as out:
            self.popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)

    def wait_for(self, pattern: str, what: str) -> re.Match:
        """The first line of the log that matches ``pattern`` (polled; ``FleetError`` if the
        process ends first or takes longer than ``START_TIMEOUT_S``)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text())
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        tail = " | ".join(self.log.read_text().strip().splitlines()[-3:])
        self.stop()
        raise FleetError(f"{what} did not start: {tail or 'no output'}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Server(Process):
    """One ``python -m <step>.serve --model CHECKPOINT`` on a free port; ``url`` once started."""

    def __init__(self, step: str, checkpoint: Path, flags: list[str], log: Path) -> None:
        command = [sys.executable, "-m", f"{step}.serve", "--model", str(checkpoint)]
        super().__init__([*command, "--port", "0", *flags], log)
        self.url = ""

    def started(self) -> Server:
        self.url = self.wait_for(r"serving on (http://\S+)", f"server {self.log.name}").group(1)
        return self

    def metrics(self) -> str:
        return httpx_module().get(self.url + "/metrics", timeout=60).text


class Replica(Server):
    """A ``Server`` that publishes its KV cache events on ``tcp://*:<events_port>``."""

    def __init__(self, step: str, checkpoint: Path, flags: list[str], log: Path) -> None:
        self.events_port = free_port()
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.events_port}"}
        super().__init__(step, checkpoint, [*flags, "--kv-events-config", json.dumps(config)], log)

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"


def start_replicas(
    count: int,
    step: str,
    checkpoint: Path,
    flags: list[str],
    logs: Path,
    own_flags: list[list[str]] | None = None,
    tag: str = "",
) -> list[Replica]:
    """``count`` replicas, loading side by side; each waited for. Replica ``i`` also gets
    ``own_flags[i]`` (its own disk tier's folder), and logs to ``replica-<i><tag>.log``."""
    own = own_flags or [[] for _ in range(count)]
    replicas = [
        Replica(step, checkpoint, [*flags, *own[i]], logs / f"replica-{i}{tag}.log")
        for i in range(count)
    ]
    try:
        return [replica.started() for replica in replicas]
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise


class RedisServer(Process):
    """A ``redis-server`` of this bench's own on a free loopback port, configured as a fleet's
    KV tier is (no persistence; at most ``max_bytes``, least recently used keys evicted first).
    It starts empty: a fresh one per run is a cold tier."""

    def __init__(self, folder: Path, max_bytes: int, log: Path) -> None:
        self.port = free_port()
        command = [redis_server_path(), "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--dir", str(folder), "--save", "", "--appendonly", "no"]
        command += ["--maxmemory", str(max_bytes), "--maxmemory-policy", "allkeys-lru"]
        super().__init__(command, log)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def started(self) -> RedisServer:
        self.wait_for(r"Ready to accept connections", f"redis-server ({self.log.name})")
        return self


def redis_server_path() -> str:
    """The ``redis-server`` command (Debian's package), or one line that says how to get it."""
    path = shutil.which("redis-server")
    if path is None:
        raise MissingPackageError(
            "--kv-offloading-backend redis starts a redis-server: apt-get install redis-server"
        )
    return path


class Router(Process):
    """``vllm-router`` with ``policy`` over ``replicas``; ``url`` once ready."""

    def __init__(
        self, policy: str, replicas: list[Replica], block_size: int, model: str, log: Path
    ) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        command = [router_path(), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--worker-urls", *(r.url for r in replicas), "--policy", policy]
        command += ["--prometheus-port", str(self.metrics_port), "--log-level", "debug"]
        if policy == "kv_aware":  # its index, built from every replica's events
            for replica in replicas:
                command += ["--kv-event-source", f"{replica.url}={replica.events_endpoint}"]
            command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        super().__init__(command, log)
        self.url = f"http://127.0.0.1:{self.port}"

    def started(self) -> Router:
        self.wait_for(r"Starting server on", f"{ROUTER} ({self.log.name})")
        httpx = httpx_module()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readiness", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise FleetError(f"{ROUTER} never became ready: see {self.log}")

    def own_metrics(self) -> dict[str, float]:
        """Its Prometheus series about its decisions: routing, retries, circuit breakers."""
        text = httpx_module().get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text
        kept = ("vllm_router_prefix_routing", "vllm_router_kv_", "vllm_router_policy_decisions")
        kept += ("vllm_router_processed", "vllm_router_retries", "vllm_router_cb_")
        return {
            series: float(value)
            for series, _, value in (line.rpartition(" ") for line in text.splitlines())
            if series.startswith(kept)
        }


def counter(text: str, name: str) -> float:
    """The sum of every series of a Prometheus counter (``name`` without ``_total``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "_total{", name + "_total ")):
            total += float(line.rpartition(" ")[2])
    return total
