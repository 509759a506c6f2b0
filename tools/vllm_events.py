"""A step's server's KV cache events, checked with vLLM's own code.

vLLM cannot be installed beside this project's CPU torch, so this script runs under another
Python, one with vLLM's CPU build (docs/scale-out.md says how to make it). It subscribes to a
running ``python -m <step>.serve --kv-events-config ...``, sends it requests that fill its pool
and evict, resets the prefix cache, and checks, with vLLM's own classes and publisher:

- the live stream: every batch decoded by ``msgspec.msgpack.Decoder(type=KVEventBatch)`` from
  ``vllm.distributed.kv_events``, as a KV-aware router decodes it, with the ``medium`` of every
  block event, and this project's decoder (``front/serve/kv_events.py``, run by
  ``--project-python``) giving the same;
- the replay: the server's replay socket asked for every batch from the first one received,
  and vLLM's own ``ZmqEventPublisher`` given the same batches and asked for all of them: the
  answers, frame for frame and byte for byte, the end marker included (vLLM's publisher numbers
  them from 0: on a server that published before, its numbers are shifted to the server's);
- ``GET /kv_event_sources``: each source must build vLLM's ``KVEventsConfig`` (which refuses an
  unknown key or a wrong type), and the answer be, byte for byte, what vLLM's own route
  (``vllm/entrypoints/serve/instrumentator/basic.py``) answers over HTTP for those configs.

    VLLM_PYTHON tools/vllm_events.py --url http://127.0.0.1:8765 --events tcp://127.0.0.1:5591 \
        --replay tcp://127.0.0.1:5592 --project-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import zmq
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_MS = 30_000
# Seven prompts behind one 4-token pattern, each longer than the one before: they share blocks,
# and fill a small pool (--total-blocks 24) until it evicts.
PROMPTS = [[5 + i, 6, 7, 8] * (10 + 3 * i) for i in range(6)] + [[5, 6, 7, 8] * 10 + [9] * 7]
PROJECT_DECODE = """
import pickle, sys, msgspec
from front.serve.kv_events import DECODER
payloads = pickle.load(sys.stdin.buffer)
pickle.dump([msgspec.to_builtins(DECODER.decode(p)) for p in payloads], sys.stdout.buffer)
"""


def send_requests(url: str, model: str) -> None:
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()


def receive_until_cleared(sub: zmq.Socket) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every batch up to the reset's ``AllBlocksCleared``."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = []
    while True:
        topic, seq, payload = sub.recv_multipart()
        batches.append((topic, int.from_bytes(seq, "big"), payload))
        events = decoder.decode(payload).events
        if events and isinstance(events[-1], AllBlocksCleared):
            return batches


def replay_answers(endpoint: str, first: int) -> list[list[bytes]]:
    """Every answer of a replay socket to a request for ``first``, each as a DEALER reads it
    (the empty delimiter first), up to and with the end marker (its ``END_SEQ``)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    answers = []
    try:
        while True:
            answers.append(dealer.recv_multipart())
            if answers[-1][-2] == ZmqEventPublisher.END_SEQ:
                return answers
    finally:
        dealer.close(linger=0)


def vllms_replay(payloads: list[bytes], topic: str, first: int) -> list[list[bytes]]:
    """What vLLM's own publisher answers for all of them, once it has published the batches
    these payloads hold (decoded with vLLM's classes: the same ``ts`` and rank), its sequence
    numbers counted from ``first``."""
    where = f"inproc://vllm-events-{time.monotonic_ns()}"
    publisher = ZmqEventPublisher(0, where, where + "-replay", len(payloads), topic=topic)
    try:
        for payload in payloads:
            publisher.publish(msgspec.msgpack.decode(payload, type=KVEventBatch))
        publisher._event_queue.join()  # every batch sent and buffered
        answers = replay_answers(where + "-replay", 0)
    finally:
        publisher.shutdown()
    for answer in answers[:-1]:  # not the end marker
        answer[2] = (int.from_bytes(answer[2], "big") + first).to_bytes(8, "big")
    return answers


class EngineClient:
    """What vLLM's route asks of its engine client: the publishers' configs by rank."""

    def __init__(self, configs: dict[int, KVEventsConfig]) -> None:
        self.configs = configs

    def get_kv_event_sources(self) -> dict[int, KVEventsConfig]:
        return self.configs


def check_sources(url: str) -> None:
    from vllm.entrypoints.serve.instrumentator.basic import router

    answer = httpx.get(f"{url}/kv_event_sources", timeout=60)
    configs = {int(rank): KVEventsConfig(**source) for rank, source in answer.json().items()}
    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = EngineClient(configs)
    vllms = TestClient(app).get("/kv_event_sources")
    print(f"GET /kv_event_sources: {answer.text}")
    print(f"  vLLM's KVEventsConfig built from each source; vLLM's route answers them with the "
          f"same bytes: {vllms.content == answer.content}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8765")
    p.add_argument("--model", default="toy", help="the server's --served-model-name")
    p.add_argument("--events", required=True, help="its events' endpoint, to connect to")
    p.add_argument("--replay", required=True, help="its replay endpoint, to connect to")
    p.add_argument("--topic", default="", help="its events' topic")
    p.add_argument("--project-python", required=True, help="a Python with this project")
    args = p.parse_args()

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(args.events)
    time.sleep(0.5)  # the subscription through before the first event
    send_requests(args.url, args.model)
    live = receive_until_cleared(sub)
    payloads = [payload for _, _, payload in live]

    decoded = [msgspec.msgpack.decode(p, type=KVEventBatch) for p in payloads]
    kinds = Counter(type(e).__name__ for batch in decoded for e in batch.events)
    media = Counter(getattr(e, "medium", "-") for batch in decoded for e in batch.events)
    first, last, topic = live[0][1], live[-1][1], live[0][0]
    print(f"vLLM's KVEventBatch decoded {len(live)} batches, seq {first} to {last} ({topic!r}):")
    print("  " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    print("  medium: " + ", ".join(f"{n} {medium}" for medium, n in sorted(media.items())))
    ours = subprocess.run(
        [args.project_python, "-c", PROJECT_DECODE],
        input=pickle.dumps(payloads),
        capture_output=True,
        cwd=REPO,
        check=True,
    )
    same = pickle.loads(ours.stdout) == [msgspec.to_builtins(batch) for batch in decoded]
    print(f"this project's decoder gives what vLLM's classes give, batch for batch: {same}")

    served = replay_answers(args.replay, first)
    # each answer as the live message it resends, (topic, seq, payload); None: not that shape
    as_live = [(a[1], int.from_bytes(a[2], "big"), a[3]) if len(a) == 4 else None for a in served]
    as_live = as_live[:-1]  # the end marker
    print(f"the server's replay from {first}: {len(served) - 1} batches, as the live stream sent "
          f"them: {as_live == live}; then the end marker {served[-1]}")  # fmt: skip
    same = served == vllms_replay(payloads, args.topic, first)
    print(f"vLLM's ZmqEventPublisher, given the same batches, answers the same frames: {same}")
    check_sources(args.url)


if __name__ == "__main__":
    main()
