"""The second tier of the prefix cache: where a full KV block goes when the GPU pool lets it go.

The OS analogy's swap. The prefix cache (the first tier) holds blocks in the engine's KV pool;
when it evicts one, step14_10 writes it to a second tier, keyed by the block's chain hash, and
a later request that needs that block loads it back instead of computing it again. What is
written is an *entry* (a header, a checksum, the model's fingerprint, then the K and V bytes),
made and checked by the engine side; this file only stores bytes under keys.

Three stores, one interface (``KVTier``):

- ``HostTier``: host memory, an LRU dictionary. vLLM's native CPU offload
  (``--kv-offloading-backend native``: its ``OffloadingManager`` over a CPU backend with LRU
  eviction) is this tier;
- ``DiskTier``: a folder, one file per entry, that outlives the process: a restarted server
  finds its blocks again (LMCache's local disk backend);
- ``RedisTier``: a Redis server shared by every replica of a fleet, so a block one replica
  computed is loaded by the others (LMCache's remote backend over Redis).

Two rules shape all of them:

- a tier is a cache, never the truth: a failing tier (Redis gone, a disk full, a folder
  unmounted) answers "miss", counts the failure and logs one warning for the outage, and the
  engine computes the block as if the tier were not there. No method raises for its store's
  errors; a wrong key type or an impossible key is still the caller's bug, and raises;
- a tier is byte storage: values go in and come out exactly, whatever they hold. It never
  checks an entry: a corrupt file is returned as it is, and the caller's checksum rejects it.

``make_tier`` builds one from the command line's words (vLLM's ``--kv-offloading-backend`` and
``--kv-offloading-size``); ``check_tier_spec`` checks those words without opening anything.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from .errors import MissingPackageError, UserError
from .kv_events import MEDIUM_CPU, MEDIUM_STORAGE

log = logging.getLogger("common.kv_tiers")

GIB = 2**30
# A ceiling, not an allocation: a tier holds only the blocks it is given, so a generous bound
# costs nothing until they come. 4 GiB is far more than the tutorial's models ever offload,
# and a small part of a machine that serves a real one. (vLLM has no default: there the size
# is what turns offloading on; here the backend does, so the size may be left out.)
DEFAULT_SIZE_GIB = 4.0
ACCEPTED = "'host' (or 'native'), 'disk:DIR', or a 'redis://HOST:PORT[/DB]' URL"


class TierSpecError(UserError, ValueError):
    """A second tier the command line cannot use (a ``UserError``: printed on one line)."""


class KVTier:
    """A byte store for KV entries, keyed by strings: the interface of every second tier.

    ``get`` answers None for a miss, whether the key is absent or the store failed; ``put``
    stores, evicting what was least recently used when the tier has a capacity; neither raises
    when the store fails. ``failures`` counts the operations that failed, ``evictions`` the
    entries dropped to stay within the capacity, ``nbytes`` the bytes of values held now;
    ``take_evicted`` names the entries dropped since it was last called, so that the tier's
    owner can say so in its KV events.
    """

    name: str = "?"  # "host" | "disk" | "redis": also the ``medium`` of the tier's KV events
    reports_evictions = True  # ``take_evicted`` names every entry it drops

    def __init__(self, where: str) -> None:
        self.where = where  # what the log names: a folder, a URL without its password
        self.failures = 0
        self.evictions = 0
        self._failing = False  # inside an outage: its warning is already in the log
        self._evicted: list[str] = []  # keys dropped since the last ``take_evicted``
        self._state_lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None (absent, or the tier failed)."""
        raise NotImplementedError

    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing what was there); returns whether it was
        stored. Never raises on failure."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (False on failure). A look, not a use: LRU order stays."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the tier holds open (connections, memory). Calling it twice is fine."""

    def take_evicted(self) -> list[str]:
        """The keys of the entries this tier dropped since the last call: evicted for room, or
        unreadable."""
        with self._state_lock:
            taken, self._evicted = self._evicted, []
        return taken

    def _note_evicted(self, key: str) -> None:
        with self._state_lock:
            self._evicted.append(key)

    @property
    def nbytes(self) -> int:
        """Bytes of values held now."""
        raise NotImplementedError

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count a failure; the first of an outage is a warning (one, not one per block)."""
        with self._state_lock:
            self.failures += 1
            first, self._failing = not self._failing, True
        if first:
            log.warning(
                f"{self.name} tier {self.where}: {what} failed ({type(exc).__name__}: {exc}); "
                "blocks are computed until it works again"
            )

    def _worked(self) -> None:
        """An operation succeeded: an outage, if there was one, is over, and the log says so.
        At warning level too, so a log that shows the outage also shows its end."""
        if self._failing:
            with self._state_lock:
                was, self._failing = self._failing, False
            if was:
                log.warning(f"{self.name} tier {self.where} works again")


class HostTier(KVTier):
    """Host memory: an ``OrderedDict`` in least-recently-used order, oldest first.

    A lock guards it, since the engine may load from one thread while it stores from another.
    ``capacity_bytes`` bounds the values' bytes; what is not counted: the Python objects around
    them (about 33 bytes per ``bytes`` object, the key string, the dictionary's slots).
    """

    name = "host"
    medium = MEDIUM_CPU  # vLLM's name for where its KV events say the block lives

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__("memory")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)  # a use: now the most recent
            return value

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.capacity_bytes:
            return False  # it could never fit: not stored, and nothing evicted for it
        try:
            value = bytes(value)  # a copy: a caller's bytearray may change after the call
        except MemoryError as exc:
            self._failed("copying a block", exc)
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= len(old)
            while self._nbytes + len(value) > self.capacity_bytes:
                oldest, evicted = self._entries.popitem(last=False)
                self._nbytes -= len(evicted)
                self.evictions += 1
                self._note_evicted(oldest)
            self._entries[key] = value
            self._nbytes += len(value)
        self._worked()
        return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes


class DiskTier(KVTier):
    """A folder, one file per entry, that a restarted server finds again.

    - File names: the key percent-encoded (no ``/``, no ``..``: a key never names a path
      outside the folder) plus ``.kv``; a file that is not the exact encoding of a key is not
      an entry and is left alone.
    - Atomic writes: an entry is written to a temporary file (``.<random>.tmp``) and renamed
      over its name (``os.replace``), so a crash leaves the old entry or the new one, never
      half of one; the leftovers of a crash are removed at start. There is no ``fsync``: after
      a power cut an entry may still be short, and the caller's checksum rejects it.
    - LRU order: the index is rebuilt at start from the files' modification times, oldest
      first; a ``get`` touches the file, so the order survives a restart too. Times are set
      explicitly, strictly increasing, since a file system's clock may give two writes the
      same time.
    - ``capacity_bytes`` bounds the files' sizes; what is not counted: the file system's
      blocks around them (a 100-byte file takes 4 KiB on most) and the directory itself.

    One ``DiskTier`` per folder at a time: the index lives in this process.
    """

    name = "disk"
    medium = MEDIUM_STORAGE  # vLLM's name for where its KV events say the block lives

    def __init__(self, path: str | Path, capacity_bytes: int) -> None:
        super().__init__(str(path))
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._nbytes = 0
        self._clock = 0  # the last modification time given, in ns
        self._lock = threading.Lock()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._load_index()
        except OSError as exc:
            self._failed("opening the folder", exc)
        self.take_evicted()  # the last run's entries, never announced by this process

    def _load_index(self) -> None:
        found = []
        for entry in os.scandir(self.path):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                Path(entry.path).unlink(missing_ok=True)  # a crashed write's leftover
                continue
            key = _key_of(entry.name)
            if key is not None and entry.is_file():
                info = entry.stat()
                found.append((info.st_mtime_ns, entry.name, key, info.st_size))
        for mtime, _, key, size in sorted(found):
            self._index[key] = size
            self._nbytes += size
            self._clock = max(self._clock, mtime)
        self._evict_for(0)  # the capacity may be smaller than at the last run

    def _file(self, key: str) -> Path:
        return self.path / _file_name(key)

    def _stamp(self, path: Path | int) -> None:
        """Give ``path`` (or an open file descriptor) the next modification time."""
        self._clock = max(self._clock + 1, time.time_ns())
        os.utime(path, ns=(self._clock, self._clock))

    def _evict_for(self, size: int) -> None:
        while self._index and self._nbytes + size > self.capacity_bytes:
            key, evicted = self._index.popitem(last=False)
            self._nbytes -= evicted
            self.evictions += 1
            self._file(key).unlink(missing_ok=True)
            self._note_evicted(key)

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        with self._lock:
            if key not in self._index:
                return None
            try:
                value = path.read_bytes()
            except OSError as exc:
                self._nbytes -= self._index.pop(key)  # what cannot be read is no entry
                self._note_evicted(key)
                self._failed(f"reading {path.name}", exc)
                return None
            with contextlib.suppress(OSError):  # read-only: only the order after a restart
                self._stamp(path)  # depends on it, not the block just read
            self._index.move_to_end(key)
        self._worked()
        return value

    def put(self, key: str, value: bytes) -> bool:
        path = self._file(key)
        if len(value) > self.capacity_bytes:
            return False  # it could never fit: not stored, and nothing evicted for it
        with self._lock:
            self._nbytes -= self._index.pop(key, 0)  # replaced below, or removed on failure
            tmp = None
            try:
                self._evict_for(len(value))
                fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".", suffix=".tmp")
                with os.fdopen(fd, "wb") as file:
                    file.write(value)
                    file.flush()  # the bytes reach the file before its time is set
                    self._stamp(fd)
                os.replace(tmp, path)
            except OSError as exc:
                for leftover in (tmp, path):  # a failed put leaves no entry at all
                    if leftover is not None:
                        with contextlib.suppress(OSError):
                            Path(leftover).unlink(missing_ok=True)
                self._failed(f"writing {path.name}", exc)
                return False
            self._index[key] = len(value)
            self._nbytes += len(value)
        self._worked()
        return True

    def contains(self, key: str) -> bool:
        _file_name(key)  # a bad key is refused here too
        with self._lock:
            return key in self._index

    @property
    def nbytes(self) -> int:
        return self._nbytes


def _file_name(key: str) -> str:
    """``key``'s file name: percent-encoded, so any key is one file inside the folder."""
    name = quote(key, safe="") + ".kv"
    if not key or len(name) > 255:
        raise ValueError(f"a disk tier key must be 1 to about 250 characters, not {key!r:.80}")
    return name


def _key_of(name: str) -> str | None:
    """The key that ``name`` is the file of, or None if it is no entry's file."""
    if not name.endswith(".kv"):
        return None
    key = unquote(name[: -len(".kv")])
    return key if key and quote(key, safe="") + ".kv" == name else None


class RedisTier(KVTier):
    """A Redis server that every replica shares: a block one replica stored, all can load.

    The server bounds itself: the fleet's Redis is configured by its administrator with a
    ``maxmemory`` and the ``allkeys-lru`` policy, and this client sets nothing on it. So
    ``evictions`` stays 0 (the server counts its own: ``evicted_keys`` in ``INFO stats``),
    ``take_evicted`` names none (the server does not tell which), and ``nbytes`` is 0, unknown
    to the client (``used_memory`` in ``INFO memory``).

    A dead server must not stall the engine: connecting and reading time out after
    ``timeout_s``, with no retry, and after a failure the tier does not try again for
    ``backoff_s`` seconds: calls in between are misses (not failures) that never touch the
    network.
    """

    name = "redis"
    medium = MEDIUM_STORAGE  # vLLM's name for where its KV events say the block lives
    reports_evictions = False  # its BlockStored events stand until the stream says otherwise

    def __init__(self, url: str, timeout_s: float = 0.5, backoff_s: float = 1.0) -> None:
        redis = _import_redis()
        parts = urlsplit(url)
        super().__init__(f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}")
        self.backoff_s = backoff_s
        self._errors = (redis.exceptions.RedisError, OSError)
        self._retry_at = 0.0  # time.monotonic() before which the server is left alone
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        )
        self._closed = False

    def _call(self, what: str, method: str, *args: Any) -> Any:
        """``self._client.<method>(*args)``, or None when it fails or the tier backs off."""
        if self._closed or time.monotonic() < self._retry_at:
            return None
        try:
            result = getattr(self._client, method)(*args)
        except self._errors as exc:
            self._retry_at = time.monotonic() + self.backoff_s
            self._failed(what, exc)
            return None
        self._worked()
        return result

    def get(self, key: str) -> bytes | None:
        return self._call("GET", "get", key)

    def put(self, key: str, value: bytes) -> bool:
        return bool(self._call("SET", "set", key, bytes(value)))

    def contains(self, key: str) -> bool:
        return bool(self._call("EXISTS", "exists", key))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    @property
    def nbytes(self) -> int:
        return 0  # unknown here: the server holds and bounds the bytes


def _import_redis() -> Any:
    """The ``redis`` package (the client), or an error that says how to install it."""
    try:
        import redis
        import redis.backoff
        import redis.retry
    except ImportError as exc:
        raise MissingPackageError(
            "the redis tier needs the 'redis' package: "
            "pip install 'paged-prefix-cache-steps[offload]'"
        ) from exc
    return redis


def check_tier_spec(backend: str, size_gib: float | None) -> None:
    """Refuse a backend or a size that ``make_tier`` could not use, with one line, opening
    nothing: for a command line, before its slow part. A Redis URL also needs the package."""
    if size_gib is not None and not (math.isfinite(size_gib) and size_gib > 0):
        raise TierSpecError(f"the tier's size must be a positive number of GiB, not {size_gib}")
    if backend in ("host", "native"):
        return
    if backend.startswith("disk:"):
        if not backend[len("disk:") :]:
            raise TierSpecError("'disk:' needs a folder: disk:DIR")
        return
    if backend.startswith(("redis://", "rediss://")):
        if size_gib is not None:
            raise TierSpecError(
                "a redis tier takes no size: the server bounds itself (its maxmemory)"
            )
        parts = urlsplit(backend)
        try:
            parts.port  # noqa: B018 (a port that is not a number raises here)
        except ValueError:
            raise TierSpecError(f"{backend!r} has a port that is not a number") from None
        if not parts.hostname:
            raise TierSpecError(f"{backend!r} names no host: redis://HOST:PORT[/DB]")
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise TierSpecError(f"{backend!r}: the database after the port must be a number")
        if importlib.util.find_spec("redis") is None:
            _import_redis()
        return
    raise TierSpecError(f"unknown KV offloading backend {backend!r}: use {ACCEPTED}")


def make_tier(backend: str, size_gib: float | None) -> KVTier:
    """The tier that ``backend`` names, bounded by ``size_gib`` GiB (host and disk; default
    ``DEFAULT_SIZE_GIB``). ``TierSpecError`` (a ValueError) for what ``check_tier_spec``
    refuses."""
    check_tier_spec(backend, size_gib)
    capacity = int((DEFAULT_SIZE_GIB if size_gib is None else size_gib) * GIB)
    if backend in ("host", "native"):
        return HostTier(capacity)
    if backend.startswith("disk:"):
        return DiskTier(backend[len("disk:") :], capacity)
    return RedisTier(backend)
