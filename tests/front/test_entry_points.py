"""``python -m stepN.run`` and ``python -m stepN.serve`` drive stepN's own engine, shown by what
runs (every step's rounds are watched), not by the text of the entry files: a ``run.py`` that
handed another step's name to the front ends would pass a comparison of files, not this."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.helpers import STEP_NAMES


@pytest.fixture
def engines_run(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The step of every engine that runs a round from now on, in order."""
    ran: list[str] = []
    for name in STEP_NAMES:
        engine_class = importlib.import_module(f"{name}.engine").PagedPrefixCacheEngine

        def step(self, real=engine_class.step) -> list:
            ran.append(type(self).__module__.split(".")[0])
            return real(self)

        monkeypatch.setattr(engine_class, "step", step)
    return ran


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_run_drives_its_own_steps_engine(
    step_name: str, toy_checkpoint: Path, engines_run: list[str], capsys: pytest.CaptureFixture
) -> None:
    run = importlib.import_module(f"{step_name}.run")
    argv = ["--model", str(toy_checkpoint), "--prompt", "the", "--max-new-tokens", "2"]
    assert run.main(argv) == 0, capsys.readouterr()
    assert engines_run and set(engines_run) == {step_name}


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_serve_builds_its_own_steps_engine(
    step_name: str, toy_checkpoint: Path, engines_run: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole way from ``serve.py`` to the engine the server runs, but for the serving
    itself: in its place, the engine is built (as its process builds it) and runs a round."""
    pytest.importorskip("fastapi")
    from front.serve import launch

    async def one_round(builder: launch.EngineBuilder, *args: object) -> None:
        builder().generate([[1, 2, 3]], 1)

    monkeypatch.setattr(launch, "run_server_worker", one_round)
    serve = importlib.import_module(f"{step_name}.serve")
    assert serve.main(["--model", str(toy_checkpoint), "--port", "0"]) == 0
    assert engines_run and set(engines_run) == {step_name}
