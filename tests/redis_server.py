"""A real Redis server for the tests, never a fake: ``redis-server`` on a free loopback port.

- ``redis_server`` (session): one server for the whole run, in a temporary folder, configured
  as a fleet's cache would be (no persistence, ``maxmemory 64mb``, ``allkeys-lru``);
  ``redis_server.kill()`` and ``redis_server.start()`` stop it hard and bring it back on the
  same port: "a Redis server killed mid-run"; ``redis_server.freeze()`` makes it hang;
- ``redis_url``: its URL, for a test that starts with an empty database (FLUSHALL), and with
  the server running again if an earlier test left it killed.

Without ``redis-server`` on the PATH or the ``redis`` package, these tests skip with one line.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    """A loopback TCP port that nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, its files in ``folder``."""

    def __init__(self, executable: str, folder: Path, port: int) -> None:
        self.executable, self.folder, self.port = executable, folder, port
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until it answers PING."""
        import redis

        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        args += ["--save", "", "--appendonly", "no"]
        args += ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
        with open(self.folder / "redis.log", "ab") as log:
            self.process = subprocess.Popen([self.executable, *args], stdout=log, stderr=log)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    tail = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server did not start on {self.port}:\n{tail}")
                time.sleep(0.05)
        finally:
            client.close()

    def freeze(self, frozen: bool = True) -> None:
        """Stop it answering (SIGSTOP), with its port still open, or let it go on (SIGCONT):
        a server that hangs, which a client notices only by waiting."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real Redis server for the session (skips without redis-server or the package)."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("no redis-server on the PATH: apt-get install redis-server (.ci/run does)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the 'redis' package is missing: pip install -e '.[offload]'")
    server = RedisServer(executable, tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, its database emptied, the server started if it was killed."""
    import redis

    if not redis_server.running:
        redis_server.start()
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url
