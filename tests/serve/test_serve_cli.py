"""``python -m <step>.serve``: its command line, its start and its stop.

- a flag it cannot use is one ``error:`` line and exit 2, before anything loads; a port in
  use, a pool too small for the context or a missing package is one line and exit 1, before
  the weights load;
- by default it listens on 127.0.0.1 and names the model by its ``--model`` argument;
- Ctrl-C (SIGINT) or SIGTERM stops it, even with answers streaming: the answers end
  (``finish_reason`` "abort", then ``[DONE]``), every block is back in the pool, and the
  process ends by the signal, as a program the signal stopped does; one line says so as the
  stop begins (before the engine has stopped), one as it ends, both flushed down a pipe;
- a server killed outright (SIGKILL: no chance to stop anything) leaves no engine process
  behind, idle or busy: the engine's process sees its pipes close and ends within seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from common.errors import CheckpointError
from front.build import EngineBuilder
from front.serve import cli as serve_cli
from front.serve.launch import sampling_defaults
from front.serve.options import ServeOptions
from tests.helpers import STEP_NAMES, usage_error
from tests.serve.server_process import ENGINE, ENGINE_FLAGS, ServerProcess, is_running, sse_events

LAST = STEP_NAMES[-1]


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the server gets as far as reading the checkpoint."""
    from front.serve import launch

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was read before the checks")

    monkeypatch.setattr(launch, "load_served_model", refuse)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "--model"),
        (["--model", "/no/such/folder"], "not a checkpoint directory"),
        (["--model", "{ckpt}", "--port", "70000"], "--port"),
        (["--model", "{ckpt}", "--total-blocks", "0"], "--total-blocks"),
        (["--model", "{ckpt}", "--dtype", "float8"], "not a dtype"),
        (["--model", "{ckpt}", "--max-num-batched-tokens", "78"], "max_running - 1 = 79"),
    ],
)
def test_a_flag_it_cannot_use_is_one_line(
    argv: list[str], says: str, chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg.replace("{ckpt}", str(chat_checkpoint)) for arg in argv]
    line = usage_error(lambda a: serve_cli.main(LAST, a), argv, capsys)
    assert line.startswith(f"python -m {LAST}.serve: error:") and says in line


def test_an_earlier_steps_server_refuses_a_later_steps_flag(
    chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(chat_checkpoint), "--max-num-batched-tokens", "64"]
    line = usage_error(lambda a: serve_cli.main("step14_8", a), argv, capsys)
    assert line.startswith("python -m step14_8.serve: error:")
    assert "--max-num-batched-tokens needs step14_9 or later" in line


def one_line_failure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` must return 1 with one ``error:`` line and nothing else."""
    assert serve_cli.main(LAST, argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    return captured.err


def test_a_port_in_use_is_refused_before_the_model_loads(
    chat_checkpoint: Path, no_model_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        line = one_line_failure(["--model", str(chat_checkpoint), "--port", port], capsys)
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_a_pool_too_small_for_the_context_is_refused(
    chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's rule: a request as long as the context must fit in the pool (2048 tokens need
    512 blocks of 4)."""
    argv = ["--model", str(chat_checkpoint), "--port", "0", "--block-size", "4"]
    line = one_line_failure([*argv, "--total-blocks", "100"], capsys)
    assert "--total-blocks) to at least 512" in line and "lower --max-model-len" in line


def test_a_missing_package_is_one_line(
    chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve_cli, "PACKAGES", ("no_such_package_here",))
    line = one_line_failure(["--model", str(chat_checkpoint), "--port", "0"], capsys)
    assert "no_such_package_here" in line and "pip install -e '.[serve]'" in line


@pytest.mark.parametrize(
    ("config", "defaults"),
    [
        (None, {"temperature": 1.0}),
        ({"do_sample": True}, {"temperature": 1.0}),
        ({"temperature": 0.6, "top_p": 0.9}, {"temperature": 0.6, "top_p": 0.9}),
        ({"temperature": 0.7, "top_k": 20, "max_length": 50}, {"temperature": 0.7, "top_k": 20}),
    ],
)
def test_a_request_falls_back_on_the_generation_config(
    config: dict | None, defaults: dict, tmp_path: Path
) -> None:
    """vLLM's rule: the checkpoint's generation_config.json gives the sampling a request
    leaves out (the fields this engine has), else a temperature of 1.0."""
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(tmp_path) == defaults


def test_a_generation_config_it_cannot_use_is_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(CheckpointError, match="top_p"):
        sampling_defaults(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_a_signal_stops_it_with_a_line_as_it_begins_and_one_as_it_ends(
    step_name: str, sig: signal.Signals, chat_checkpoint: Path
) -> None:
    server = ServerProcess(step_name, chat_checkpoint, *ENGINE_FLAGS)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        names = [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]]
        assert names == [str(chat_checkpoint)]
        body = {"prompt": "The cat", "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as answer:
            events = sse_events(answer.iter_lines())
            next(events)
            server.process.send_signal(sig)
            rest = list(events)  # the stream ends, and [DONE] closes it
        status, err = server.wait()
    finally:
        server.kill()
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert status == -sig
    prog = f"python -m {step_name}.serve"
    assert err.splitlines() == [
        f"{prog}: stopping on {sig.name}; what is in flight is aborted",
        f"{prog}: stopped by {sig.name}; every block is back in the pool",
    ]


def test_a_stop_whose_reader_is_gone_still_ends_by_the_signal(chat_checkpoint: Path) -> None:
    """``python -m <step>.serve 2>&1 | tee log``: the same Ctrl-C ends tee at once, and the
    stop's lines find no reader. The stop goes on to its end all the same (the end by
    SIGINT), not a ``BrokenPipeError``'s status 1."""
    server = ServerProcess(LAST, chat_checkpoint, *ENGINE_FLAGS)
    try:
        server.process.stdout.close()  # type: ignore[union-attr]
        server.process.stderr.close()  # type: ignore[union-attr]
        server.process.send_signal(signal.SIGINT)
        status = server.process.wait(60)
    finally:
        server.kill()
    assert status == -signal.SIGINT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_killed_server_leaves_no_engine_process_behind(busy: bool, chat_checkpoint: Path) -> None:
    """Killed (SIGKILL: no stop of its own) while idle or streaming, the server's engine process
    ends within seconds, once it is serving (a server killed while its engine still builds is
    not this test's race: the engine ends only after the build)."""
    server = ServerProcess(LAST, chat_checkpoint, *ENGINE_FLAGS)
    engine_processes = [pid for pid in server.children() if is_engine(pid)]
    try:
        assert len(engine_processes) == 1, "the engine runs in a process of its own"
        if busy:
            body = {"prompt": "The cat", "max_tokens": 1500, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body) as answer:
                next(sse_events(answer.iter_lines()))
                server.process.kill()
        else:  # idle, with its engine built: one answer has come from it
            body = {"prompt": "The cat", "max_tokens": 1}
            assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
            server.process.kill()
        server.process.wait()
        deadline = time.monotonic() + 10
        while any(map(is_running, engine_processes)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(is_running, engine_processes)), "an engine outlived its server"
    finally:
        for pid in filter(is_running, engine_processes):  # so that a failure leaves none
            os.kill(pid, signal.SIGKILL)
        server.kill()


def is_engine(pid: int) -> bool:
    """Is ``pid`` a process that ``multiprocessing``'s spawn started (the engine's)? Not
    its resource tracker, nor a helper some library ran for a moment."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class KeepsBlocksOnAbort(EngineBuilder):
    """Builds an engine whose abort keeps the request's blocks: a stop must notice."""

    def __call__(self, model: object = None, **engine_args: object) -> object:
        engine = super().__call__(model, **engine_args)
        engine.kv_cache_manager.free = lambda seq: None
        return engine


def test_the_stop_reports_the_blocks_an_engine_did_not_give_back(
    chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server's own stop, in this process (an engine on a thread that leaks on abort):
    a stream runs, SIGINT stops the server, and the line names what the pool lacks."""
    from front.serve import launch

    options = ServeOptions(str(chat_checkpoint), "127.0.0.1", 0, None, None, ENGINE, True)
    served, builder = launch.load_served_model(LAST, options)
    leaky = KeepsBlocksOnAbort(builder.step_name, builder.source, builder.options)
    listener = launch.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"

    async def stream_then_stop() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "The cat", "max_tokens": 1500, "stream": True}
            async with client.stream("POST", url, json=body) as answer:
                lines = answer.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break
                os.kill(os.getpid(), signal.SIGINT)
                return [line async for line in lines if line]

    async def main() -> tuple[int | None, list[str]]:
        serving = asyncio.create_task(
            launch.run_server_worker(leaky, served, options, listener, "prog")
        )
        rest = await stream_then_stop()
        return await serving, rest

    stopped_by, rest = asyncio.run(main())
    assert stopped_by == signal.SIGINT and rest[-1] == "data: [DONE]"
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("prog: stopped by SIGINT; pool: [") and "every block" not in line


def test_the_stop_says_so_before_the_engine_has_stopped(
    chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stop's first line comes as the stop begins, not with the pool's at its end: here
    the engine's stop (its last pool check, on a thread of this process) waits until that
    line is out. Eight streams are open; each ends aborted."""
    from front.serve import launch

    let_go = threading.Event()

    class WaitsToStop(EngineBuilder):
        def __call__(self, model: object = None, **engine_args: object) -> object:
            engine = super().__call__(model, **engine_args)
            check = engine.ref_count_problems
            engine.ref_count_problems = lambda: let_go.wait(60) and check()
            return engine

    options = ServeOptions(str(chat_checkpoint), "127.0.0.1", 0, None, None, ENGINE, True)
    served, builder = launch.load_served_model(LAST, options)
    waits = WaitsToStop(builder.step_name, builder.source, builder.options)
    listener = launch.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"
    said: list[str] = []

    async def one_stream(client: httpx.AsyncClient, opened: asyncio.Event) -> list[str]:
        body = {"prompt": "The cat", "max_tokens": 1500, "stream": True}
        async with client.stream("POST", url, json=body) as answer:
            lines = answer.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            opened.set()
            return [line async for line in lines if line]

    async def streams_then_stop() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            opened = [asyncio.Event() for _ in range(8)]
            answers = [asyncio.create_task(one_stream(client, o)) for o in opened]
            for event in opened:
                await event.wait()
            os.kill(os.getpid(), signal.SIGINT)
            rests = await asyncio.gather(*answers)
        for _ in range(600):  # the stop's first line, while the engine waits to stop
            said.extend(capsys.readouterr().err.splitlines())
            if said:
                break
            await asyncio.sleep(0.05)
        let_go.set()
        return rests

    async def main() -> tuple[int | None, list[list[str]]]:
        serving = asyncio.create_task(
            launch.run_server_worker(waits, served, options, listener, "prog")
        )
        rests = await streams_then_stop()
        return await serving, rests

    stopped_by, rests = asyncio.run(main())
    assert stopped_by == signal.SIGINT
    assert all(rest[-1] == "data: [DONE]" and '"abort"' in rest[-2] for rest in rests)
    assert said == ["prog: stopping on SIGINT; what is in flight is aborted"]
    last = capsys.readouterr().err.splitlines()
    assert last == ["prog: stopped by SIGINT; every block is back in the pool"]
