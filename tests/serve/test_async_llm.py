"""``AsyncLLM``: one engine of each step on its own thread, driven from coroutines
(``common/front/serve/async_llm.py``), without HTTP.

- requests added from several coroutines stream the engine's own tokens;
- ``abort`` from a coroutine ends the stream with ``finish_reason="abort"``; a request whose
  coroutine is cancelled before the engine took it is dropped too; the pool is clean after;
- no lock is held across a model call: while a round runs, ``abort`` returns at once and the
  event loop goes on;
- ``step()`` raising fails every request in flight and every later call (nothing hangs);
- ``shutdown()`` aborts what is in flight and finds every block back in the pool.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("fastapi")  # the serve extra: this is its engine front

from common.front.serve.async_llm import AsyncLLM, EngineDeadError, RequestStream
from common.sampling import RequestOutput, SamplingParams
from tests.helpers import EngineFactory, tokens

PROMPTS = [tokens(1, 13), tokens(2, 9), tokens(1, 13)[:8] + tokens(3, 6)]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(len(PROMPTS))]
LONG = SamplingParams(max_tokens=200, seed=9)  # runs until it is aborted, in every test here


def run(
    engine: Any, body: Callable[[AsyncLLM], Coroutine[Any, Any, Any]], fails: bool = False
) -> Any:
    """``body(llm)`` on an event loop, with ``engine`` behind an ``AsyncLLM`` that is shut
    down at the end: every block must be back then (unless the engine ``fails``)."""

    async def main() -> Any:
        llm = AsyncLLM(engine)
        llm.start()
        try:
            result = await body(llm)
        finally:
            problems = await llm.shutdown()
        assert bool(problems) == fails, problems
        return result

    return asyncio.run(main())


async def outputs(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


def test_requests_from_several_coroutines_stream_the_engines_tokens(
    make_engine: EngineFactory,
) -> None:
    expected = make_engine().generate(PROMPTS, sampling_params=PARAMS)

    async def body(llm: AsyncLLM) -> list[list[RequestOutput]]:
        streams = await asyncio.gather(*(llm.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)))
        return await asyncio.gather(*(outputs(stream) for stream in streams))

    got = run(make_engine(), body)
    assert [out[-1].token_ids for out in got] == expected
    assert all(out[-1].finished and out[-1].finish_reason == "length" for out in got)
    assert all(not o.finished for out in got for o in out[:-1])


def test_abort_from_a_coroutine_ends_the_stream(make_engine: EngineFactory) -> None:
    async def body(llm: AsyncLLM) -> list[RequestOutput]:
        stream = await llm.add_request(PROMPTS[0], LONG)
        first = await anext(stream)
        llm.abort(stream)
        return [first] + await outputs(stream)

    got = run(make_engine(), body)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert len(got[-1].token_ids) < LONG.max_tokens


def test_a_request_cancelled_before_the_engine_took_it_is_dropped(
    make_engine: EngineFactory,
) -> None:
    """The engine thread is held between rounds (by a call that waits), the coroutine adding
    a request is cancelled meanwhile: once the thread goes on, the request is added and
    aborted before any round computes a token of it."""
    engine = make_engine()
    hold = threading.Event()

    async def body(llm: AsyncLLM) -> None:
        held = asyncio.ensure_future(llm.call(hold.wait))
        adding = asyncio.ensure_future(llm.add_request(PROMPTS[0], LONG))
        await asyncio.sleep(0.05)
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding  # cancelled: it queued the abort behind the add
        hold.set()
        await held
        await llm.call(lambda: None)  # the abort was queued before this: it ran
        while await llm.call(lambda: engine.has_work):
            await asyncio.sleep(0.01)

    run(engine, body)
    assert engine.stats.computed_tokens == 0


def test_no_lock_is_held_across_a_model_call(make_engine: EngineFactory) -> None:
    """A round blocked in the middle of its model call: ``abort`` returns, the event loop
    runs other coroutines, and once the round ends the abort is served."""
    engine = make_engine()
    in_round, release = threading.Event(), threading.Event()
    real_step = engine.step

    def slow_step() -> list[RequestOutput]:
        in_round.set()
        release.wait()
        return real_step()

    engine.step = slow_step

    async def body(llm: AsyncLLM) -> list[RequestOutput]:
        stream = await llm.add_request(PROMPTS[0], LONG)
        await asyncio.to_thread(in_round.wait)
        llm.abort(stream)  # returns although a round runs
        await asyncio.sleep(0.01)  # and the loop runs: this coroutine goes on
        release.set()
        return await outputs(stream)

    got = run(engine, body)
    assert got[-1].finish_reason == "abort"


def test_when_step_raises_every_request_fails_and_nothing_hangs(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    real_step, rounds = engine.step, [0]

    def failing_step() -> list[RequestOutput]:
        rounds[0] += 1
        if rounds[0] == 3:
            raise RuntimeError("the model failed")
        return real_step()

    engine.step = failing_step

    async def body(llm: AsyncLLM) -> None:
        streams = [await llm.add_request(p, LONG) for p in PROMPTS]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="the model failed"):
                await outputs(stream)
        with pytest.raises(EngineDeadError):
            await llm.add_request(PROMPTS[0], LONG)
        assert isinstance(llm.dead, RuntimeError)

    run(engine, body, fails=True)


def test_shutdown_aborts_what_is_in_flight_and_every_block_comes_back(
    make_engine: EngineFactory,
) -> None:
    async def body() -> tuple[list[str], list[RequestOutput]]:
        llm = AsyncLLM(make_engine())
        llm.start()
        stream = await llm.add_request(PROMPTS[0], LONG)
        await anext(stream)
        problems = await llm.shutdown()
        return problems, await outputs(stream)

    problems, rest = asyncio.run(body())
    assert problems == []
    assert rest[-1].finish_reason == "abort"
