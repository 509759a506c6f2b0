"""How long ``python -m <step>.serve`` takes to stop on Ctrl-C with streams open, and when it
says so.

The server runs as a user runs it, on the toy checkpoint (``python -m front.toy_checkpoint``,
written to a temporary folder unless ``--model`` names one). This script is the client: it
opens ``--streams`` streaming completions, waits until each has its first event, sends SIGINT
to the server, and times, from that moment, each line the server then says and its exit. With
``--busy N``, N busy loops run beside it the whole time (the machine loaded, as by a test run).

    python tools/stop_latency.py [--step step14_9] [--streams 64] [--runs 3] [--busy 2]
        [--model DIR] [-- any flag of the server]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BUSY = "while True: pass"


def start_server(step: str, argv: list[str]) -> tuple[subprocess.Popen, str, list]:
    """The server, its URL, and the list its stdout and stderr lines go to, each with the
    moment it came (``time.perf_counter()``)."""
    server = subprocess.Popen(
        [sys.executable, "-m", f"{step}.serve", *argv, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    for line in server.stdout:  # type: ignore[union-attr]
        match = re.search(r"serving on (http://\S+)", line)
        if match:
            break
    else:
        raise SystemExit(f"the server did not start: {server.stderr.read()}")  # type: ignore[union-attr]
    said: list[tuple[float, str]] = []

    def read(stream) -> None:
        for line in stream:
            said.append((time.perf_counter(), line.rstrip()))

    for stream in (server.stdout, server.stderr):
        threading.Thread(target=read, args=(stream,), daemon=True).start()
    return server, match.group(1), said


def stream(url: str, opened: threading.Barrier) -> None:
    """One long streaming completion, read until the server ends it."""
    body = {"prompt": "w1 w2 w3", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            opened.wait()
            for _ in lines:
                pass
    except (httpx.HTTPError, threading.BrokenBarrierError):
        pass  # the server went away: what is timed is the server's side


def one_stop(args: argparse.Namespace, argv: list[str]) -> dict[str, float]:
    """Seconds from SIGINT to each thing the server said after it, and to its exit."""
    server, url, said = start_server(args.step, argv)
    opened = threading.Barrier(args.streams + 1)
    clients = [threading.Thread(target=stream, args=(url, opened)) for _ in range(args.streams)]
    for client in clients:
        client.start()
    opened.wait(timeout=300)  # every stream has its first event
    before = len(said)
    sent = time.perf_counter()
    server.send_signal(signal.SIGINT)
    server.wait(timeout=120)
    ended = time.perf_counter()
    for client in clients:
        client.join(timeout=60)
    time.sleep(0.2)  # the readers take the last lines
    times = {line.split(": ", 1)[-1].split(";")[0]: moment - sent for moment, line in said[before:]}
    return times | {"its exit": ended - sent}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", default="step14_9")
    p.add_argument("--model", metavar="DIR", help="default: the toy checkpoint, written now")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="busy loops beside it (a loaded machine)")
    p.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = p.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as folder:
            model = args.model or make_toy_checkpoint(Path(folder) / "toy")
            argv = ["--model", model, "--max-running", str(args.streams), *args.server_flags]
            runs = [one_stop(args, argv) for _ in range(args.runs)]
    finally:
        for loop in busy:
            loop.kill()
    report(args, runs)
    return 0


def make_toy_checkpoint(folder: Path) -> str:
    command = [sys.executable, "-m", "front.toy_checkpoint", str(folder)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return str(folder)


def report(args: argparse.Namespace, runs: list[dict[str, float]]) -> None:
    load = f"{args.busy} busy loops beside it" if args.busy else "no load of its own"
    print(f"{args.step}, {args.streams} streams open, {load}, {args.runs} runs")
    print("seconds from SIGINT to          median    min    max")
    for what in runs[0]:  # in the order they came
        seconds = sorted(run[what] for run in runs if what in run)
        print(
            f"  {what[:28]:<28} {statistics.median(seconds):7.2f} {seconds[0]:6.2f} "
            f"{seconds[-1]:6.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
