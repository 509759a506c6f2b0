"""KV cache events on the wire (``front/serve/kv_events.py``; ``--kv-events-config``), as vLLM
publishes them.

- the bytes: msgpack of ``[ts, events, data_parallel_rank]``, each event a map tagged by its
  class with vLLM's fields, decoded back by msgspec into the engine's own events (vLLM cannot
  be installed beside this project's torch, so its classes are mirrored field for field and the
  layout is pinned on the raw msgpack; ``tools/vllm_events.py``, run by a Python with vLLM's CPU
  build, decodes a live server's events with vLLM's own classes and compares its replay with
  vLLM's own publisher's, frame for frame: docs/scale-out.md);
- the stream: the engine core's loop (``EngineCore``) publishes after every round and every
  pause (aborts, ``reset_prefix_cache``); a subscriber that decodes and replays it holds the
  prefix cache's content after every batch, through evictions, preemptions, an abort and a reset;
  the sequence numbers run 0, 1, 2... under the configured topic;
- the replay socket: a late subscriber asks for what it missed and gets the batches still in the
  bounded buffer, then the end marker, in vLLM 0.33's frames (each answer the live stream's
  three frames, topic first; the end marker ``b"", END_SEQ, b""``), decoded as vLLM's own
  reader and vllm-router's replay reader decode them: a batch dropped on the way comes back;
- ``medium``: the engine's pool is ``"GPU"``, as vLLM (its CPU build too) names it;
- ``GET /kv_event_sources``: vLLM's answer, the publisher's settings under its rank;
- the real server: ``serve.py --kv-events-config`` publishes its engine's events, the same ones
  the step's engine records offline for the same requests;
- the flag: vLLM's keys only, each of its type, one ``error:`` line otherwise.
"""

from __future__ import annotations

import argparse
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

zmq = pytest.importorskip(
    "zmq", reason="KV events on the wire need pyzmq: pip install -e '.[cluster]'"
)
msgspec = pytest.importorskip("msgspec", reason="the KV events' msgpack needs msgspec")

from common import kv_events  # noqa: E402
from common.inputs import check_request  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from front.serve.engine_core import Abort, AddRequest, Call, EngineCore, Stop  # noqa: E402
from front.serve.kv_events import (  # noqa: E402
    DECODER,
    END_SEQ,
    KVEventBatch,
    ZmqEventPublisher,
    from_wire,
    to_wire,
)
from front.serve.kv_events_config import (  # noqa: E402
    KVEventsConfig,
    event_sources,
    kv_events_config,
)
from front.serve.options import parse_args  # noqa: E402
from front.steps import load_step  # noqa: E402
from tests.engine.test_kv_events import cache_content  # noqa: E402
from tests.helpers import STEP_NAMES, tiny_config  # noqa: E402
from tests.serve.server_process import (  # noqa: E402
    API_KEY,
    ENGINE_FLAGS,
    ENGINE_OVERRIDES,
    ServerProcess,
)

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"  # a wildcard: the publisher binds, on loopback only
RECEIVE_TIMEOUT_MS = 30_000


def events_config(**changes: Any) -> KVEventsConfig:
    return KVEventsConfig(
        **{"enable_kv_cache_events": True, "endpoint": LOOPBACK_ANY_PORT, **changes}
    )


# ---- the bytes -------------------------------------------------------------------------------


def test_a_batch_is_vllms_msgpack_and_decodes_back() -> None:
    events = [
        kv_events.BlockStored([11, 12], None, list(range(8)), 4),
        kv_events.BlockRemoved([12]),
        kv_events.AllBlocksCleared(),
    ]
    payload = msgspec.msgpack.encode(KVEventBatch(1.5, [to_wire(e) for e in events], 0))
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": None,
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [12], "medium": None},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    batch = DECODER.decode(payload)
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    assert [from_wire(e) for e in batch.events] == events


def test_a_hash_uses_all_64_bits() -> None:
    """The engine's hashes are unsigned 64-bit integers: msgpack carries the largest one."""
    stored = kv_events.BlockStored([2**64 - 1], 2**63, [1, 2], 2)
    payload = msgspec.msgpack.encode(KVEventBatch(0.0, [to_wire(stored)]))
    assert from_wire(DECODER.decode(payload).events[0]) == stored


# ---- the stream, from the engine core's loop ---------------------------------------------------


class Recorder:
    """The publisher as the engine core sees it, recording the cache's content at each batch
    (on the core's own thread, right after the events were taken: the same moment)."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.engine: Any = None
        self.moments: list[dict] = []

    def publish(self, events: list) -> None:
        self.moments.append(cache_content(self.engine))
        self.publisher.publish(events)

    def shutdown(self) -> None:
        """Kept open: the test reads the stream after the engine core has stopped."""


def script(engine: Any, seed: int) -> Iterator[Any]:
    """What the engine core receives, pause after pause (None: the pause ends, a round runs):
    two waves of requests in a pool too small for them all, the first all at once (the youngest
    are preempted), the second a few rounds apart (its new prompts evict the first's blocks),
    an abort in each, then at rest a reset."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=6)
    for wave in range(2):
        prefix = [rng.randrange(512) for _ in range(12)]
        prompts = [
            prefix + [rng.randrange(512) for _ in range(rng.randint(1, 20))] for _ in "abcdef"
        ]
        for key, prompt in enumerate(prompts):
            request = check_request(prompt, None, None, engine.model.cfg, params)
            yield AddRequest(10 * wave + key, request)
            yield from [None] * rng.randint(0, 2 * wave)  # the first wave at once: preemptions
        yield Abort(10 * wave + 1)
        while engine.has_work:
            yield None
    yield Call(0, "reset_prefix_cache")
    yield Stop()


def drive(engine: Any, publisher: Recorder, messages: Iterator[Any]) -> None:
    """The engine core's loop on this thread, fed by ``messages``."""

    def receive(block: bool) -> Any:
        return next(messages, None)

    EngineCore(engine, publisher).run(receive, lambda message: None)


def subscriber(endpoint: str, topic: bytes) -> Any:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    return sub


def replay_socket(endpoint: str, first: int) -> Any:
    """A DEALER that asked ``endpoint`` for every batch from ``first`` on: the empty delimiter
    (a REQ socket sends it by itself) and the 8-byte big-endian sequence number."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    return dealer


def ask_replay(endpoint: str, first: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
    """The replay from ``first``, (seq, payload) each, read as vLLM's own subscriber reads it
    (its publisher tests'): the delimiter off, as a REQ socket takes it off; an answer whose
    last frame is empty ends the replay; any other is topic, sequence number, payload, with
    the live stream's topic. (Here through a DEALER: a REQ socket reads one answer only.)"""
    dealer = replay_socket(endpoint, first)
    answers = []
    try:
        while True:
            delimiter, *frames = dealer.recv_multipart()
            assert delimiter == b""
            if not frames[-1]:
                assert frames == [b"", END_SEQ, b""], "vLLM's end marker, byte for byte"
                return answers
            got_topic, seq, payload = frames
            assert got_topic == topic, f"the replay's topic is {got_topic!r}"
            answers.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def router_replay(endpoint: str, last_seq: int) -> list[tuple[int, bytes]]:
    """The replay as vllm-router reads it (``src/kv_index/subscriber.rs``: ``replay``): it asks
    for everything after ``last_seq``, reads answers of at least four frames (delimiter, topic,
    sequence number, payload), the sequence number signed, second from the end, and stops at
    a shorter answer or at -1; a sequence number it already has is skipped."""
    dealer = replay_socket(endpoint, last_seq + 1)
    applied = []
    try:
        while True:
            frames = dealer.recv_multipart()
            if len(frames) < 4:
                return applied
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                return applied
            if seq > last_seq:
                applied.append((seq, frames[-1]))
                last_seq = seq
    finally:
        dealer.close(linger=0)


def receive_all(sub: Any, count: int, replay_endpoint: str) -> list[tuple[bytes, int, bytes]]:
    """``count`` batches, in order: live from ``sub``; any the subscription joined too late for
    (ZMQ's slow joiner) asked from the replay socket, as a real consumer does."""
    live = []
    while not live or int.from_bytes(live[-1][1], "big") < count - 1:
        live.append(sub.recv_multipart())
    first_live = int.from_bytes(live[0][1], "big")
    replayed = ask_replay(replay_endpoint, 0, b"kv")
    missed = [(b"kv", seq, p) for seq, p in replayed if seq < first_live]
    return missed + [(topic, int.from_bytes(seq, "big"), p) for topic, seq, p in live]


@pytest.mark.parametrize("seed", range(3))
def test_the_stream_rebuilds_the_cache_after_every_batch(seed: int) -> None:
    step = load_step(STEP_NAMES[-1])
    cfg = tiny_config(block_size=4, total_blocks=12)
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(cfg), max_running=4, enable_kv_cache_events=True
    )
    config = events_config(replay_endpoint=LOOPBACK_ANY_PORT, topic="kv")
    recorder = Recorder(ZmqEventPublisher(config))
    recorder.engine = engine
    sub = subscriber(recorder.publisher.endpoint, b"kv")
    try:
        time.sleep(0.2)  # most of the subscription through; what it misses comes by replay
        drive(engine, recorder, script(engine, seed))
        batches = receive_all(sub, len(recorder.moments), recorder.publisher.replay_endpoint)
    finally:
        sub.close(linger=0)
        recorder.publisher.shutdown()
    assert [(topic, seq) for topic, seq, _ in batches] == [
        (b"kv", seq) for seq in range(len(recorder.moments))
    ]
    content: dict = {}
    kinds = set()
    for (_, seq, payload), moment in zip(batches, recorder.moments, strict=True):
        events = [from_wire(e) for e in DECODER.decode(payload).events]
        kinds |= {type(e) for e in events}
        assert kv_events.replay(events, content) == moment, f"after batch {seq}"
    assert kinds == {kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared}
    assert engine.stats.preemptions > 0 and engine.stats.evictions > 0


# ---- the replay socket ------------------------------------------------------------------------


def test_the_replay_socket_resends_what_its_bounded_buffer_holds() -> None:
    config = events_config(replay_endpoint=LOOPBACK_ANY_PORT, buffer_steps=3)
    publisher = ZmqEventPublisher(config)
    try:
        for i in range(5):  # nobody subscribed: the live messages are lost, the buffer keeps 3
            publisher.publish([kv_events.BlockRemoved([i])])
        publisher._queue.join()  # every batch sent and buffered
        assert (
            ask_replay(publisher.replay_endpoint, 3) == ask_replay(publisher.replay_endpoint, 0)[1:]
        )
        answers = ask_replay(publisher.replay_endpoint, 0)
        assert [seq for seq, _ in answers] == [2, 3, 4]  # 0 and 1 left the buffer
        assert [DECODER.decode(p).events[0].block_hashes for _, p in answers] == [[2], [3], [4]]
        assert ask_replay(publisher.replay_endpoint, 5) == []  # up to date: the end marker only
    finally:
        publisher.shutdown()


def test_a_replay_answer_is_vllms_frames_byte_for_byte() -> None:
    """What the ROUTER socket sends, before any socket takes a frame off (a DEALER takes none):
    for each batch the delimiter, then the live message's three frames, the topic first; then
    vLLM's end marker, an empty topic, -1 in 8 signed big-endian bytes and an empty payload."""
    topic = "kv@pod-0@demo"  # llm-d's indexer's pattern: any topic goes through as it is
    publisher = ZmqEventPublisher(events_config(replay_endpoint=LOOPBACK_ANY_PORT, topic=topic))
    try:
        for i in range(3):
            publisher.publish([kv_events.BlockRemoved([i], kv_events.MEDIUM_GPU)])
        publisher._queue.join()
        dealer = replay_socket(publisher.replay_endpoint, 1)
        try:
            answers = [dealer.recv_multipart() for _ in range(3)]
        finally:
            dealer.close(linger=0)
    finally:
        publisher.shutdown()
    for seq, frames in zip([1, 2], answers[:2], strict=True):
        assert frames[:3] == [b"", topic.encode(), seq.to_bytes(8, "big")]
        assert len(frames) == 4 and DECODER.decode(frames[3]).events[0].block_hashes == [seq]
    assert answers[2] == [b"", b"", b"\xff" * 8, b""] and END_SEQ == b"\xff" * 8


def test_a_dropped_batch_comes_back_as_vllms_readers_read_the_replay() -> None:
    """A batch lost between a replica and the router: the router sees the next sequence
    number skip one, asks the replay socket for everything after the last batch it has, and
    fills the gap, as vllm-router's subscriber does; its index then holds every block that
    was published, tokens and all. vLLM's own reader, asking from the lost batch, gets it with
    the stream's topic, then the end marker. (With a replay that left the topic out, the
    router's reader stopped at the first answer: the lost batch's blocks were never credited;
    vLLM's reader could not unpack the answer.)"""
    config = events_config(replay_endpoint=LOOPBACK_ANY_PORT)  # topic "": vllm-router's
    publisher = ZmqEventPublisher(config)
    sub = subscriber(publisher.endpoint, b"")
    stored = [
        kv_events.BlockStored([100 + i], 100 + i - 1 if i else None, [i] * 4, 4, None, "GPU")
        for i in range(8)
    ]
    try:
        time.sleep(0.2)  # the subscription through (a slow joiner only starts later)
        for event in stored:
            publisher.publish([event])
        live = []
        while not live or int.from_bytes(live[-1][1], "big") < len(stored) - 1:
            live.append(sub.recv_multipart())
        assert len(live) >= 4, "the subscription joined too late to drop a batch in the middle"
        lost = int.from_bytes(live[-3][1], "big")
        arrived = [m for m in live if int.from_bytes(m[1], "big") != lost]

        # vllm-router's subscriber loop over what arrived (``src/kv_index/subscriber.rs``)
        index: dict = {}
        applied, last_seq = [], -1
        for _topic, seq_bytes, payload in arrived:
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq != -1 and seq > last_seq + 1:  # a gap: replay after the last one
                for replayed_seq, replayed in router_replay(publisher.replay_endpoint, last_seq):
                    kv_events.replay([from_wire(e) for e in DECODER.decode(replayed).events], index)
                    applied.append(replayed_seq)
                    last_seq = replayed_seq
            if seq > last_seq:
                kv_events.replay([from_wire(e) for e in DECODER.decode(payload).events], index)
                applied.append(seq)
                last_seq = seq
        first = int.from_bytes(live[0][1], "big")
        assert lost in applied and applied == list(range(first, len(stored)))
        assert index == kv_events.replay(stored[first:])  # every block, the lost one's too
        credited = sum(len(tokens) for _, tokens in index.values())
        assert credited == 4 * (len(stored) - first)

        vllm_reads = ask_replay(publisher.replay_endpoint, lost)
    finally:
        sub.close(linger=0)
        publisher.shutdown()
    assert [seq for seq, _ in vllm_reads] == list(range(lost, len(stored)))
    assert from_wire(DECODER.decode(vllm_reads[0][1]).events[0]) == stored[lost]


def test_an_endpoint_in_use_is_one_line() -> None:
    first = ZmqEventPublisher(events_config())
    try:
        with pytest.raises(
            OSError, match=r"KV events: cannot open tcp://\*:\d+: Address already in use"
        ):
            ZmqEventPublisher(events_config(endpoint=first.endpoint.replace("127.0.0.1", "*")))
    finally:
        first.shutdown()


# ---- the real server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_publishes_its_engines_events(chat_checkpoint: Path) -> None:
    """The server's engine process binds its PUB socket (vLLM's rule for a wildcard host) and
    this test subscribes, as a router does; requests one after the other in a pool that must
    evict, then a reset: the events are the step's engine's, offline, for the same requests,
    every block in ``"GPU"``. ``GET /kv_event_sources`` says where they are, with no key."""
    step_name, port = STEP_NAMES[-1], free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}'
    pool = ["--total-blocks", "48", "--max-model-len", "160"]
    key = ["--api-key", API_KEY]
    server = ServerProcess(
        step_name, chat_checkpoint, *ENGINE_FLAGS, *pool, *key, "--kv-events-config", config
    )
    prompts = [[5 + i, 6, 7, 8] * (10 + 3 * i) for i in range(4)]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        sources = httpx.get(server.url + "/kv_event_sources", timeout=60).json()
        time.sleep(0.5)  # the subscription through before the first event
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60)
            assert answer.status_code == 200
        reset = httpx.post(server.url + "/reset_prefix_cache", headers=auth, timeout=60)
        assert reset.status_code == 200
        received = []
        while not received or not isinstance(received[-1], kv_events.AllBlocksCleared):
            try:
                received += [from_wire(e) for e in DECODER.decode(sub.recv_multipart()[2]).events]
            except zmq.Again:
                raise AssertionError(f"{received}\n{server.stop()}") from None
    finally:
        sub.close(linger=0)
        server.kill()
    step = load_step(step_name)
    model = step.TinyTransformerPaged.from_pretrained(
        chat_checkpoint, **{**ENGINE_OVERRIDES, "total_blocks": 48, "max_model_len": 160}
    )
    engine = step.PagedPrefixCacheEngine(model, max_running=16, enable_kv_cache_events=True)
    engine.generate_serial(prompts, max_new_tokens=6)
    engine.reset_prefix_cache()
    expected = engine.take_events()
    assert received == expected
    assert any(isinstance(e, kv_events.BlockRemoved) for e in expected)
    assert {e.medium for e in expected if not isinstance(e, kv_events.AllBlocksCleared)} == {"GPU"}
    assert sources == event_sources(kv_events_config(config))
    assert sources["0"]["endpoint"] == f"tcp://*:{port}" and sources["0"]["publisher"] == "zmq"


# ---- where the events are: GET /kv_event_sources ---------------------------------------------


def test_the_sources_are_vllms_answer() -> None:
    """vLLM 0.33's route answers its engine client's ``get_kv_event_sources()``, a map from
    each data-parallel rank to its publisher's ``KVEventsConfig``, every key, the publisher
    named; JSON makes the rank a string. Nothing published (events off, or the ``null``
    publisher): an empty map."""
    config = kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5591", '
        '"replay_endpoint": "tcp://*:5592", "topic": "kv@pod-0@demo"}'
    )
    assert event_sources(config) == {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5591",
            "replay_endpoint": "tcp://*:5592",
            "buffer_steps": 10_000,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "kv@pod-0@demo",
        }
    }
    assert event_sources(None) == {}
    assert event_sources(kv_events_config('{"enable_kv_cache_events": false}')) == {}
    assert (
        event_sources(kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}'))
        == {}
    )


# ---- the flag ---------------------------------------------------------------------------------


def test_the_flag_reads_vllms_keys(chat_checkpoint: Path) -> None:

    config = ["--kv-events-config", '{"enable_kv_cache_events": true}']
    options = parse_args("serve", ["--model", str(chat_checkpoint), *config], STEP_NAMES[-1])
    assert options.kv_events == KVEventsConfig(enable_kv_cache_events=True)
    assert options.kv_events.publishes
    assert not kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert not kv_events_config("{}").publishes  # vLLM's default: off
    assert parse_args("serve", ["--model", str(chat_checkpoint)], STEP_NAMES[-1]).kv_events is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[1]", "a JSON object"),
        ("{", "not JSON"),
        ('{"enable_events": true}', "unknown key 'enable_events'"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be bool"),
        ('{"buffer_steps": true}', "buffer_steps must be int"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "http://x:1"}', "endpoint must be tcp://"),
        ('{"replay_endpoint": 5557}', "replay_endpoint must be str or null"),
    ],
)
def test_a_bad_config_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        kv_events_config(text)


def test_a_bad_config_is_one_line_at_the_command_line(
    chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        config = ["--kv-events-config", '{"topics": ""}']
        parse_args("serve", ["--model", str(chat_checkpoint), *config], STEP_NAMES[-1])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1].startswith("serve: error: argument --kv-events-config: unknown key 'topics'")


def test_a_missing_package_is_one_line() -> None:
    """Without pyzmq or msgspec, ``--kv-events-config`` stops the server before any load."""
    from common.errors import MissingPackageError
    from front.serve.cli import require_packages

    with pytest.raises(MissingPackageError, match=r"^--kv-events-config needs no_such_zmq: pip "):
        require_packages(("no_such_zmq",), "--kv-events-config", "cluster")
