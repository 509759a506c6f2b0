"""``AsyncLLM`` (``front/serve/async_llm.py``) and its ``EngineCore``
(``engine_core.py``), without HTTP: every step's engine on a thread, and step14_7's in a
process of its own.

- requests added from several coroutines stream the engine's own tokens, in a thread and in a
  process alike;
- a bad request is refused at once, naming the field, and the engine never sees it;
- ``abort`` from a coroutine ends the stream with ``finish_reason="abort"``; a request aborted
  before its first round computes nothing; the first abort decides why a request ended (a
  stop string's "stop" stays, whatever aborts it after);
- no lock is held across a model call: while a round runs, ``abort`` returns at once and the
  event loop goes on;
- ``step()`` raising fails every request in flight and every later call (nothing hangs); so
  does an engine process that dies;
- the end of ``build_async_engine_client`` aborts what is in flight and finds every block
  back in the pool.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("fastapi")  # the serve extra: this is its engine front

from common.errors import RequestError
from common.sampling_params import RequestOutput, SamplingParams
from front.serve.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestStream,
    build_async_engine_client,
)
from front.serve.metrics import Metrics
from tests.helpers import STEP_NAMES, TINY, EngineFactory, tokens
from tests.serve.server_process import metric, tiny_engine

PROMPTS = [tokens(1, 13), tokens(2, 9), tokens(1, 13)[:8] + tokens(3, 6)]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(len(PROMPTS))]
LONG = SamplingParams(max_tokens=200, seed=9)  # runs until it is aborted, in every test here
Body = Callable[[AsyncLLM], Coroutine[Any, Any, Any]]


def run(
    make_engine: Callable[[], Any], body: Body, fails: bool = False, in_thread: bool = True
) -> Any:
    """``body(llm)`` on an event loop, the engine ``make_engine()`` builds served by
    ``build_async_engine_client``; every block must be back when it ends (unless the engine
    ``fails``)."""

    async def main() -> Any:
        async with build_async_engine_client(TINY, make_engine, in_thread) as llm:
            result = await body(llm)
        assert bool(llm.pool_problems) == fails, llm.pool_problems
        return result

    return asyncio.run(main())


async def outputs(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


async def serve_prompts(llm: AsyncLLM) -> list[list[RequestOutput]]:
    streams = [llm.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
    return await asyncio.gather(*(outputs(stream) for stream in streams))


def test_requests_from_several_coroutines_stream_the_engines_tokens(
    make_engine: EngineFactory,
) -> None:
    expected = make_engine().generate(PROMPTS, sampling_params=PARAMS)
    got = run(make_engine, serve_prompts)
    assert [out[-1].token_ids for out in got] == expected
    assert all(out[-1].finished and out[-1].finish_reason == "length" for out in got)
    assert all(not o.finished for out in got for o in out[:-1])


def test_an_engine_in_a_process_of_its_own_streams_the_same(make_engine: EngineFactory) -> None:
    """The process is started with ``spawn``: its engine is built there, from the step's name
    (step14_7's: one process start is enough to show the path)."""
    expected = make_engine().generate(PROMPTS, sampling_params=PARAMS)
    got = run(functools.partial(tiny_engine, STEP_NAMES[-1]), serve_prompts, in_thread=False)
    assert [out[-1].token_ids for out in got] == expected


def test_a_bad_request_is_refused_at_once_and_the_engine_never_sees_it(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()

    async def body(llm: AsyncLLM) -> None:
        with pytest.raises(RequestError) as refused:
            llm.add_request([TINY.vocab_size], LONG)
        assert refused.value.param == "prompt_ids"
        with pytest.raises(RequestError, match="empty"):
            llm.add_request([], LONG)

    run(lambda: engine, body)
    assert engine.stats.requests == 0


def test_abort_from_a_coroutine_ends_the_stream(make_engine: EngineFactory) -> None:
    async def body(llm: AsyncLLM) -> list[RequestOutput]:
        stream = llm.add_request(PROMPTS[0], LONG)
        first = await anext(stream)
        llm.abort(stream)
        return [first] + await outputs(stream)

    got = run(make_engine, body)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert len(got[-1].token_ids) < LONG.max_tokens


def test_what_ended_a_request_is_decided_once(make_engine: EngineFactory) -> None:
    """A request that a stop string ended (``abort(stream, "stop")``) and that is aborted again
    before the engine took the first abort (an answer's end aborts whatever is left of it; a
    client may leave): ``/metrics`` counts it as ended by "stop", once."""
    metrics = Metrics("toy", TINY.total_blocks)

    async def main() -> list[RequestOutput]:
        async with build_async_engine_client(TINY, make_engine, True, metrics.record) as llm:
            stream = llm.add_request(PROMPTS[0], LONG)
            first = await anext(stream)
            llm.abort(stream, finish_reason="stop")
            llm.abort(stream)
            assert stream.ended_by == "stop"
            return [first] + await outputs(stream)

    got = asyncio.run(main())
    assert got[-1].finished and len(got[-1].token_ids) < LONG.max_tokens
    page = metrics.render().decode()
    assert metric(page, "vllm:request_success_total", finished_reason="stop") == 1
    assert metric(page, "vllm:request_success_total", finished_reason="abort") == 0


def hold_rounds(engine: Any) -> tuple[threading.Event, threading.Event]:
    """Make every round of ``engine`` wait, in the middle (as in its model call), until
    ``release`` is set; ``in_round`` is set when one is waiting."""
    in_round, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step() -> list[RequestOutput]:
        in_round.set()
        release.wait()
        return real_step()

    engine.step = held_step
    return in_round, release


def test_no_lock_is_held_across_a_model_call(make_engine: EngineFactory) -> None:
    """A round blocked in the middle of its model call: ``add_request`` and ``abort`` return,
    the event loop runs other coroutines, and once the round ends both are served; the
    request aborted before its first round computes nothing (its prefill never starts)."""
    engine = make_engine()
    in_round, release = hold_rounds(engine)

    async def body(llm: AsyncLLM) -> tuple[list[RequestOutput], list[RequestOutput]]:
        running = llm.add_request(PROMPTS[0], LONG)
        await asyncio.to_thread(in_round.wait)
        late = llm.add_request(PROMPTS[1], LONG)  # returns although a round runs
        llm.abort(late)
        llm.abort(running)
        await asyncio.sleep(0.01)  # and the loop runs: this coroutine goes on
        release.set()
        return await outputs(running), await outputs(late)

    running, late = run(lambda: engine, body)
    assert running[-1].finish_reason == late[-1].finish_reason == "abort"
    assert late[-1].token_ids == [] and engine.stats.requests == 1


def fail_at_round(engine: Any, round_number: int) -> None:
    real_step, rounds = engine.step, [0]

    def failing_step() -> list[RequestOutput]:
        rounds[0] += 1
        if rounds[0] == round_number:
            raise RuntimeError("the model failed")
        return real_step()

    engine.step = failing_step


def test_when_step_raises_every_request_fails_and_nothing_hangs(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    fail_at_round(engine, 3)

    async def body(llm: AsyncLLM) -> None:
        streams = [llm.add_request(p, LONG) for p in PROMPTS]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="the model failed"):
                await outputs(stream)
        with pytest.raises(EngineDeadError):
            llm.add_request(PROMPTS[0], LONG)
        with pytest.raises(EngineDeadError):
            await llm.call("reset_prefix_cache")
        assert "the model failed" in llm.dead

    run(lambda: engine, body, fails=True)


@pytest.mark.parametrize("step_name", STEP_NAMES[-1:])
def test_an_engine_process_that_dies_fails_every_request(step_name: str) -> None:
    """The engine process is killed (out of memory, say) while requests run: their streams
    end with ``EngineDeadError``, and nothing hangs."""

    async def body(llm: AsyncLLM) -> None:
        streams = [llm.add_request(p, LONG) for p in PROMPTS]
        await anext(streams[0])
        os.kill(llm.core.process.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="engine process ended"):
                await outputs(stream)

    run(functools.partial(tiny_engine, step_name), body, fails=True, in_thread=False)


def test_the_end_of_the_client_aborts_what_is_in_flight_and_every_block_comes_back(
    make_engine: EngineFactory,
) -> None:
    async def body() -> tuple[list[str] | None, list[RequestOutput]]:
        async with build_async_engine_client(TINY, make_engine, in_thread=True) as llm:
            stream = llm.add_request(PROMPTS[0], LONG)
            await anext(stream)
        return llm.pool_problems, await outputs(stream)

    problems, rest = asyncio.run(body())
    assert problems == []
    assert rest[-1].finish_reason == "abort"
