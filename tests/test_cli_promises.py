"""What the command lines and the bench promise, each pinned by a test that fails when the
promise is broken.

- Every name in ``--steps`` is checked before any work.
- Integer flags refuse ``2.5``, ``1e3``, ``inf`` and ``nan`` with one ``error:`` line.
- The bench's GFLOP and the machine's matmul rate count FLOPs the same way, two per
  multiply-add: both are checked against arithmetic done by hand here.
- The banner's "without grouped-query attention" size is the full-head size (by hand too).
- ``python -m bench`` shows a status line on stderr while a slow row runs, only on a terminal
  and not with ``--quiet``; stdout gets the same whole lines either way.
- The text front end says "1 token", and says why a system prompt shorter than one block
  cannot hit.
- ``bench/report.py`` does not import ``bench/showcase.py`` (no import cycle).
"""

from __future__ import annotations

import ast
import importlib
import io
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import costs, progress, showcase
from bench.costs import TokenWork, matmul_gflops, model_flops
from bench.harness import StepRunner
from common.config import ModelConfig, preset
from common.front.text import describe, plural, short_system_note
from tests.helpers import STEP_NAMES

ROOT = Path(__file__).resolve().parent.parent
DEMO = importlib.import_module(f"{STEP_NAMES[-1]}.run")


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the bench gets as far as loading a model or building a step."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(showcase, "load_model", refuse)
    monkeypatch.setattr(showcase, "StepRunner", refuse)
    monkeypatch.setattr(showcase, "matmul_gflops", refuse)


def usage_error(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` must exit 2 with nothing on stdout and one ``error:`` line (the last)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and captured.err.splitlines()[-1] == errors[0], captured.err
    return errors[0]


# ---- --steps ------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    "steps",
    [f"{STEP_NAMES[0]},step99", f"{STEP_NAMES[0]},{STEP_NAMES[-1]},nope", "nope,step14"],
    ids=["second", "last", "first"],
)
def test_every_step_name_is_checked_before_any_work(steps: str, capsys) -> None:
    line = usage_error(showcase.main, ["--steps", steps], capsys)
    bad = next(name for name in steps.split(",") if name not in STEP_NAMES)
    assert f"argument --steps: no step {bad!r}" in line


# ---- integer flags ------------------------------------------------------------------------

BENCH_INT_FLAGS = [
    "--requests",
    "--prefix-len",
    "--tail-len",
    "--new-tokens",
    "--max-running",
    "--block-size",
    "--repeats",
    "--threads",
]
DEMO_INT_FLAGS = [
    "--block-size",
    "--total-blocks",
    "--max-new-tokens",
    "--max-running",
    "--seed",
    "--threads",
]
NOT_INTEGERS = ["2.5", "1e3", "inf", "nan", "-inf", "3.0"]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", NOT_INTEGERS)
@pytest.mark.parametrize("flag", BENCH_INT_FLAGS)
def test_bench_integer_flags_refuse_what_is_not_an_integer(flag: str, value: str, capsys) -> None:
    line = usage_error(showcase.main, [f"{flag}={value}"], capsys)
    assert f"argument {flag}: {value!r} is not an integer" in line, line


@pytest.mark.parametrize("value", NOT_INTEGERS)
@pytest.mark.parametrize("flag", DEMO_INT_FLAGS)
def test_demo_integer_flags_refuse_what_is_not_an_integer(
    flag: str, value: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common.front import demo

    monkeypatch.setattr(demo, "load_step", lambda *a: pytest.fail("the demo started"))
    line = usage_error(DEMO.main, [f"{flag}={value}"], capsys)
    assert f"argument {flag}: {value!r} is not an integer" in line, line


# ---- FLOPs, by hand -----------------------------------------------------------------------

# One layer, d_model 8, 2 query heads of 4, 1 KV head, d_ff 16, vocab 10.
HAND_CFG = ModelConfig(
    vocab_size=10, d_model=8, num_heads=2, num_kv_heads=1, num_layers=1, d_ff=16, seed=None
)


def test_model_flops_are_two_per_multiply_add_by_hand() -> None:
    """Three tokens at positions 0, 1, 2 (context 1 + 2 + 3 = 6 keys), one of them sampled.

    Multiply-adds, counted by hand:
      q_proj 8x8 = 64, k_proj 8x4 = 32, v_proj 8x4 = 32, o_proj 8x8 = 64,
      gate/up/down 3 x 8x16 = 384: 576 per token, x 3 tokens = 1728;
      attention, per key: q.k (2 heads x 4) + weights x v (2 x 4) = 16, x 6 keys = 96;
      lm_head 8x10 = 80, once.
    Total 1728 + 96 + 80 = 1904 multiply-adds = 3808 FLOPs.
    """
    work = TokenWork()
    work.add_chunk(0, 3)
    work.sampled = 1
    assert (work.tokens, work.context) == (3, 6)
    assert model_flops(HAND_CFG, work) == 3808


def test_the_machine_rate_is_two_flops_per_multiply_add_by_hand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 100x100 by 100x100 matmul is 100**3 = 1,000,000 multiply-adds: 2,000,000 FLOPs. A
    clock that says each one took 1 ms makes that 2.0 GFLOP/s."""
    ticks = iter(i * 0.001 for i in range(1000))

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return next(ticks)

    monkeypatch.setattr(costs, "time", Clock)
    assert matmul_gflops("cpu", n=100, repeats=3) == pytest.approx(2.0)


# ---- the banner's KV sizes, by hand ----------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "with_gqa", "without"),
    [
        # 2 layers x block 4 x 2 KV heads x d_head 16 x 4 bytes x 2 (K and V) = 2048 B;
        # 4 heads without GQA: 4096 B.
        (preset("tiny", num_kv_heads=2, block_size=4), "2 KiB", "4 KiB"),
        # 4 layers x 16 x 1 KV head x 32 x 2 bytes x 2 = 8192 B; 8 heads: 65536 B.
        (ModelConfig(num_kv_heads=1, dtype=torch.bfloat16), "8 KiB", "64 KiB"),
    ],
    ids=["tiny-gqa", "demo-mqa-bf16"],
)
def test_banner_without_gqa_is_the_full_head_size(
    cfg: ModelConfig, with_gqa: str, without: str
) -> None:
    pool = describe(cfg)[1]
    assert f"{with_gqa} of K and V per block ({without} without grouped-query attention)" in pool


def test_banner_says_nothing_about_gqa_without_it() -> None:
    assert "grouped-query" not in describe(preset("tiny"))[1]


# ---- progress on stderr -------------------------------------------------------------------


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_slow_task_shows_a_status_line_then_erases_it() -> None:
    stream = Terminal()
    bar = progress.Progress(stream, delay=0.0, interval=0.01)
    with bar.task("step14_3") as task:
        task.note = "run 2/3"
        task.live = lambda: "1,024 tokens computed"
        time.sleep(0.1)
    text = stream.getvalue()
    assert "\r\x1b[K  step14_3: run 2/3, 1,024 tokens computed, 0 s" in text
    assert text.endswith("\r\x1b[K"), "the line is erased when the task ends"


def test_a_quick_task_shows_nothing() -> None:
    stream = Terminal()
    with progress.Progress(stream, delay=5.0).task("quick"):
        pass
    assert stream.getvalue() == ""


def test_no_status_line_off_a_terminal_or_when_disabled() -> None:
    for bar in (
        progress.Progress(io.StringIO(), delay=0.0, interval=0.01),  # not a terminal
        progress.Progress(Terminal(), enabled=False, delay=0.0, interval=0.01),
    ):
        with bar.task("x"):
            time.sleep(0.05)
        assert bar.stream.getvalue() == ""


ARGV = [
    *("--model", "tiny", "--requests", "2", "--prefix-len", "8", "--tail-len", "4"),
    *("--new-tokens", "2", "--repeats", "2", "--no-hf", "--no-reference"),
    *("--steps", STEP_NAMES[-1]),
]


@pytest.mark.parametrize("quiet", [False, True], ids=["terminal", "quiet"])
def test_bench_shows_each_row_and_its_repeats_on_a_terminal(
    quiet: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.001)
    monkeypatch.setattr(sys, "stderr", Terminal())
    real_run = StepRunner.run

    def slow_run(self: StepRunner, *args: object, **kwargs: object) -> object:
        """Long enough for the status line to be drawn, however busy the machine."""
        time.sleep(0.2)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "run", slow_run)
    argv = [*ARGV, "--out", str(tmp_path), *(["--quiet"] if quiet else [])]
    assert showcase.main(argv) == 0
    status = sys.stderr.getvalue()
    out = capsys.readouterr().out
    assert f"\n  {STEP_NAMES[-1]} " in out, "the table's rows go to stdout either way"
    if quiet:
        assert status == ""
    else:
        assert f"  {STEP_NAMES[-1]}: run 1/2" in status
        assert f"  {STEP_NAMES[-1]}: run 2/2" in status
        assert f"  {STEP_NAMES[-1]} (no cache): run 1/2" in status
        assert "\r" not in out, "stdout gets whole lines only"


def test_the_status_line_counts_the_running_engines_tokens() -> None:
    runner = StepRunner(STEP_NAMES[-1], preset("tiny"))
    figure = showcase.computed_so_far(runner)
    assert figure() == ""  # between runs
    runner.live = TokenWork(tokens=1234)
    assert figure() == "1,234 tokens computed"


# ---- the text front end's words -------------------------------------------------------------


def test_one_token_is_singular() -> None:
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens"
    assert plural(0, "new token") == "0 new tokens"


def test_a_short_system_prompt_says_why_it_cannot_hit() -> None:
    note = short_system_note(12, 16)
    assert "12 tokens, shorter than one block of 16" in note
    assert "--block-size 8" in note  # a block size the 12 tokens fill at least once


def test_run_text_prints_one_token_and_the_short_system_note(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from common.front.hf import hf_llama
    from tests.toy_checkpoint import CFG, word_tokenizer

    hf_llama(CFG).save_pretrained(tmp_path)
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    argv = ["--model", str(tmp_path), "--max-new-tokens", "1", "--system", "the cat"]
    assert DEMO.main([*argv, "--prompt", "sat", "--prompt", "ran"]) == 0
    out = capsys.readouterr().out
    assert "(1 token)" in out and "(1 tokens)" not in out
    assert "system prompt: 'the cat' (3 tokens," in out  # <s> the cat
    assert "0/2 requests hit" in out
    assert "3 tokens, shorter than one block of 16" in out


# ---- no import cycle ------------------------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved inside ``bench``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = f"bench.{node.module or ''}".rstrip(".") if node.level else node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_report_does_not_import_showcase() -> None:
    """showcase runs and report prints; the Row both use lives in bench/rows.py."""
    assert "bench.showcase" not in imported_modules(ROOT / "bench" / "report.py")
    assert "bench.report" in imported_modules(ROOT / "bench" / "showcase.py")


def test_no_chat_template_needs_a_model(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.front import demo

    monkeypatch.setattr(demo, "load_step", lambda *a: pytest.fail("the demo started"))
    line = usage_error(DEMO.main, ["--no-chat-template"], capsys)
    assert "--no-chat-template needs --model DIR" in line
