"""A step's server's KV cache events, decoded with vLLM's own classes.

vLLM cannot be installed beside this project's CPU torch, so this script runs under another
Python, one with vLLM's CPU build (docs/scale-out.md says how to make it). It subscribes to a
running ``python -m <step>.serve --kv-events-config ...``, sends it requests that fill its pool
and evict, resets the prefix cache, and decodes every batch with
``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``, as a KV-aware router
does. Then it asks the replay socket for every batch from 0, and hands the raw payloads to this
project's own decoder (``front/serve/kv_events.py``, run by ``--project-python``) to compare.

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
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_MS = 30_000
END_SEQ = -1  # the replay socket's last answer
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


def receive_until_cleared(sub: zmq.Socket) -> list[tuple[int, bytes]]:
    """(seq, payload) of every batch up to the reset's ``AllBlocksCleared``."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = []
    while True:
        _topic, seq, payload = sub.recv_multipart()
        batches.append((int.from_bytes(seq, "big"), payload))
        events = decoder.decode(payload).events
        if events and isinstance(events[-1], AllBlocksCleared):
            return batches


def replay_from(endpoint: str, first: int) -> list[tuple[int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    answers = []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == END_SEQ:
            dealer.close(linger=0)
            return answers
        answers.append((int.from_bytes(seq, "big"), payload))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8765")
    p.add_argument("--model", default="toy", help="the server's --served-model-name")
    p.add_argument("--events", required=True, help="its events' endpoint, to connect to")
    p.add_argument("--replay", required=True, help="its replay endpoint, to connect to")
    p.add_argument("--project-python", required=True, help="a Python with this project")
    args = p.parse_args()

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(args.events)
    time.sleep(0.5)  # the subscription through before the first event
    send_requests(args.url, args.model)
    live = receive_until_cleared(sub)

    decoded = [msgspec.msgpack.decode(p, type=KVEventBatch) for _, p in live]
    kinds = Counter(type(e).__name__ for batch in decoded for e in batch.events)
    print(f"vLLM's KVEventBatch decoded {len(live)} batches, seq {live[0][0]} to {live[-1][0]}:")
    print("  " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    replayed = replay_from(args.replay, 0)
    print(f"the replay socket from 0: {len(replayed)} batches, the same: {replayed == live}")
    ours = subprocess.run(
        [args.project_python, "-c", PROJECT_DECODE],
        input=pickle.dumps([p for _, p in live]),
        capture_output=True,
        cwd=REPO,
        check=True,
    )
    same = pickle.loads(ours.stdout) == [msgspec.to_builtins(batch) for batch in decoded]
    print(f"this project's decoder gives what vLLM's classes give, batch for batch: {same}")


if __name__ == "__main__":
    main()
