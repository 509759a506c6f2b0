"""The shared fixtures: every test that takes ``step`` runs once per step directory that exists.

- ``step``, ``make_engine``: a step package, and engines of it that cannot hang a test;
- ``guard_every_engine``: the same guard for engines a test does not build itself (the bench's);
- ``no_work``: a command line that gets past its flag checks fails the test;
- ``no_cuda``: torch behaves as a CPU-only build, GPU or not;
- ``toy_checkpoint``: a tiny Llama checkpoint folder with a word-level tokenizer;
- ``redis_server``, ``redis_url``: a real Redis server (``tests/redis_server.py``).

Plain helper functions are in ``tests/helpers.py``; no test imports from this file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from common.config import ModelConfig
from front.steps import load_step
from tests.helpers import STEP_NAMES, EngineFactory, guard_against_hangs, tiny_config
from tests.redis_server import redis_server, redis_url  # noqa: F401

# The test model is tiny: a second thread only adds synchronisation, and on a busy 2-core
# machine it makes every small matmul wait (100x slower was seen).
torch.set_num_threads(1)


@pytest.fixture(params=STEP_NAMES)
def step(request: pytest.FixtureRequest) -> ModuleType:
    """A step package (``step.PagedPrefixCacheEngine``, ``step.TinyTransformerPaged``, ...)."""
    return load_step(request.param)


@pytest.fixture
def make_engine(step: ModuleType) -> Iterator[EngineFactory]:
    """``make_engine(cfg=None, max_running=4, enable_prefix_cache=True, **engine_args)`` for
    this test's step (``engine_args``: what only some steps take, ``budget_args``).

    After the test, every engine it made that is at rest must have no leaked block: each block
    free (ref_count 0) or held by the cache alone (ref_count 1), free + cached = total. An engine
    that runs far more rounds than any test needs fails the test instead of hanging it.
    """
    engines = []

    def factory(
        cfg: ModelConfig | None = None,
        max_running: int = 4,
        enable_prefix_cache: bool = True,
        **engine_args: object,
    ):
        model = step.TinyTransformerPaged(cfg or tiny_config())
        engine = step.PagedPrefixCacheEngine(
            model, max_running=max_running, enable_prefix_cache=enable_prefix_cache, **engine_args
        )
        guard_against_hangs(engine)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if not engine.has_work:
            assert engine.ref_count_problems() == []


@pytest.fixture
def guard_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine of every step built while the test runs fails after
    ``MAX_ROUNDS_PER_ENGINE`` rounds instead of hanging, as ``make_engine``'s do: for tests
    that drive engines they do not build, e.g. through ``bench/batch.py``'s ``BatchRunner``
    (whose ``serve_requests`` steps ``while engine.has_work``, with no bound)."""
    for name in STEP_NAMES:
        engine_class = load_step(name).PagedPrefixCacheEngine
        real_init = engine_class.__init__

        def init(self: object, *args: object, real_init=real_init, **kwargs: object) -> None:
            real_init(self, *args, **kwargs)
            guard_against_hangs(self)

        monkeypatch.setattr(engine_class, "__init__", init)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command line gets past its flag checks: ``python -m bench`` starting
    its workload's run (where any model is loaded, the machine timed or the reference built); a
    step's ``run.py`` (the demo) loading its step."""
    from bench import cli
    from front import demo

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(cli, "run_workload", refuse)
    monkeypatch.setattr(demo, "load_step", refuse)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave like a CPU-only torch even on a machine with a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint directory as ``save_pretrained`` writes it, with a word-level
    ``tokenizer.json`` (the stand-in for a real checkpoint in the README's commands and the
    trace of the text front end). Skips when the optional packages are missing."""
    for package in ("transformers", "safetensors", "tokenizers"):
        pytest.importorskip(package)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from common.config import preset
    from front.hf import hf_llama

    words = "<unk> <s> </s> the capital of france is water boils at you are a concise assistant"
    vocab = {word: i for i, word in enumerate(words.split())}
    folder = tmp_path_factory.mktemp("toy-llama")
    hf_llama(preset("tiny", vocab_size=len(vocab))).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
