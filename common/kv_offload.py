"""KVOffload: the prefix cache's second tier, between the KV pool and a store (``kv_tiers.py``).

The OS analogy's swap. The pool is memory: a block it evicts is gone, and the next request with
that prefix computes it again. The tier is the larger, slower store behind it: every full
block the prefix cache takes is also written there once, keyed by its chain hash
(write-through), and a lookup whose chain of pool hits ends goes on in the tier, loading what
it finds back into the pool instead of computing it (the page fault served from swap).

step14_10's KV cache manager calls three methods, at the moments its own operations happen:
``lookup`` (after the pool's chain ends), ``load`` (into blocks it allocated for them) and
``store`` (the blocks the prefix cache took this round, once the forward has written them).
Everything else lives here: the entry's format and its checks, and the writer.

- **An entry proves what it is** before it is used: its header names the model (a fingerprint of
  the config, the dtype, the device type and the weights), the block's hash, its parent's hash,
  its tokens, the K/V shape and dtype, and a CRC of the bytes. A tier shared by a fleet may hold
  other models' blocks, another block size, a corrupt write: each is a miss, never wrong KV.
- **Writes never stall a round** (vLLM offloads asynchronously too): the round only copies the
  new blocks' K/V out of the pool (one index per pool, a memory copy); encoding them and
  putting them in the tier (a disk write, a network round trip) happen on a writer thread. A
  block on its way is already readable (``_pending``), so what one request stored the next
  one finds, whatever the writer's pace. When the writer falls far behind, a store is dropped:
  a tier is a cache, and the block can be computed again.
- **A failing tier is a miss**, never a dead engine: the tiers count and log their failures.

vLLM's equivalents: the ``OffloadingConnector`` (scheduler side: ``get_num_new_matched_tokens``
is the lookup; worker side: the transfers), its ``OffloadingManager`` (``lookup``,
``prepare_load``, ``prepare_store``) and ``CPUOffloadingSpec``; LMCache's ``LMCacheEngine``
(``retrieve``/``store``, with CPU, disk and remote backends such as Redis).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import struct
import threading
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_tiers import KVTier
from .observer import NO_OBSERVER, RoundObserver

log = logging.getLogger(__name__)

FORMAT = "ppc-kv-1"  # an entry's format; a key names it, so a new format never reads an old one
MAX_PENDING_BYTES = 256 << 20  # K/V on its way to the tier, at most; beyond it a store is dropped


def model_fingerprint(model: torch.nn.Module) -> str:
    """What makes two engines' KV for the same tokens the same bytes: the architecture, the
    block size, the dtype, the device type (another kind of device rounds differently) and the
    weights. The weights are sampled (a few thousand values of each tensor), so that a model of
    a real size is named in milliseconds; two checkpoints that differ only between the samples
    are not a case a fleet meets."""
    cfg, digest = model.cfg, hashlib.sha256()
    fields = (cfg.num_layers, cfg.num_kv_heads, cfg.d_head, cfg.block_size, cfg.dtype_name)
    digest.update(repr((fields, torch.device(cfg.device).type)).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        digest.update(name.encode() + repr(tuple(tensor.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class TierEntry:
    """One block's K/V as the tier keeps it, and what it claims to be."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    k: torch.Tensor  # [num_layers, block_size, num_kv_heads, d_head], on the host
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class KVOffload:
    """A second tier behind one engine's pool. ``tier``: where the bytes go (``kv_tiers``)."""

    def __init__(
        self, tier: KVTier, model: torch.nn.Module, observer: RoundObserver = NO_OBSERVER
    ) -> None:
        self.tier, self.model, self.observer = tier, model, observer
        self.fingerprint = model_fingerprint(model)
        cfg = model.cfg
        self._shape = (cfg.num_layers, cfg.block_size, cfg.num_kv_heads, cfg.d_head)
        self._dtype = cfg.dtype
        self._pending: dict[str, TierEntry] = {}  # stored, not yet in the tier: readable
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()  # None: the writer ends
        self._writer: threading.Thread | None = None
        self._warned_corrupt = False
        # Blocks announced in the tier (a BlockStored of its medium), by key: each is announced
        # removed when the tier drops it or refuses its write (a tier that names what it drops)
        self._announced: dict[str, int] = {}
        self._unstored: list[str] = []
        # What /metrics and EngineStats show: vLLM counts a KV connector's lookups in tokens.
        self.queries = self.hits = 0  # tokens asked of the tier / found there
        self.loads = self.stores = self.dropped = self.corrupt = 0  # blocks
        self.bytes_loaded = self.bytes_stored = 0
        _LIVE.add(self)

    def key(self, block_hash: int) -> str:
        """Where a block lives in the tier: the format, the model, the chain hash. Another
        model's blocks (or another block size's) are under other keys."""
        return f"{FORMAT}-{self.fingerprint}-{block_hash:016x}"

    # ---- lookup and load (the engine's thread) ----------------------------------------------

    def lookup(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        parent_hash: int | None,
        limit: int,
        resumed: bool = False,
    ) -> list[TierEntry]:
        """The entries of the tier that continue a chain: the blocks ``block_hashes`` (tokens
        ``token_ids``, following the block hashed ``parent_hash``), in order, up to the first
        the tier lacks or cannot prove, at most ``limit``. Each is checked as the pool's cache
        checks a hit: its hash, its parent and its tokens must be the caller's. A ``resumed``
        (once preempted) sequence's lookups are not counted as queries and hits, as
        ``EngineStats`` counts its adoptions apart: those figures are about prompts."""
        size, entries = self.model.cfg.block_size, []
        for i, block_hash in enumerate(block_hashes[:limit]):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            self.queries += 0 if resumed else size
            entry = self._get(block_hash)
            if entry is None or (entry.parent_hash, entry.token_ids) != (parent_hash, tokens):
                break
            self.hits += 0 if resumed else size
            entries.append(entry)
            parent_hash = block_hash
        return entries

    def load(self, entries: list[TierEntry], block_ids: list[int]) -> None:
        """Copy each entry's K/V into its pool block (one indexed write per pool), before any
        forward pass reads them: swapped in."""
        model, index = self.model, torch.tensor(block_ids, device=self.model.cfg.device)
        for pool, part in ((model.kv_pool_k, "k"), (model.kv_pool_v, "v")):
            values = torch.stack([getattr(e, part) for e in entries], dim=1)
            pool[:, index] = values.to(pool.device)
        self.loads += len(entries)
        self.bytes_loaded += sum(e.nbytes for e in entries)

    def _get(self, block_hash: int) -> TierEntry | None:
        key = self.key(block_hash)
        with self._lock:
            entry = self._pending.get(key)
        if entry is not None:
            return entry
        raw = self.tier.get(key)
        if raw is None:
            return None
        try:
            return self._decode(raw, block_hash)
        except (ValueError, KeyError, TypeError, RuntimeError, struct.error) as error:
            self.corrupt += 1
            if not self._warned_corrupt:  # once: a fleet's stale tier could say it a million times
                log.warning(
                    "%s tier: an entry was refused and computed instead (%s)", self.tier.name, error
                )
                self._warned_corrupt = True
            return None

    # ---- store (write-through) --------------------------------------------------------------

    def store(self, blocks: list[tuple[int, int | None, tuple[int, ...], int]]) -> None:
        """Write these blocks through to the tier: ``(block_hash, parent_hash, token_ids,
        block_id)`` of each full block the prefix cache took, once the forward pass has written
        its K/V. The round pays one copy out of the pool; the writer thread does the rest."""
        self._report_evicted()  # what the writer's puts evicted since the last round
        if not blocks:
            return
        model = self.model
        index = torch.tensor([b[3] for b in blocks], device=model.cfg.device)
        ks, vs = (pool[:, index].cpu() for pool in (model.kv_pool_k, model.kv_pool_v))
        for i, (block_hash, parent_hash, token_ids, _) in enumerate(blocks):
            entry = TierEntry(block_hash, parent_hash, token_ids, ks[:, i], vs[:, i])
            key = self.key(block_hash)
            with self._lock:
                if key in self._pending:
                    continue
                if self._pending_bytes + entry.nbytes > MAX_PENDING_BYTES:
                    self.dropped += 1  # the writer is far behind: this block can be computed
                    continue
                self._pending[key] = entry
                self._pending_bytes += entry.nbytes
                if self.tier.reports_evictions:
                    self._announced[key] = block_hash
            self._queue.put(key)
            self.observer.tier_stored(self.tier.medium, block_hash, parent_hash, token_ids)
        self._start_writer()

    def flush(self) -> None:
        """Wait until every stored block is in the tier (a restart, a test, a shutdown)."""
        self._queue.join()
        self._report_evicted()

    def _report_evicted(self) -> None:
        """Each block this engine announced in the tier and the tier no longer holds (evicted
        for room, or never written): a ``BlockRemoved`` of its medium, so that a router's index
        of the tier forgets it too. Keys it never announced (another model's, the last run's
        on a disk) are not its to report."""
        with self._lock:
            gone, self._unstored = self.tier.take_evicted() + self._unstored, []
            removed = [self._announced.pop(key, None) for key in gone]
        for block_hash in removed:
            if block_hash is not None:
                self.observer.tier_removed(self.tier.medium, block_hash)

    def close(self) -> None:
        self.stop_writer()
        self.tier.close()

    def stop_writer(self) -> None:
        """Flush, then end the writer thread (a later store starts another): no thread of ours
        may still hold torch's state when the interpreter ends."""
        self.flush()
        with self._lock:  # under the lock: the writer cannot be deciding to end meanwhile
            writer = self._writer
            if writer is not None:
                self._queue.put(None)
        if writer is not None:
            writer.join(timeout=5)

    def figures(self) -> dict[str, int]:
        """The tier's counters (``EngineStats``' fields of the same names)."""
        return {
            "external_prefix_cache_queries": self.queries,
            "external_prefix_cache_hits": self.hits,
            "kv_offload_loads": self.loads,
            "kv_offload_stores": self.stores,
            "kv_offload_bytes_loaded": self.bytes_loaded,
            "kv_offload_bytes_stored": self.bytes_stored,
            "kv_offload_failures": self.tier.failures + self.corrupt + self.dropped,
        }

    def _start_writer(self) -> None:
        with self._lock:  # the writer decides to end under the same lock (``_write``)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="kv-offload", daemon=True)
                self._writer.start()

    def _write(self) -> None:
        """The writer thread: encode each pending block and put it in the tier (unless it is
        there already: a fleet computes some blocks twice). It ends when idle for a second
        (an engine that stores nothing holds no thread); the next store starts another."""
        while True:
            try:
                key = self._queue.get(timeout=1.0)
            except queue.Empty:
                with self._lock:  # a store that queued meanwhile finds no writer and starts one
                    if self._queue.empty():
                        self._writer = None
                        return
                continue
            if key is None:
                with self._lock:
                    self._writer = None
                self._queue.task_done()
                return
            with self._lock:
                entry = self._pending[key]
            try:
                if self.tier.contains(key):
                    pass  # a fleet computes some blocks twice: the other replica stored it
                elif self.tier.put(key, self._encode(entry)):
                    self.stores += 1
                    self.bytes_stored += entry.nbytes
                else:
                    with self._lock:
                        self._unstored.append(key)
            finally:
                with self._lock:
                    del self._pending[key]
                    self._pending_bytes -= entry.nbytes
                self._queue.task_done()

    # ---- the entry's bytes ------------------------------------------------------------------

    def _encode(self, entry: TierEntry) -> bytes:
        """A JSON header (what the entry claims, and the CRC of the rest), then K and V."""
        payload = entry.k.contiguous().view(torch.uint8).numpy().tobytes()
        payload += entry.v.contiguous().view(torch.uint8).numpy().tobytes()
        header = {
            "format": FORMAT,
            "model": self.fingerprint,
            "block_hash": entry.block_hash,
            "parent_hash": entry.parent_hash,
            "token_ids": list(entry.token_ids),
            "dtype": str(self._dtype),
            "shape": list(self._shape),
            "crc32": zlib.crc32(payload),
        }
        head = json.dumps(header).encode()
        return struct.pack("<I", len(head)) + head + payload

    def _decode(self, raw: bytes, block_hash: int) -> TierEntry:
        """The entry in ``raw``, if it is what the key says: this model's, this block's, this
        shape and dtype, and its bytes intact. Otherwise ValueError (a miss)."""
        (head_len,) = struct.unpack_from("<I", raw)
        header = json.loads(raw[4 : 4 + head_len])
        payload = raw[4 + head_len :]
        expected = {
            "format": FORMAT,
            "model": self.fingerprint,
            "block_hash": block_hash,
            "dtype": str(self._dtype),
            "shape": list(self._shape),
        }
        wrong = [name for name, value in expected.items() if header.get(name) != value]
        if wrong:
            raise ValueError(f"its {', '.join(wrong)} differ from this engine's")
        if zlib.crc32(payload) != header["crc32"]:
            raise ValueError("its bytes are corrupt (CRC)")
        size = torch.Size(self._shape).numel() * torch.empty((), dtype=self._dtype).element_size()
        if len(payload) != 2 * size:
            raise ValueError(f"it holds {len(payload)} bytes, not {2 * size}")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        k, v = (part.view(self._dtype).view(self._shape) for part in data.split(size))
        tokens = tuple(header["token_ids"])
        return TierEntry(block_hash, header["parent_hash"], tokens, k, v)


_LIVE: weakref.WeakSet[KVOffload] = weakref.WeakSet()


def flush_second_tiers() -> None:
    """Wait until every engine's stored blocks are in its tier: a disk tier that survives a
    restart must hold what the last run stored. At the interpreter's exit, and where a process
    ends without it (the server's engine process)."""
    for offload in list(_LIVE):
        offload.stop_writer()


atexit.register(flush_second_tiers)
