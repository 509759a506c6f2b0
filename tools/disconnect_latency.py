"""How long a client's disconnect takes to reach the engine of ``python -m <step>.serve``, while
other streams keep it busy.

The server runs as a user runs it, in its own process, and its engine in a process of its own
(or on a thread, with ``-- --engine-in-thread``), with one change made from outside: a
``sitecustomize`` module, which every Python process started with it on its path imports first,
wraps the step's ``PagedPrefixCacheEngine.abort`` to print the moment it is called. This script
is the client. It keeps ``--streams`` long answers streaming (the load), then, once per trial,
opens one more stream, reads two events, hangs up, and notes the moment; the gap to the
engine's next abort is the latency. Both moments are ``time.perf_counter()``, the system's
monotonic clock on Linux, the same in every process.

    python tools/disconnect_latency.py --model DIR [--step step14_7] [--streams 16]
        [--trials 20] [-- any flag of the server]

The disconnect travels: the socket closes, the event loop reads the end of the connection,
Starlette cancels the stream, the abort is sent, and the engine takes it at its next pause
between rounds. So the latency is at most about a round, plus the event loop's delay (with the
engine on a thread, the event loop waits for Python's GIL too).
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HOOK = """
import sys, time
from front.steps import load_step
engine_class = load_step({step!r}).PagedPrefixCacheEngine
real_abort = engine_class.abort
def abort(self, request_id):
    print(f"abort {{time.perf_counter()!r}}", file=sys.stderr, flush=True)
    return real_abort(self, request_id)
engine_class.abort = abort
"""
LONG = 1000  # max_tokens of the stream that hangs up: it would outlive the measurement


def start_server(
    step: str, argv: list[str], hook_dir: Path
) -> tuple[subprocess.Popen, str, queue.Queue]:
    """The server, its URL, and a queue of the moments its engine aborted a request."""
    (hook_dir / "sitecustomize.py").write_text(HOOK.format(step=step))
    path = os.pathsep.join([str(hook_dir), str(ROOT), os.environ.get("PYTHONPATH", "")])
    server = subprocess.Popen(
        [sys.executable, "-m", f"{step}.serve", *argv, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    for line in server.stdout:  # type: ignore[union-attr]
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            break
    else:
        raise SystemExit(f"the server did not start: {server.stderr.read()}")  # type: ignore[union-attr]
    aborts: queue.Queue = queue.Queue()

    def read_aborts() -> None:
        for line in server.stderr:  # type: ignore[union-attr]
            if line.startswith("abort "):
                aborts.put(float(line.split()[1]))

    threading.Thread(target=read_aborts, daemon=True).start()
    return server, match.group(1), aborts


def stream_body(max_tokens: int) -> dict[str, object]:
    return {"prompt": "The weather is nice today", "max_tokens": max_tokens, "stream": True}


def keep_streaming(url: str, max_tokens: int, stop: threading.Event) -> None:
    """One stream after another, read to the end, until ``stop``: a steady load."""
    with httpx.Client(timeout=None) as client:
        while not stop.is_set():
            with client.stream("POST", url + "/v1/completions", json=stream_body(max_tokens)) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name}\{{.*\}} (\S+)$", text, re.M).group(1))


def one_disconnect(url: str, aborts: queue.Queue) -> float:
    """Seconds from hanging up a stream to the engine's abort of it."""
    with httpx.stream("POST", url + "/v1/completions", json=stream_body(LONG)) as answer:
        events = (line for line in answer.iter_lines() if line.startswith("data: "))
        next(events), next(events)
        answer.close()  # the socket closes here
        closed = time.perf_counter()
    return aborts.get(timeout=60) - closed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--step", default="step14_7")
    p.add_argument("--streams", type=int, default=16, help="streams that keep the engine busy")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=512, help="of each load stream")
    p.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = p.parse_args()
    argv = ["--model", args.model, "--max-running", str(args.streams + 1), *args.server_flags]
    with tempfile.TemporaryDirectory() as hook_dir:
        server, url, aborts = start_server(args.step, argv, Path(hook_dir))
        return measure(args, server, url, aborts)


def measure(
    args: argparse.Namespace, server: subprocess.Popen, url: str, aborts: queue.Queue
) -> int:
    stop = threading.Event()
    load = [
        threading.Thread(target=keep_streaming, args=(url, args.max_tokens, stop), daemon=True)
        for _ in range(args.streams)
    ]
    try:
        for thread in load:
            thread.start()
        while metric(url, "vllm:num_requests_running") < args.streams:
            time.sleep(0.05)
        latencies = []
        for _ in range(args.trials):
            latencies.append(one_disconnect(url, aborts))
            time.sleep(0.1)
        tpot = "vllm:time_per_output_token_seconds"
        gap = metric(url, tpot + "_sum") / metric(url, tpot + "_count")
    finally:
        stop.set()
        server.terminate()
        server.wait()
    ms = sorted(1000 * s for s in latencies)
    print(
        f"{args.step}, {args.streams} streams of load, {args.trials} disconnects: "
        f"median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms; a round (the mean "
        f"time per output token) took {1000 * gap:.1f} ms\n  all: "
        + ", ".join(f"{m:.1f}" for m in ms)
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
