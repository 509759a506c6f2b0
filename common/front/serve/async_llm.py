"""AsyncLLM: one engine, many clients, for as long as the process lives (vLLM's ``AsyncLLM``).

Every other front end builds an engine, serves one batch and drops it: the prefix cache starts
cold each time. A server keeps one engine, so a system prompt or a conversation's history
computed for one request is adopted by every later one.

The engine is not thread-safe and its rounds are blocking model calls, so it gets a thread of
its own, and everything else talks to that thread through a queue of calls:

- the **engine thread** runs ``step()`` while there is work and sleeps on the queue while
  there is none; between two rounds it runs the calls that came in (add a request, abort one,
  reset the cache). The engine is only ever touched from this thread, so nothing needs a lock,
  and none is held across a model call;
- **coroutines** (one per HTTP request, on the event loop) queue calls and await their
  results: ``add_request`` hands back a ``RequestStream``, an async iterator of that request's
  ``RequestOutput``s, and ``abort`` queues the abort and returns at once, so a client that goes
  away is dropped before the next round;
- after each round the engine thread hands the round's outputs to the event loop in one
  callback (``loop.call_soon_threadsafe``), which files each under its stream.

Both threads share Python's GIL: the event loop runs while torch's kernels run without it,
and whenever the engine thread's Python code gives it up (every 5 ms at most). vLLM runs its
engine core in another process, partly for that reason; docs/serving.md measures what sharing
costs here (a disconnect reaches the engine one round later, two at worst).

If ``step()`` raises, the engine is left as the exception found it, so it is not trusted again:
every request in flight gets the error, and later calls get ``EngineDeadError`` (vLLM's name).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...sampling import RequestOutput, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine's ``step()`` raised: nothing more is served (restart the server)."""


@dataclass
class RequestTimes:
    """When a request arrived and when its tokens reached the event loop (vLLM's
    ``RequestStateStats``): what a client waits for, so measured where the client is served."""

    arrival: float
    first_token: float | None = None
    previous_token: float | None = None  # when the token before the last came
    last_token: float | None = None


class RequestStream:
    """One request's outputs, as an async iterator that ends after the last one (``finished``).

    Outputs that come while nobody reads are merged into one (their new tokens joined): a slow
    reader gets fewer, larger pieces and the stream never grows (vLLM's
    ``RequestOutputCollector`` does the same).
    """

    def __init__(self, arrival: float) -> None:
        self.request_id: int | None = None  # the engine's id, once the engine thread added it
        self.times = RequestTimes(arrival)
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    def put(self, output: RequestOutput, now: float) -> None:
        """Called on the event loop with each of the request's outputs, in order."""
        if self._pending is not None:
            joined = self._pending.new_token_ids + output.new_token_ids
            output = replace(output, new_token_ids=joined)
        self._pending = output
        if output.new_token_ids:
            times = self.times
            times.first_token = times.first_token or now
            times.previous_token, times.last_token = times.last_token, now
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        output, self._pending = self._pending, None
        assert output is not None
        self._done = output.finished
        return output


# What a round hands to the event loop: each output with its stream, and the engine's figures.
Delivered = list[tuple[RequestStream, RequestOutput]]
OnRound = Callable[[Any, Delivered, float], None]  # (EngineStats, delivered, now)


class AsyncLLM:
    """An engine of any step, served from its own thread to any number of coroutines.

    ``start()`` on the event loop, then ``add_request`` / ``abort`` / ``call`` from any
    coroutine, and ``shutdown()`` at the end. ``on_round(stats, delivered, now)`` is called on
    the event loop after each round (the server's metrics), with the engine's ``EngineStats``
    after the round.
    """

    def __init__(self, engine: Any, on_round: OnRound | None = None) -> None:
        self.engine = engine
        self.dead: BaseException | None = None
        self._on_round = on_round
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # in flight; the engine thread's alone
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start the engine thread; from a coroutine, since outputs go to the running loop."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    # ---- from the event loop ----------------------------------------------------------------

    async def add_request(
        self, prompt_ids: list[int], sampling_params: SamplingParams, eos_token_id: object = None
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine took it. The engine's checks
        run in its thread and their ``RequestError`` is raised here, the engine untouched."""
        stream = RequestStream(time.perf_counter())

        def add() -> None:
            stream.request_id = self.engine.add_request(
                prompt_ids, None, eos_token_id, sampling_params=sampling_params
            )
            self._streams[stream.request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            self.abort(stream)  # queued after the add: it finds the request, if it was added
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Cancel the request at the next pause between rounds; returns at once. Its stream
        ends with a ``finish_reason="abort"`` output. A finished request is left alone."""
        self._calls.put(lambda: self._abort(stream))

    def abort_all(self) -> None:
        """Cancel every request in flight (``shutdown`` and a server's stop signal); safe to
        call from a signal handler (``SimpleQueue.put`` is reentrant)."""
        self._calls.put(lambda: [self._abort(stream) for stream in list(self._streams.values())])

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the engine thread between two rounds; its result, or its exception,
        here. For what must see the engine at rest between rounds (``reset_prefix_cache``)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def job() -> None:
            try:
                if self.dead is not None:  # it failed while this call waited in the queue
                    raise EngineDeadError(f"the engine failed earlier: {self.dead!r}")
                result = fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._calls.put(job)
        return await future

    async def shutdown(self) -> list[str]:
        """Abort what is in flight, let the engine report it, stop the thread. Returns what
        is wrong with the pool then (``ref_count_problems``: empty when every block is back,
        free or cached)."""
        self.abort_all()
        self._calls.put(self._stop)
        await asyncio.to_thread(self._thread.join)
        if self.dead is not None:
            return [f"the engine failed: {self.dead!r}"]
        return self.engine.ref_count_problems()

    # ---- on the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        """Rounds while there is work; between rounds, the queued calls; asleep when idle."""
        with torch.inference_mode():  # grad mode is per thread: this one needs its own
            while True:
                busy = self.dead is None and self.engine.has_work
                if self._stopping and not busy:
                    return
                self._run_calls(wait=not busy and not self._stopping)
                if self.dead is None and self.engine.has_work:
                    self._round()

    def _run_calls(self, wait: bool) -> None:
        """Every queued call; with ``wait``, sleep until the first one comes."""
        try:
            job = self._calls.get(block=wait)
            while True:
                try:
                    job()
                except Exception as exc:  # an abort that broke the engine: a bug, not input
                    self._fail_everyone(exc)
                job = self._calls.get_nowait()
        except queue.Empty:
            return

    def _round(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_everyone(exc)
            return
        delivered = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # a request added by someone else (a test driving the engine too)
            if output.finished:
                del self._streams[output.request_id]
            delivered.append((stream, output))
        self._hand_over(delivered, self.engine.stats)

    def _hand_over(self, delivered: Delivered, stats: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, delivered, stats)

    def _abort(self, stream: RequestStream) -> None:
        if self.dead is None and self._streams.get(stream.request_id) is stream:
            self.engine.abort(stream.request_id)  # the next step() reports it, "abort"

    def _fail_everyone(self, exc: Exception) -> None:
        """The engine raised (in ``step()``, or in an abort): every stream in flight ends with
        the error, and no call runs again."""
        self.dead = exc
        failed = list(self._streams.values())
        self._streams.clear()
        error = EngineDeadError(f"the engine failed: {exc!r}")
        error.__cause__ = exc
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_fail_streams, failed, error)

    def _stop(self) -> None:
        self._stopping = True

    # ---- back on the event loop -------------------------------------------------------------

    def _deliver(self, delivered: Delivered, stats: Any) -> None:
        now = time.perf_counter()
        for stream, output in delivered:
            stream.put(output, now)
        if self._on_round is not None:
            self._on_round(stats, delivered, now)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _fail_streams(streams: list[RequestStream], error: BaseException) -> None:
    for stream in streams:
        stream.fail(error)
