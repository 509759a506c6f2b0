"""KV cache events on the wire, as vLLM publishes them (``vllm/distributed/kv_events.py``).

The engine records every change of its prefix cache (``common/kv_events.py``); the engine core
drains them after each round and hands them here (``EngineCore.publish_events``), as vLLM's
scheduler hands its round's events to the engine core's publisher. A router that keeps one
index of every replica's cache (``vllm-router --policy kv_aware``, llm-d's KV-cache indexer,
Dynamo's KV router) subscribes and routes each request where its prefix already lives.

What goes out, frame by frame (a ZMQ multipart message per batch, on a PUB socket):

1. the topic (``topic``, UTF-8; subscribers filter on it);
2. the batch's sequence number, 8 bytes big-endian, 0 for the first batch, one more per batch:
   a subscriber that sees a gap knows it missed batches;
3. the batch, msgpack: ``KVEventBatch`` as an array ``[ts, events, data_parallel_rank]``, each
   event a map tagged by its class, ``{"type": "BlockStored", "block_hashes": [...], ...}``.

The replay socket (ROUTER, when ``replay_endpoint`` is set) answers a request of 8 bytes, a
sequence number, with every batch still in the buffer (the last ``buffer_steps``) from that one
on, each as the live stream has it, ``(topic, seq, payload)``, then the end marker
``(b"", END_SEQ, b"")``, ``END_SEQ`` being -1 in 8 signed big-endian bytes (vLLM 0.33's
``_service_replay``): a subscriber that joined late or lost messages asks for what it missed,
and replays it before the live stream. The ROUTER socket sends each answer to the asker's
identity, after an empty delimiter: a REQ socket reads three frames, as from the PUB socket
(and one answer only); a DEALER reads four, the delimiter first, answer after answer.
vllm-router's replay reader (a DEALER) wants that layout: it stops at an answer of fewer than
four frames and takes the sequence number from the second frame from the end, so answers
without the topic fill no gap.

The sockets belong to one thread (ZMQ sockets are not thread safe), as in vLLM: ``publish``
only queues the batch, so the engine's loop never waits on the network; the thread encodes and
sends it, and answers replay requests between two batches (within 0.1 s while idle).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from common import kv_events

from .kv_events_config import KVEventsConfig

# ---- the wire format: vLLM's structs, field for field -----------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of every event: encoded as a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: kv_events.KVCacheEvent) -> KVCacheEvent:
    """The engine's event as vLLM's struct (the same fields; this engine has no LoRA)."""
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            None,
        )
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), event.medium)
    return AllBlocksCleared()


def from_wire(event: KVCacheEvent) -> kv_events.KVCacheEvent:
    """Back to the engine's event (what a subscriber replays with ``kv_events.replay``)."""
    if isinstance(event, BlockStored):
        return kv_events.BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, BlockRemoved):
        return kv_events.BlockRemoved(event.block_hashes, event.medium)
    return kv_events.AllBlocksCleared()


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker's sequence number


# ---- the publisher ---------------------------------------------------------------------------


class NullEventPublisher:
    """Events on, publisher ``null``: drained and dropped (vLLM's ``NullEventPublisher``)."""

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: a PUB socket, an optional ROUTER replay socket, a buffer of
    the last ``buffer_steps`` batches, and the thread that owns them."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sequence = count()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            attach(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                # vLLM's: room for a whole buffer's replay and its end marker, however slow the
                # asker (ZMQ sees a reader's progress only every half high-water mark)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close()
            where = config.endpoint if self._replay is None else config.replay_endpoint
            raise OSError(f"KV events: cannot open {where}: {exc}") from None
        # Where it really is: a wildcard port (tcp://127.0.0.1:*) is resolved once bound.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queue one batch (a round's events) for the thread; waits only if the queue is full."""
        batch = KVEventBatch(time.time(), [to_wire(e) for e in events], self.rank)
        self._queue.put(batch)

    def shutdown(self) -> None:
        """Send what is queued (for up to a second), then close the sockets."""
        self._queue.put(None)
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        self._close()

    def _close(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(self._sequence), encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._queue.task_done()  # queue.join() returns once every batch is out

    def _serve_replay(self) -> None:
        """One replay request: every buffered batch from its sequence number on, each as the
        live stream sends it (topic, seq, payload), then the end marker (b"", END_SEQ, b"");
        each after the asker's identity and the empty delimiter, as a ROUTER answers."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a request (identity, empty delimiter, 8-byte sequence number)
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                answer = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(answer)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def attach(socket: zmq.Socket, endpoint: str) -> None:
    """vLLM's rule: bind a wildcard (``*``, ``::``) or a local transport, connect otherwise."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` asks for (vLLM's ``EventPublisherFactory.create``)."""
    return ZmqEventPublisher(config) if config.publishes else NullEventPublisher()
