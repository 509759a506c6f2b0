"""Plain helpers shared by the test files (the fixtures are in ``conftest.py``).

- the steps: ``STEP_NAMES``, and ``has_fix`` / ``requires_fix``, the one way a test depends on
  which step it runs (steps are cumulative: a step holds its own fix and every earlier one);
- the test model and the oracle: ``tiny_config``, ``reference_tokens``, ``reference_model``;
- requests: ``tokens``, ``random_shared_prefix_prompts``, ``blocks_needed``,
  ``life_in_rounds``, ``truncate_at``;
- the round's token budget (step14_9): ``prefill_chunk``, ``budget_args``, ``ROUND_FIGURES``,
  ``same_work_figures``;
- driving an engine: ``run_rounds``, ``log_schedules``, ``guard_against_hangs``,
  ``assert_engine_matches_reference``;
- a step's files as they are on disk: ``step_files``, ``function_tree``, ``python_loops``;
- the command line: ``usage_error``, ``bench_usage_error``, ``NOT_INTEGERS``, ``run_python``,
  and the docs' tables of flags: ``documented_defaults``, ``assert_documented_defaults``;
- a checkpoint's files: ``edit_json``; Hugging Face's own answers: ``hf_greedy``.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch

from common.config import ModelConfig, preset
from common.numbers import cdiv
from common.observer import RoundObserver
from common.reference import ReferenceModel, reference_generate
from front.steps import FIXES, STEPS, available_steps

ROOT = Path(__file__).resolve().parent.parent
STEP_NAMES = available_steps()


# ---- which step: one way to gate a test -------------------------------------------------------


def has_fix(step: ModuleType | str, fix_step: str) -> bool:
    """Does ``step`` (a step package or its name) hold ``fix_step``'s fix? Steps are
    cumulative, so every step from ``fix_step`` on does, and every step before it still has
    the inefficiency that ``fix_step`` removes."""
    name = step if isinstance(step, str) else step.__name__
    return STEPS.index(name) >= STEPS.index(fix_step)


def requires_fix(step: ModuleType | str, fix_step: str) -> None:
    """Skip the calling test in the steps before ``fix_step``: what it checks arrives there."""
    if not has_fix(step, fix_step):
        pytest.skip(f"{fix_step} brings it ({FIXES[fix_step][1]})")


# ---- the test model and the oracle ------------------------------------------------------------


def tiny_config(**changes: object) -> ModelConfig:
    """The test model, in float64 unless told otherwise: there parity must be exact."""
    changes.setdefault("dtype", torch.float64)
    return preset("tiny", **changes)


TINY = tiny_config()


@cache
def reference_model(cfg: ModelConfig) -> ReferenceModel:
    return ReferenceModel(cfg)


def reference_tokens(
    cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None
) -> list[list[int]]:
    """The oracle's greedy tokens (the reference ignores block_size / total_blocks)."""
    oracle_cfg = cfg.replace(block_size=1, total_blocks=1)
    return reference_generate(reference_model(oracle_cfg), prompts, max_new_tokens, eos_token_id)


# ---- requests ---------------------------------------------------------------------------------


def tokens(seed: int, n: int, low: int = 0) -> list[int]:
    """``n`` random token ids in ``[low, vocab)`` of the test model; distinct seeds give
    unrelated prompts."""
    rng = random.Random(seed)
    return [rng.randrange(low, TINY.vocab_size) for _ in range(n)]


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """A request's whole-life need: every token whose KV is written (the last generated token
    is never fed back). What the engine refuses beyond the pool's size, and what worst-case
    reservation would hold back for it at admission."""
    return cdiv(prompt_len + max_new_tokens - 1, block_size)


def life_in_rounds(
    prompt_len: int,
    max_new: int,
    cached_blocks: int = 0,
    block_size: int = TINY.block_size,
    chunk: int | None = None,
) -> int:
    """Rounds a request runs once admitted: one per prefill chunk of ``chunk`` tokens (None: a
    block; ``prefill_chunk`` says an engine's) while the cached blocks need none, then one per
    decode token (the first comes out of the last prefill chunk)."""
    return cdiv(prompt_len - cached_blocks * block_size, chunk or block_size) + max_new - 1


def prefill_chunk(engine: object) -> int:
    """The prompt tokens a request prefills in a round that is its own: one block, the
    chapter's chunk, before step14_9; from it on, the whole blocks of the engine's token budget
    (``max_num_batched_tokens``)."""
    block_size = engine.model.cfg.block_size
    if not has_fix(type(engine).__module__.partition(".")[0], "step14_9"):
        return block_size
    return engine.max_num_batched_tokens // block_size * block_size


def budget_args(step: ModuleType | str, max_num_batched_tokens: int) -> dict[str, int]:
    """The engine argument that sets the round's token budget, for the steps that have one
    (step14_9 on); nothing for the others."""
    if not has_fix(step, "step14_9"):
        return {}
    return {"max_num_batched_tokens": max_num_batched_tokens}


# EngineStats' figures that say how the work was cut into rounds, not what it was. From step14_9
# on, a prompt prefills in chunks of many blocks: a request lives fewer rounds, and of requests
# that start together behind one prefix the first computes it all, instead of adopting the
# blocks that the others computed while it computed block 0 (then it counted as a hit).
ROUND_FIGURES = ("rounds", "seqs_scheduled", "requests_hit")


def same_work_figures(stats: dict[str, int], step: ModuleType | str) -> dict[str, int]:
    """``stats`` (``asdict(EngineStats)``) without ``ROUND_FIGURES`` from step14_9 on: what
    every step must report alike, for comparison with step14's figures."""
    if not has_fix(step, "step14_9"):
        return dict(stats)
    return {name: value for name, value in stats.items() if name not in ROUND_FIGURES}


def truncate_at(output: list[int], eos: int) -> list[int]:
    """A free run's output as a request stopping at ``eos`` gives it (eos included)."""
    return output[: output.index(eos) + 1] if eos in output else output


def random_shared_prefix_prompts(
    rng: random.Random,
    vocab_size: int,
    max_prompts: int = 8,
    max_groups: int = 3,
    max_prefix: int = 40,
    max_tail: int = 12,
) -> list[list[int]]:
    """A random prompt set for property tests: a few groups, each with its own shared prefix.

    Tails may be empty and prefixes may be short or absent, so full-prompt hits, exact block
    multiples, one-token prompts and prompts that are prefixes of others all turn up.
    """

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    prefixes = [draw(rng.randint(0, max_prefix)) for _ in range(rng.randint(1, max_groups))]
    prompts = []
    for _ in range(rng.randint(1, max_prompts)):
        prompt = rng.choice(prefixes) + draw(rng.randint(0, max_tail))
        prompts.append(prompt or draw(1))
    return prompts


# ---- driving an engine ------------------------------------------------------------------------

EngineFactory = Callable[..., object]

# More rounds than any test's workload needs, by far: an engine past it is stuck (a request that
# is never admitted or never finishes), and the test fails instead of hanging.
MAX_ROUNDS_PER_ENGINE = 5000


def guard_against_hangs(engine: object, max_rounds: int = MAX_ROUNDS_PER_ENGINE) -> None:
    """Make ``engine.step`` (and so ``generate``) fail once the engine has run ``max_rounds``."""
    real_step, rounds = engine.step, [0]

    def step() -> list:
        rounds[0] += 1
        if rounds[0] > max_rounds:
            raise AssertionError(
                f"the engine ran {max_rounds} rounds and still has work: a request is stuck "
                f"(never admitted, or never finishing)"
            )
        return real_step()

    engine.step = step


def run_rounds(engine, limit: int = 1000) -> int:
    """Step until the engine is idle; returns the number of rounds."""
    rounds = 0
    while engine.has_work:
        assert rounds < limit, "the engine does not finish"
        engine.step()
        rounds += 1
    return rounds


def log_schedules(engine) -> list[list[int]]:
    """Each round's log of the ids of the sequences it ran, in the order it ran them (running
    ones oldest first, then the newly admitted): an observer of the engine, told of every
    chunk or token as it is scheduled."""
    log: list[list[int]] = []

    class Log(RoundObserver):
        def round_started(self) -> None:
            log.append([])

        def scheduled(self, seq, start: int, num_tokens: int) -> None:
            log[-1].append(seq.seq_id)

    engine.observer.add(Log())
    return log


def assert_engine_matches_reference(
    engine, prompts: list[list[int]], max_new_tokens: int, serial: bool = False
) -> list[list[int]]:
    """Generate with ``engine`` (batched or serial) and compare with the dense reference."""
    run = engine.generate_serial if serial else engine.generate
    outputs = run(prompts, max_new_tokens)
    assert outputs == reference_tokens(engine.model.cfg, prompts, max_new_tokens)
    return outputs


# ---- a BlockManager's observable state --------------------------------------------------------


def block_manager_snapshot(bm: object) -> tuple[int, list[int]]:
    """Everything observable about a pool: how many blocks are free and every ref count."""
    return bm.num_free, [bm.ref_count(b) for b in range(bm.total_blocks)]


def assert_raises_unchanged(bm: object, error: type[Exception], call: Callable[[], object]) -> None:
    """A misuse must raise ``error`` and leave the pool untouched (no partial effect)."""
    before = block_manager_snapshot(bm)
    with pytest.raises(error):
        call()
    assert block_manager_snapshot(bm) == before


# ---- a step's files, as they are on disk ------------------------------------------------------


def step_files(step_name: str) -> dict[str, bytes]:
    folder = ROOT / step_name
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def function_tree(step_name: str, file: str, qualname: str) -> ast.FunctionDef:
    """The syntax tree of ``Class.method`` (or a module-level function) in a step's file."""
    tree = ast.parse((ROOT / step_name / file).read_text())
    *owners, name = qualname.split(".")
    for owner in owners:
        tree = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def python_loops(function: ast.FunctionDef) -> list[str]:
    """The Python-level loops of a function: ``for``, ``while`` and comprehensions."""
    kinds = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    return [ast.unparse(n).split("\n")[0] for n in ast.walk(function) if isinstance(n, kinds)]


# ---- the command line ---------------------------------------------------------------------------


def usage_error(
    main: Callable[[list[str]], object], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    """``main(argv)`` (a command line's ``main``) must exit 2 before any work: nothing on
    stdout, no traceback, and one ``error:`` line on stderr, the last. Returns that line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and captured.err.splitlines()[-1] == errors[0], captured.err
    return errors[0]


# What an integer flag must refuse: argparse's int() would take none of them, but float() all.
NOT_INTEGERS = ["2.5", "1e3", "inf", "nan", "-inf", "3.0"]


def bench_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``python -m bench argv`` must exit 2 before any work, with one ``error:`` line."""
    from bench.cli import main

    line = usage_error(main, argv, capsys)
    assert line.startswith("python -m bench: error:")
    return line


# More than any command of the tests needs on a busy 2-core machine: past it, the command hangs.
SUBPROCESS_TIMEOUT_S = 300


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh interpreter, run from the repository root as a user would:
    its exit status, stdout and stderr (as text)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


# How a docs table writes a default that is no value; "—": the command has no such flag.
DEFAULT_WORDS = {"off": False, "(needed)": None}
NO_FLAG = "—"


def documented_defaults(table: str) -> dict[str, dict[str, str]]:
    """A docs table of flags (``| flag | <column> ... | what |``): for each column between the
    first and the last, each flag with its default as the column writes it. A row may name
    several flags, with their defaults in the same order, comma-separated."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    columns = [cell.strip() for cell in lines[0].split("|")[2:-2]]
    found: dict[str, dict[str, str]] = {column: {} for column in columns}
    for line in lines[2:]:
        cells = line.split("|")[1:-1]
        flags = re.findall(r"`(--[a-z-]+)", cells[0])
        for column, cell in zip(columns, cells[1:], strict=False):
            if cell.strip() == NO_FLAG:
                continue
            values = [value.strip() for value in cell.split(",")]
            values = values if len(values) == len(flags) else [cell.strip()] * len(flags)
            found[column].update(zip(flags, values, strict=True))
    return found


def assert_documented_defaults(parser: argparse.ArgumentParser, documented: dict[str, str]) -> None:
    """The parser has exactly the documented flags, each with the default the docs give."""
    actual = {
        action.option_strings[0]: action.default
        for action in parser._actions
        if action.option_strings and action.option_strings[0] != "-h"
    }
    assert set(documented) == set(actual), set(documented) ^ set(actual)
    for flag, text in documented.items():
        default = actual[flag]
        if text.startswith("none"):
            assert default is None, flag
        elif text in DEFAULT_WORDS:
            assert default is DEFAULT_WORDS[text], flag
        else:
            assert text == str(default), (flag, text, default)


# ---- a checkpoint's files -----------------------------------------------------------------------


def edit_json(path: Path, **changes: object) -> None:
    """Set fields of a JSON file (``config.json``, ...); a value of None is written as null."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def hf_greedy(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: int | list[int] | None = None,
) -> list[list[int]]:
    """Hugging Face ``generate`` (``model``: a ``LlamaForCausalLM``), greedy, one prompt at a
    time (no padding): each answer's new ids, cut before the first of the ``eos`` ids (HF keeps
    it; the text front end drops it)."""
    stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        outputs.append(out[: next((i for i, t in enumerate(out) if t in stops), len(out))])
    return outputs
