"""AsyncLLM: one engine, many clients, for as long as the process lives (vLLM's ``AsyncLLM``).

Every other front end builds an engine, serves one batch and drops it: the prefix cache starts
cold each time. A server keeps one engine, so a system prompt or a conversation's history
computed for one request is adopted by every later one.

The engine runs in an ``EngineCore`` loop (``engine_core.py``): in a process of its own (what
the server uses by default) or on a thread of this one (``in_thread``). Either way this side
only sends messages and reads what comes back:

- ``add_request`` (from any coroutine) checks the request with the core's own rules, so that a
  bad one is refused at once and the engine is left untouched, sends it, and hands back a
  ``RequestStream``: an async iterator of that request's ``RequestOutput``s. The checked
  request (``common.inputs.Request``) is what is sent, and the engine core queues it as it is
  (``add_checked_request``): it is checked once. A server checks on its tokenizer's thread
  (``check``), then sends (``add_checked``);
- ``abort`` sends the abort and returns at once: a client that goes away is dropped at the next
  pause between rounds, and its stream ends with ``finish_reason="abort"``;
- each round's outputs come back in one message, filed on the event loop under their streams;
  ``on_round`` sees them too (the server's metrics);
- if the engine raises, every request in flight gets ``EngineDeadError`` (vLLM's name), and so
  does every later call: the engine is left as the exception found it, and is not trusted again.

``build_async_engine_client`` (vLLM's name) owns its life, the one way to run it: it starts the
core, yields the client, and at the end aborts what is in flight, waits for the core to stop and
keeps what the engine found wrong with its pool (``pool_problems``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from common.config import ModelConfig
from common.inputs import Request, check_request
from common.sampling_params import RequestOutput, SamplingParams

from .engine_core import (
    Abort,
    AddRequest,
    Call,
    Dead,
    ProcessCore,
    Reply,
    RoundOutputs,
    Stop,
    Stopped,
    ThreadCore,
)


class EngineDeadError(RuntimeError):
    """The engine raised: nothing more is served (restart the server)."""


@dataclass
class RequestStateStats:
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

    def __init__(self, key: int, arrival: float) -> None:
        self.key = key  # the request's name between this side and the engine core
        self.times = RequestStateStats(arrival)
        # Why this side ended it, when it did (``abort``): decided once, by the first abort.
        self.ended_by: str | None = None
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    def put(self, output: RequestOutput, now: float) -> None:
        """Called on the event loop with each of the request's outputs, in order."""
        if self._pending is not None:
            output = self._pending.add(output)  # tokens and logprobs joined
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


# What a round hands to the event loop: each output with its stream.
Delivered = list[tuple[RequestStream, RequestOutput]]
OnRound = Callable[[Any, Delivered, float], None]  # (EngineStats, delivered, now)


class AsyncLLM:
    """An engine of any step, run by an ``EngineCore``, served to any number of coroutines:
    ``add_request`` / ``abort`` / ``call`` from any coroutine, between the start and the stop
    that ``build_async_engine_client`` makes.

    ``make_engine()`` builds the engine where it runs (picklable, for a process of its own);
    ``cfg`` is its model config, what requests are checked against; ``in_thread`` runs the
    core on a thread of this process instead (``ThreadCore``); ``make_publisher()``, when
    given, builds the publisher of the engine's KV cache events there too (``kv_events.py``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        make_engine: Callable[[], Any],
        in_thread: bool = False,
        on_round: OnRound | None = None,
        make_publisher: Callable[[], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        core_class = ThreadCore if in_thread else ProcessCore
        self.core = core_class(make_engine, self._from_core, make_publisher)
        self.dead: str | None = None  # why the engine failed
        self.pool_problems: list[str] | None = None  # what the stop found (empty: none)
        self._on_round = on_round
        self._streams: dict[int, RequestStream] = {}  # in flight, by key
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future | None = None  # the core's last word: its pool's problems

    async def start(self) -> None:
        """Outputs go to the running loop from now on. The core builds its engine, and this
        waits for it (``EngineStartError`` when it cannot), on a thread, so that the loop
        still hears Ctrl-C: cancelled meanwhile, the engine's process is ended."""
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()  # a dead process says it before shutdown
        try:
            await asyncio.to_thread(self.core.start)
        except asyncio.CancelledError:
            self.core.kill()
            raise

    # ---- from the event loop ----------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], sampling_params: SamplingParams, eos_token_ids: Any = None
    ) -> RequestStream:
        """Check the request (``RequestError`` naming the field, the engine untouched), send
        it, and return its stream."""
        self._check_alive()
        return self.add_checked(self.check(prompt_ids, sampling_params, eos_token_ids))

    def check(
        self, prompt_ids: list[int], sampling_params: SamplingParams, eos_token_ids: Any = None
    ) -> Request:
        """The core's own checks of a request (``RequestError`` naming the field). They read
        every prompt token, so a server runs them on its worker thread: they touch nothing."""
        return check_request(prompt_ids, None, eos_token_ids, self.cfg, sampling_params)

    def add_checked(self, request: Request) -> RequestStream:
        """Send a request that ``check`` passed (the engine core queues it unchecked), and
        return its stream."""
        self._check_alive()
        stream = RequestStream(next(self._ids), time.perf_counter())
        self._streams[stream.key] = stream
        self.core.send(AddRequest(stream.key, request))
        return stream

    def abort(self, stream: RequestStream, finish_reason: str = "abort") -> None:
        """Cancel the request at the next pause between rounds; returns at once. Its stream
        ends with a ``finish_reason="abort"`` output. A finished request is left alone.
        ``finish_reason="stop"``: it was ended by a stop string, which ``/metrics`` counts as
        such (vLLM ends such a request the same way: its detokenizer finds the string, and
        the request is aborted in the engine).

        What ended a request is decided once: the first abort. A later one (the answer's
        end, which aborts whatever is left of it, or a client that leaves meanwhile) finds
        the request already ending and changes nothing: a stop string stays the reason."""
        if stream.key in self._streams and self.dead is None and stream.ended_by is None:
            stream.ended_by = finish_reason
            self.core.send(Abort(stream.key))

    def abort_all(self) -> None:
        """Cancel every request in flight (a server's stop): safe from a signal handler."""
        self.core.send(Abort(None))

    async def call(self, method: str) -> Any:
        """``engine.<method>()`` (no arguments) run between two rounds; its result."""
        self._check_alive()
        assert self._loop is not None
        call_id = next(self._ids)
        self._calls[call_id] = future = self._loop.create_future()
        self.core.send(Call(call_id, method))
        return await future

    async def shutdown(self) -> list[str]:
        """Abort what is in flight, let the engine report it, stop the core. Returns what is
        wrong with the pool then (empty: every block is back, free or cached), and keeps it
        in ``pool_problems``."""
        assert self._stopped is not None
        self.abort_all()
        self.core.send(Stop())
        self.pool_problems = await self._stopped
        await asyncio.to_thread(self.core.join)
        return self.pool_problems

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead}")

    # ---- what comes back --------------------------------------------------------------------

    def _from_core(self, message: Any) -> None:
        """On the core's thread (or the reader of its process): on to the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: Any) -> None:
        if isinstance(message, RoundOutputs):
            self._deliver(message)
        elif isinstance(message, Reply):
            _settle(self._calls.pop(message.call_id), message.value)
        elif isinstance(message, Dead):
            self._fail_everyone(message.reason)
        elif isinstance(message, Stopped):
            assert self._stopped is not None
            _settle(self._stopped, message.problems)

    def _deliver(self, message: RoundOutputs) -> None:
        now, delivered = time.perf_counter(), []
        for key, output in message.outputs:
            stream = self._streams[key]
            if output.finished:
                del self._streams[key]
            stream.put(output, now)
            delivered.append((stream, output))
        if self._on_round is not None:
            self._on_round(message.stats, delivered, now)

    def _fail_everyone(self, reason: str) -> None:
        """Every stream in flight and every call waiting ends with the engine's failure."""
        self.dead = reason
        for stream in self._streams.values():
            stream.fail(EngineDeadError(f"the engine failed: {reason}"))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine failed: {reason}"))
        self._streams.clear()
        self._calls.clear()


def _settle(future: asyncio.Future, value: Any) -> None:
    if not future.done():  # its caller was cancelled meanwhile
        future.set_result(value)


@asynccontextmanager
async def build_async_engine_client(
    cfg: ModelConfig,
    make_engine: Callable[[], Any],
    in_thread: bool = False,
    on_round: OnRound | None = None,
    make_publisher: Callable[[], Any] | None = None,
) -> AsyncIterator[AsyncLLM]:
    """The engine's whole life, the one way to run an ``AsyncLLM`` (vLLM's
    ``build_async_engine_client``): its core started (the engine built, in a process of its
    own unless ``in_thread``), the client yielded, and on the way out, however the block
    ends, what is in flight aborted and the core stopped. ``client.pool_problems`` then says
    what the engine found wrong with its pool (empty: every block is back)."""
    client = AsyncLLM(cfg, make_engine, in_thread, on_round, make_publisher)
    await client.start()
    try:
        yield client
    finally:
        await client.shutdown()
