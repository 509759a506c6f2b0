"""The second tier's stores (``common/kv_tiers.py``): byte-exact, LRU, and a miss when failing.

Every store is tried for real: host memory, a folder on this disk, and a real ``redis-server``
(``tests/redis_server.py``), which the outage tests kill and restart. A full disk is a real
write error too: the process's file size limit (``RLIMIT_FSIZE``) cuts a write short with
``EFBIG``, as a full disk cuts it with ``ENOSPC``; a folder that vanished is a real one removed
(permissions would not do: these tests may run as root, whom permissions do not stop).
"""

from __future__ import annotations

import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.kv_tiers import (
    DEFAULT_SIZE_GIB,
    GIB,
    DiskTier,
    HostTier,
    KVTier,
    RedisTier,
    check_tier_spec,
    make_tier,
)
from tests.helpers import run_python
from tests.redis_server import RedisServer

KEY = "ppc1-0123abcd-{:016x}".format  # the shape of the engine's keys


def blob(n: int, seed: int = 0) -> bytes:
    """``n`` random bytes, zeros among them (half of them are 0)."""
    rng = random.Random(seed)
    return bytes(rng.choice((0, rng.randrange(256))) for _ in range(n))


@pytest.fixture(params=["host", "disk", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[int], KVTier]]:
    """``make(capacity_bytes)``: a tier of this test's kind (redis ignores the capacity)."""
    tiers: list[KVTier] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""

    def factory(capacity_bytes: int = 2**20) -> KVTier:
        kinds = {
            "host": lambda: HostTier(capacity_bytes),
            "disk": lambda: DiskTier(tmp_path / "tier", capacity_bytes),
            "redis": lambda: RedisTier(url),
        }
        tiers.append(kinds[request.param]())
        return tiers[-1]

    yield factory
    for tier in tiers:
        tier.close()
        tier.close()  # idempotent


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "common.kv_tiers"]


# ---- every tier -----------------------------------------------------------------------------


def test_values_come_back_byte_exact(make) -> None:
    tier = make()
    values = {KEY(n): blob(n, seed=n) for n in (0, 1, 255, 4096, 100_000)}
    values[KEY(7)] = bytes(300)  # all zeros
    for key, value in values.items():
        assert tier.put(key, value) is True  # stored: the writer counts it
    for key, value in values.items():
        assert tier.get(key) == value
    tier.put(KEY(1), b"\x00replaced")  # a put replaces
    assert tier.get(KEY(1)) == b"\x00replaced"
    assert tier.failures == 0


def test_an_absent_key_is_a_miss(make) -> None:
    tier = make()
    assert tier.get(KEY(1)) is None
    assert not tier.contains(KEY(1))
    tier.put(KEY(1), b"x")
    assert tier.contains(KEY(1))
    assert not tier.contains(KEY(2))
    assert tier.name in ("host", "disk", "redis")


# ---- host and disk: the capacity ------------------------------------------------------------


@pytest.fixture(params=["host", "disk"])
def bounded(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[int], KVTier]:
    if request.param == "host":
        return HostTier
    return lambda capacity_bytes: DiskTier(tmp_path / "tier", capacity_bytes)


def test_the_least_recently_used_entry_is_evicted(bounded) -> None:
    """Over capacity, the entry used longest ago goes: a get is a use, a contains is not."""
    tier = bounded(300)
    for name in "abc":
        tier.put(name, blob(100))
    assert tier.get("a") is not None  # now b is the oldest use
    assert tier.contains("b")  # a look: b stays the oldest
    tier.put("d", blob(100))
    assert [tier.contains(name) for name in "abcd"] == [True, False, True, True]
    assert (tier.evictions, tier.nbytes) == (1, 300)
    tier.put("e", blob(100))  # then c
    assert [tier.contains(name) for name in "acde"] == [True, False, True, True]
    assert tier.evictions == 2
    tier.put("f", blob(250))  # takes three places: a, d and e go
    assert [tier.contains(name) for name in "adef"] == [False, False, False, True]
    assert (tier.evictions, tier.nbytes) == (5, 250)


def test_a_value_larger_than_the_capacity_is_not_stored(bounded) -> None:
    tier = bounded(100)
    tier.put("small", blob(60))
    assert tier.put("big", blob(101)) is False
    assert tier.get("big") is None
    assert tier.get("small") == blob(60)  # nothing was evicted for it
    assert (tier.nbytes, tier.evictions, tier.failures) == (60, 0, 0)


# ---- host: threads --------------------------------------------------------------------------


def test_the_host_tier_serves_a_reader_while_a_writer_evicts() -> None:
    """A writer fills a small tier over and over (evicting all the time) while a reader reads:
    no exception, every read is None or exactly what was stored, the byte count stays true."""
    values = {KEY(i): blob(50 + i, seed=i) for i in range(40)}
    tier = HostTier(capacity_bytes=600)
    errors: list[BaseException] = []
    wrong: list[str] = []
    stop = time.monotonic() + 0.5

    def writer() -> None:
        try:
            while time.monotonic() < stop:
                for key, value in values.items():
                    tier.put(key, value)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while time.monotonic() < stop:
                for key, value in values.items():
                    got = tier.get(key)
                    if got is not None and got != value:
                        wrong.append(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and wrong == []
    held = [value for key, value in values.items() if tier.contains(key)]
    assert tier.nbytes == sum(map(len, held)) <= 600
    assert tier.evictions > 0


# ---- disk: restarts, crashes, failures ------------------------------------------------------


def test_the_disk_tier_survives_a_restart_in_lru_order(tmp_path: Path) -> None:
    folder = tmp_path / "tier"
    first = DiskTier(folder, 300)
    for name in "abc":
        first.put(name, blob(100, seed=ord(name)))
    assert first.get("a") is not None  # the oldest use is b's now, on the files' times too
    first.close()

    (folder / ".crashed.tmp").write_bytes(blob(50))  # a write a crash cut short
    (folder / "notes.txt").write_text("not an entry")  # nobody's entry
    second = DiskTier(folder, 300)
    assert second.nbytes == 300
    second.put("d", blob(100))
    assert [second.contains(name) for name in "abcd"] == [True, False, True, True]
    assert second.get("c") == blob(100, seed=ord("c"))
    assert not (folder / ".crashed.tmp").exists()
    assert (folder / "notes.txt").exists()


def test_disk_keys_are_file_names_inside_the_folder(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "tier", 1000)
    for key in ("../escape", "a/b", ".hidden", "x.tmp", "é", ".kv"):
        tier.put(key, key.encode())
    assert [p.parent for p in tmp_path.rglob("*") if p.is_file()] == [tmp_path / "tier"] * 6
    again = DiskTier(tmp_path / "tier", 1000)
    for key in ("../escape", "a/b", ".hidden", "x.tmp", "é", ".kv"):
        assert again.get(key) == key.encode()


def test_a_corrupt_file_is_returned_as_it_is(tmp_path: Path) -> None:
    """The tier is byte storage: it hands back what the file holds, and the caller's
    checksum (the entry's header) is what rejects it."""
    tier = DiskTier(tmp_path, 1000)
    tier.put(KEY(1), blob(100))
    (file,) = tmp_path.glob("*.kv")
    file.write_bytes(b"garbage")
    assert tier.get(KEY(1)) == b"garbage"


CRASH_MID_WRITE = """
import resource, signal, sys
from common.kv_tiers import DiskTier
tier = DiskTier(sys.argv[1], 10_000)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: here it kills, as a crash
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
tier.put(sys.argv[2], bytes(range(256)) * 20)  # killed at its 1001st byte
"""


def test_a_crash_mid_write_leaves_no_half_entry(tmp_path: Path) -> None:
    """A process killed in the middle of writing an entry (a real kill: SIGXFSZ at the file
    size limit) leaves the old entry or none under the key, never the half it wrote."""
    pytest.importorskip("resource")
    DiskTier(tmp_path, 10_000).put(KEY(0), b"old")
    for key in (KEY(0), KEY(1)):
        crashed = run_python("-c", CRASH_MID_WRITE, str(tmp_path), key)
        assert crashed.returncode == -signal.SIGXFSZ, crashed.stderr
        sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
        assert sizes == [3, 1000]  # the old entry, and the half the crash wrote (somewhere)
    after = DiskTier(tmp_path, 10_000)
    assert (after.get(KEY(0)), after.get(KEY(1))) == (b"old", None)
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.glob("*.kv")).name]


def test_a_full_disk_is_a_miss_and_one_warning(tmp_path: Path, caplog) -> None:
    """A write cut short by a full disk (here the file size limit) raises nothing, leaves no
    entry, even after a restart (the write was atomic), and logs one warning for the outage,
    then one when the tier works again."""
    resource = pytest.importorskip("resource")
    tier = DiskTier(tmp_path, 10_000)
    tier.put(KEY(0), blob(100))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        assert tier.put(KEY(1), blob(5000)) is False
        tier.put(KEY(2), blob(5000))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert tier.failures == 2
    assert tier.get(KEY(1)) is None and tier.nbytes == 100
    assert DiskTier(tmp_path, 10_000).get(KEY(1)) is None  # no half entry on the disk
    assert len(warnings_of(caplog)) == 1
    assert "disk tier" in warnings_of(caplog)[0] and "File too large" in warnings_of(caplog)[0]
    tier.put(KEY(3), blob(5000))
    assert tier.get(KEY(3)) == blob(5000)
    assert warnings_of(caplog)[1:] == [f"disk tier {tmp_path} works again"]


def test_a_vanished_folder_is_a_miss(tmp_path: Path, caplog) -> None:
    tier = DiskTier(tmp_path / "tier", 10_000)
    tier.put(KEY(1), blob(100))
    shutil.rmtree(tmp_path / "tier")  # unmounted, or removed under the server
    assert tier.get(KEY(1)) is None
    tier.put(KEY(2), blob(100))
    assert not tier.contains(KEY(1)) and not tier.contains(KEY(2))
    assert tier.failures == 2 and tier.nbytes == 0
    assert len(warnings_of(caplog)) == 1


# ---- redis: the fleet, and an outage --------------------------------------------------------


def test_replicas_share_one_redis(redis_url: str) -> None:
    one, two = RedisTier(redis_url), RedisTier(redis_url)
    one.put(KEY(1), blob(1000))
    assert two.contains(KEY(1)) and two.get(KEY(1)) == blob(1000)
    two.put(KEY(2), b"from two")
    assert one.get(KEY(2)) == b"from two"
    assert (one.nbytes, one.evictions) == (0, 0)  # the server's own business
    one.close(), two.close()


def test_a_killed_redis_is_a_miss_until_it_is_back(
    redis_server: RedisServer, redis_url: str, caplog
) -> None:
    tier = RedisTier(redis_url, backoff_s=0.2)
    tier.put(KEY(1), b"before")
    assert tier.get(KEY(1)) == b"before"

    redis_server.kill()
    started = time.monotonic()
    assert tier.get(KEY(1)) is None
    assert tier.failures == 1
    tier.put(KEY(2), b"lost")  # inside the back-off: not even tried
    assert not tier.contains(KEY(1))
    assert tier.failures == 1
    time.sleep(0.25)
    assert tier.get(KEY(1)) is None  # tried again: the same outage
    assert tier.failures == 2
    assert time.monotonic() - started < 2  # a dead server costs no long waits
    assert len(warnings_of(caplog)) == 1
    assert "redis tier redis://127.0.0.1:" in warnings_of(caplog)[0]

    redis_server.start()  # same port, empty: no persistence
    time.sleep(0.25)
    tier.put(KEY(3), b"after")
    assert tier.get(KEY(3)) == b"after"
    assert warnings_of(caplog)[1:] == [f"redis tier {redis_url} works again"]
    tier.close()


def test_a_hung_redis_costs_one_short_timeout(redis_server: RedisServer, redis_url: str) -> None:
    """A server that accepts but never answers: one read timeout (no retries), then the
    back-off answers at once."""
    tier = RedisTier(redis_url, timeout_s=0.2, backoff_s=60)
    tier.put(KEY(1), b"x")
    redis_server.freeze()
    thaw = threading.Timer(5, redis_server.freeze, args=(False,))  # a client with no timeout
    thaw.start()  # fails the test instead of hanging it
    try:
        started = time.monotonic()
        assert tier.get(KEY(1)) is None
        waited = time.monotonic() - started
        for _ in range(100):
            assert tier.get(KEY(1)) is None
        assert time.monotonic() - started < waited + 0.1
    finally:
        thaw.cancel()
        redis_server.freeze(False)
    assert 0.2 <= waited < 0.6  # a retry would wait another 0.2 s at least
    assert tier.failures == 1
    tier.close()


def test_the_redis_url_in_the_log_has_no_password(redis_server: RedisServer) -> None:
    tier = RedisTier(f"redis://user:secret@127.0.0.1:{redis_server.port}/0")
    assert "secret" not in tier.where
    tier.close()


# ---- the command line's words ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "size_gib", "kind", "capacity"),
    [
        ("host", None, HostTier, int(DEFAULT_SIZE_GIB * GIB)),
        ("native", 0.5, HostTier, GIB // 2),
        ("disk:{tmp}/kv", 2, DiskTier, 2 * GIB),
        ("redis://127.0.0.1:1/3", None, RedisTier, None),
        ("rediss://cache.example:6380", None, RedisTier, None),
    ],
)
def test_make_tier_reads_every_form(tmp_path, backend, size_gib, kind, capacity) -> None:
    if kind is RedisTier:
        pytest.importorskip("redis")
    backend = backend.format(tmp=tmp_path)
    check_tier_spec(backend, size_gib)
    tier = make_tier(backend, size_gib)  # opens nothing yet for redis: no server needed
    assert type(tier) is kind
    assert getattr(tier, "capacity_bytes", None) == capacity
    if kind is DiskTier:
        assert tier.path == tmp_path / "kv" and tier.path.is_dir()
    tier.close()


@pytest.mark.parametrize(
    ("backend", "size_gib", "words"),
    [
        ("nvme", None, "unknown KV offloading backend 'nvme': use 'host' (or 'native')"),
        ("lmcache", 1, "redis://HOST:PORT"),
        ("host", 0, "positive"),
        ("host", -1.5, "positive"),
        ("disk:/tmp/kv", float("nan"), "positive"),
        ("redis://127.0.0.1:6379", 1, "takes no size"),
        ("disk:", None, "needs a folder"),
        ("redis://", None, "names no host"),
        ("redis://h:port", None, "not a number"),
        ("redis://h:6379/x", None, "database"),
    ],
)
def test_a_bad_tier_spec_is_refused_in_one_line(backend, size_gib, words) -> None:
    with pytest.raises(ValueError) as checked:
        check_tier_spec(backend, size_gib)
    with pytest.raises(ValueError) as made:
        make_tier(backend, size_gib)
    assert str(checked.value) == str(made.value)
    assert words in str(checked.value) and "\n" not in str(checked.value)
