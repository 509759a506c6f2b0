"""EngineCore: the loop that owns one engine and runs its rounds (vLLM's ``EngineCore``), and
the two places it can run: a thread of the server's process, or a process of its own.

The loop is the same in both. It runs ``step()`` while there is work; between two rounds it
takes the messages that came in (add a request, abort one, a call such as
``reset_prefix_cache``), and after each round it sends the round's outputs out, each under the
key its request was added with. Nothing else ever touches the engine, so no lock is needed,
and none is held across a model call.

- ``ThreadCore``: a thread; messages go through a ``queue.SimpleQueue``. The engine thread and
  the server's event loop share Python's GIL: every burst of Python on the event loop (an
  HTTP request parsed, a round's events written) holds a round up. With 16 streams at once
  the server then gave 64-69% of the in-process throughput (docs/benchmarks.md, "step14_7
  over HTTP").
- ``ProcessCore``: a process of its own (vLLM's ``EngineCoreProc``, its default): messages
  are pickled through two ``multiprocessing`` pipes, and the event loop runs beside the
  rounds on another core: 74-83% there. The server uses it.

Requests are checked (``check_request``, the core's own rules) before they are sent, by the
caller, so that a bad one is refused at once, and an add never fails in the loop: the loop
queues the checked ``Request`` as it is (the engine's ``add_checked_request``), without reading
its every token again (31 ms for a prompt of 99,800 tokens, a round's time held up).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from common.errors import UserError, one_line
from common.inputs import Request
from common.kv_offload import flush_second_tiers
from common.sampling_params import RequestOutput

# The longest a stop waits for the engine's process to end once it said Stopped: it has only
# its exit left (``run_process``), and is killed if it has not made it by then.
JOIN_S = 1.0

# ---- the messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    key: int  # the caller's name for the request; outputs come back under it
    request: Request  # what ``check_request`` made of it: checked, not checked again


@dataclass(frozen=True)
class Abort:
    key: int | None  # None: every request in flight


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str  # an engine method without arguments: reset_prefix_cache, ref_count_problems


@dataclass(frozen=True)
class Stop:
    """Finish reporting what was aborted, then end the loop."""


@dataclass(frozen=True)
class RoundOutputs:
    outputs: list[tuple[int, RequestOutput]]  # (key, output)
    stats: Any  # EngineStats after the round


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any


@dataclass(frozen=True)
class Ready:
    """The engine is built: requests may come."""


@dataclass(frozen=True)
class Dead:
    """The engine raised: nothing more is served. ``reason``: the exception, as text."""

    reason: str


@dataclass(frozen=True)
class Stopped:
    """The loop ended (after ``Stop``): what was wrong with the pool then (empty: every block
    free, or cached alone)."""

    problems: list[str]


Receive = Callable[[bool], Any]  # (block) -> the next message, or None when none came
Send = Callable[[Any], None]


# ---- the loop --------------------------------------------------------------------------------


class EngineCore:
    """An engine and the requests in flight in it, driven by messages."""

    def __init__(self, engine: Any, publisher: Any = None) -> None:
        self.engine = engine
        # Where the engine's KV cache events go after each round (``kv_events.py``); None: the
        # engine records none.
        self.publisher = publisher
        self.keys: dict[int, int] = {}  # engine request id -> the caller's key, in flight
        self.ids: dict[int, int] = {}  # key -> engine request id
        self.stopping = False

    def run(self, receive: Receive, send: Send) -> None:
        """Rounds while there is work; between rounds, the messages; asleep when idle; until
        ``Stop`` and no work is left. If the engine raises, ``Dead`` is sent, and only calls
        are answered (None) until ``Stop``."""
        send(Ready())
        with torch.inference_mode():  # grad mode is per thread: this one needs its own
            try:
                while not (self.stopping and not self.engine.has_work):
                    self.take_messages(receive, send, wait=not self.engine.has_work)
                    if self.engine.has_work:
                        send(self.round())
                problems = self.engine.ref_count_problems()
            except PipeClosed:
                raise  # the server is gone: not the engine's failure, and nobody to tell
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                send(Dead(reason))
                self.stay_dead(receive, send)
                problems = [f"the engine failed: {reason}"]
            finally:
                if self.publisher is not None:
                    self.publisher.shutdown()
                flush_second_tiers()  # step14_10: what is on its way reaches the disk or Redis
        send(Stopped(problems))

    def take_messages(self, receive: Receive, send: Send, wait: bool) -> None:
        """Every message that came in; with ``wait``, sleep until the first one comes."""
        message = receive(wait and not self.stopping)
        while message is not None:
            self.handle(message, send)
            message = receive(False)
        self.publish_events()  # an abort or a reset may have changed the cache

    def handle(self, message: Any, send: Send) -> None:
        if isinstance(message, AddRequest):
            request_id = self.engine.add_checked_request(message.request)
            self.keys[request_id], self.ids[message.key] = message.key, request_id
        elif isinstance(message, Abort):
            keys = list(self.ids) if message.key is None else [message.key]
            for key in (k for k in keys if k in self.ids):
                self.engine.abort(self.ids.pop(key))  # the next step() reports it: "abort"
        elif isinstance(message, Call):
            send(Reply(message.call_id, getattr(self.engine, message.method)()))
        elif isinstance(message, Stop):
            self.stopping = True

    def publish_events(self) -> None:
        """The KV cache events since the last call, as one batch, to the publisher (vLLM's
        scheduler hands its engine core each round's events the same way)."""
        if self.publisher is not None:
            events = self.engine.take_events()
            if events:
                self.publisher.publish(events)

    def round(self) -> RoundOutputs:
        outputs = []
        step_outputs = self.engine.step()
        self.publish_events()  # before the outputs: a client that sees them, the events are out
        for output in step_outputs:
            key = self.keys.get(output.request_id)
            if key is None:
                continue
            if output.finished:
                del self.keys[output.request_id]
                self.ids.pop(key, None)
            outputs.append((key, output))
        return RoundOutputs(outputs, self.engine.stats)

    def stay_dead(self, receive: Receive, send: Send) -> None:
        """After a failure: no round runs; a call is answered None, until ``Stop``."""
        while not isinstance(message := receive(True), Stop):
            if isinstance(message, Call):
                send(Reply(message.call_id, None))


# ---- where it runs ---------------------------------------------------------------------------


def queue_receiver(inbox: queue.SimpleQueue) -> Receive:
    """``receive`` from a queue of this process."""

    def receive(block: bool) -> Any:
        try:
            return inbox.get(block)
        except queue.Empty:
            return None

    return receive


class PipeClosed(Exception):
    """The other end of a pipe is gone (its process ended, or closed it): nobody is left to
    talk to."""


def pipe_receiver(pipe: Connection, alive: Callable[[], bool]) -> Receive:
    """``receive`` from a pipe; a blocking wait wakes every second to ask whether the other
    end is still ``alive``. A pipe closed at the other end, or a dead sender, raises
    ``PipeClosed``."""

    def receive(block: bool) -> Any:
        while True:
            try:
                if pipe.poll(1.0 if block else 0):
                    return pipe.recv()
            except (EOFError, OSError):
                raise PipeClosed from None
            if not block:
                return None
            if not alive():
                raise PipeClosed

    return receive


class ThreadCore:
    """The loop on a thread of this process; ``send(message)`` to it, ``on_message`` called on
    the core's thread with each message out. ``make_engine()`` (and ``make_publisher()``, the
    KV events' publisher, when given) build the engine at ``start``, on the caller's thread (an
    error there is raised as it is)."""

    def __init__(
        self,
        make_engine: Callable[[], Any],
        on_message: Send,
        make_publisher: Callable[[], Any] | None = None,
    ) -> None:
        self.make_engine = make_engine
        self.make_publisher = make_publisher
        self.on_message = on_message
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        engine = self.make_engine()
        publisher = self.make_publisher() if self.make_publisher is not None else None
        core = EngineCore(engine, publisher)
        receive = queue_receiver(self.inbox)
        self.thread = threading.Thread(
            target=core.run, args=(receive, self.on_message), name="engine", daemon=True
        )
        self.thread.start()

    def send(self, message: Any) -> None:
        self.inbox.put(message)  # reentrant: safe from a signal handler

    def kill(self) -> None:
        """Nothing to end: an engine being built on a thread finishes, and is dropped."""

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class ProcessCore:
    """The loop in a process of its own, started with ``spawn`` (a fresh interpreter: no
    thread of this one is copied into it). ``make_engine()`` builds the engine there: a
    module-level function, or a picklable object. Messages are pickled through two pipes,
    one each way; ``on_message`` is called on a reader thread of this process with each one
    that comes out, and with ``Dead`` if the process ends without saying ``Stopped``.
    ``make_publisher()``, when given, builds the KV events' publisher there too (vLLM publishes
    from its engine core process)."""

    def __init__(
        self,
        make_engine: Callable[[], Any],
        on_message: Send,
        make_publisher: Callable[[], Any] | None = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._to_core, core_in = _pipe(context)
        core_out, self._from_core = _pipe(context)
        self.process = context.Process(
            target=run_process,
            args=(make_engine, core_in, core_out, make_publisher),
            name="engine-core",
        )
        self._child_ends = (core_in, core_out)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the writer thread sends
        self.receive = pipe_receiver(self._from_core, self.process.is_alive)
        self.on_message = on_message
        self.threads = [
            threading.Thread(target=self._write, name="engine-core-writer", daemon=True),
            threading.Thread(target=self._read, name="engine-core-reader", daemon=True),
        ]

    def start(self) -> None:
        """Start the process and wait until its engine is built; ``EngineStartError`` with
        the reason when it could not be."""
        start_deaf(self.process)
        for end in self._child_ends:
            end.close()  # the child holds them now: its death closes the pipes
        try:
            first = self.receive(True)
        except PipeClosed:
            first = None
        if not isinstance(first, Ready):
            self.process.join()
            reason = first.reason if isinstance(first, Dead) else "it ended"
            raise EngineStartError(f"the engine process could not start: {reason}")
        for thread in self.threads:
            thread.start()

    def send(self, message: Any) -> None:
        """Returns at once (the writer thread waits, if the pipe is full): from the event
        loop, or a signal handler (``SimpleQueue.put`` is reentrant)."""
        self._outbox.put(message)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._to_core.send(message)
            except OSError:  # the process is gone: the reader says so
                return
            if isinstance(message, Stop):
                return

    def _read(self) -> None:
        """Every message out, handed on, until ``Stopped``; ``Dead`` then ``Stopped`` if the
        process ends without it (killed, out of memory)."""
        try:
            while True:
                message = self.receive(True)
                self.on_message(message)
                if isinstance(message, Stopped):
                    return
        except PipeClosed:
            pass
        self.on_message(Dead(f"the engine process ended (exit code {self.process.exitcode})"))
        self.on_message(Stopped(["the engine process ended"]))

    def kill(self) -> None:
        """End the process at once (a start given up: its engine is being built; or a stop
        that it has not finished in time)."""
        if self.process.is_alive():
            self.process.kill()

    def join(self) -> None:
        """After ``Stopped``: the process ends by itself at once, or is killed (``JOIN_S``)."""
        self.process.join(JOIN_S)
        self.kill()
        self.process.join()
        for thread in self.threads:
            thread.join()


def start_deaf(process: multiprocessing.process.BaseProcess) -> None:
    """Start ``process`` with Ctrl-C and SIGTERM blocked, until it ignores them itself
    (``run_process``). A terminal's Ctrl-C reaches every process of its group, the engine's
    too: raised there while Python starts and torch is imported, it would end that process in
    a traceback (or an abort) beside the server's one line. A process inherits the mask of the
    thread that starts it; multiprocessing's resource tracker, which the first process a
    program starts brings up, unblocks both after its own start, so it is brought up first."""
    if not hasattr(signal, "pthread_sigmask"):  # no signal masks (Windows)
        process.start()
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _pipe(context: Any) -> tuple[Connection, Connection]:
    """A one-way pipe: (the end that sends, the end that receives)."""
    receiving, sending = context.Pipe(duplex=False)
    return sending, receiving


class EngineStartError(UserError):
    """The engine process could not build its engine (a checkpoint, the memory): one line."""


def run_process(
    make_engine: Callable[[], Any],
    inbox: Connection,
    outbox: Connection,
    make_publisher: Callable[[], Any] | None = None,
) -> None:
    """The engine process. Ctrl-C and SIGTERM are the server's to handle: it aborts what is
    in flight and sends ``Stop`` (here they are ignored; blocked until now, ``start_deaf``). A
    server that dies without one (killed) closes its ends of the pipes: this process then ends
    at once, at the next message it reads or sends (a second at most while idle), with what it
    held; no orphan is left running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = make_engine()
        publisher = make_publisher() if make_publisher is not None else None
    except Exception as exc:
        outbox.send(Dead(one_line(exc)))
        return
    parent = multiprocessing.parent_process()
    alive = parent.is_alive if parent is not None else (lambda: True)

    def send(message: Any) -> None:
        try:
            outbox.send(message)
        except OSError:  # BrokenPipeError: the server is gone
            raise PipeClosed from None

    with contextlib.suppress(PipeClosed):
        EngineCore(engine, publisher).run(pipe_receiver(inbox, alive), send)
    # Nothing is left to do or say: the process ends here, without Python's own end, which
    # with torch loaded took seconds on a busy machine, while the server waited for it.
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
