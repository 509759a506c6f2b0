"""The command lines: ``python -m bench`` and every step's ``python -m <step>.run`` (the demo,
and the text front end with ``--model DIR``), and what they print.

- A bad value of any flag ends in argparse's form: one ``error:`` line, the last on stderr,
  exit status 2, before any work starts (no model built, nothing on stdout). Every name in
  ``--steps`` is checked; integer flags refuse ``2.5``, ``1e3``, ``inf`` and ``nan``; an
  unusable ``--out`` is refused in well under a second.
- ``--help`` shows every default, in plain text.
- The bench's table, header and notes say what was measured: the speed-up against the first
  step run, the computed tokens, the GFLOP and the machine's matmul rate counted the same way
  (two FLOPs per multiply-add, checked against arithmetic done by hand here), the banner's KV
  sizes (by hand too).
- ``python -m bench`` shows a status line on stderr while a slow row runs, only on a terminal
  and not with ``--quiet``; stdout gets the same whole lines either way.
- The text front end says "1 token", and says why a system prompt shorter than one block
  cannot hit.
- The wiring: the real ``python -m bench`` in a fresh interpreter, a step that runs without the
  bench package, ``bench/report.py`` not importing ``bench/showcase.py``, and the commands the
  README and docs show printing no warning.

The parsers are called in-process; subprocesses check the real entry points. A checkpoint
served through ``--model DIR`` is in ``tests/core/test_checkpoint.py``; a checkpoint or request a
command cannot serve (one ``error:`` line, exit 1) is in ``tests/front/test_bad_input.py``.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import costs, progress, report, showcase
from bench.costs import TokenWork, matmul_gflops, model_flops
from bench.harness import RunResult, StepRunner, Workload
from common.config import ModelConfig, preset
from common.front import demo, main, text_cli
from common.front.cli import plural
from common.front.text import short_prefix_note
from common.front.text_cli import describe
from tests.helpers import STEP_NAMES, edit_json, run_python, usage_error

ROOT = Path(__file__).resolve().parents[2]
FIRST_RUN = importlib.import_module(f"{STEP_NAMES[0]}.run")
LAST_RUN = importlib.import_module(f"{STEP_NAMES[-1]}.run")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave like a CPU-only torch even on a machine with a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---- python -m bench: a bad flag is one error line, before any work ------------------------------

BENCH_ERRORS = [
    (["--requests", "-3"], "argument --requests: must be >= 1, got -3"),
    (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["--requests", "many"], "argument --requests: 'many' is not an integer"),
    (["--prefix-len", "-5"], "argument --prefix-len: must be >= 0, got -5"),
    (["--tail-len", "-1"], "argument --tail-len: must be >= 0"),
    (["--prefix-len", "0", "--tail-len", "0"], "a prompt needs at least one token"),
    (["--new-tokens", "0"], "argument --new-tokens: must be >= 1"),
    (["--max-running", "-1"], "argument --max-running: must be >= 0, got -1"),
    (["--block-size", "0"], "argument --block-size: must be >= 1"),
    (["--repeats", "0"], "argument --repeats: must be >= 1"),
    (["--threads", "-2"], "argument --threads: must be >= 0, got -2"),
    (["--steps", ""], "argument --steps: name at least one step"),
    (["--steps", " , "], "argument --steps: name at least one step"),
    (["--steps", "step99"], "argument --steps: no step 'step99'"),
    (["--steps", f"{STEP_NAMES[0]},{STEP_NAMES[0]}"], "is named twice"),
    (["--model", "huge"], "argument --model: 'huge' is neither a preset"),
    (["--dtype", "float8"], "argument --dtype: 'float8' is not a dtype"),
    (["--dtype", "int32"], "argument --dtype: 'int32' is not a dtype"),
    (["--device", "tpu"], "argument --device: 'tpu' is not a device"),
    (["--device", "mps"], "argument --device: 'mps': only cpu and cuda are supported"),
    (["--requests"], "argument --requests: expected one argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"), BENCH_ERRORS, ids=[" ".join(a) for a, _ in BENCH_ERRORS]
)
def test_bench_refuses_a_bad_value(argv: list[str], message: str, capsys) -> None:
    line = usage_error(showcase.main, argv, capsys)
    assert line.startswith("python -m bench: error:") and message in line, line


@pytest.mark.usefixtures("no_work", "no_cuda")
def test_bench_refuses_cuda_on_a_torch_without_it(capsys) -> None:
    line = usage_error(showcase.main, ["--device", "cuda"], capsys)
    assert "argument --device: 'cuda': torch" in line and "cannot use CUDA" in line


@pytest.mark.usefixtures("no_work")
def test_bench_refuses_an_out_that_is_a_file(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    line = usage_error(showcase.main, ["--out", str(a_file)], capsys)
    assert "is not a folder" in line


@pytest.mark.parametrize(
    ("out", "words"),
    [("/proc/bench-results", "cannot write in /proc"), ("{file}/results", "is not a folder")],
    ids=["unwritable", "under-a-file"],
)
def test_bench_refuses_an_unusable_out_folder(tmp_path: Path, out: str, words: str) -> None:
    """The real command: argparse's usage, then one ``error:`` line, exit 2, no traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = run_python("-m", "bench", "--out", out.replace("{file}", str(a_file)))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == proc.stderr.splitlines()[-1]
    assert "argument --out" in errors[0] and words in errors[0], errors[0]


def test_bad_out_fails_before_any_work(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """However big the model, an unusable ``--out`` is found in well under a second (the model
    load is also made to fail loudly, so "before" cannot mean "fast enough on a small model")."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(showcase, "load_model", refuse)
    monkeypatch.setattr(showcase, "StepRunner", refuse)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        showcase.main(["--out", "/proc/bench-results"])
    assert time.perf_counter() - start < 1.0
    assert info.value.code == 2
    assert "cannot write in /proc" in capsys.readouterr().err


@pytest.mark.usefixtures("no_work")
def test_bench_model_directory_needs_a_config_json(tmp_path, capsys) -> None:
    """A folder that is not a checkpoint is refused by the --model type, before any work (a
    real checkpoint runs: tests/core/test_checkpoint.py)."""
    line = usage_error(showcase.main, ["--model", str(tmp_path)], capsys)
    assert "is neither a preset" in line and "no config.json" in line


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


def test_bench_accepts_the_edge_values() -> None:
    args = showcase.parse_args(
        [
            *("--prefix-len", "0", "--threads", "0", "--max-running", "0"),
            *("--steps", f" {STEP_NAMES[-1]} , {STEP_NAMES[0]} "),
        ]
    )
    assert (args.prefix_len, args.threads, args.max_running) == (0, 0, 0)
    assert args.steps == [STEP_NAMES[-1], STEP_NAMES[0]]  # the order given, blanks ignored
    assert showcase.parse_args([]).steps == STEP_NAMES
    assert showcase.parse_args(["--steps", "all"]).steps == STEP_NAMES


# ---- python -m <step>.run: the same for the demo's flags -----------------------------------------


def demo_errors() -> list[tuple[list[str], str]]:
    return [
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["--block-size", "0"], "argument --block-size: must be >= 1"),
        (["--total-blocks", "-1"], "argument --total-blocks: must be >= 1"),
        (
            ["--total-blocks", "3"],
            "the longest demo request does not fit: a request of 61 prompt + 16 new tokens "
            "needs 5 KV blocks of 16 tokens, and the pool has 3: raise total_blocks "
            "(--total-blocks) to at least 5",
        ),
        # The longest request (61 tokens), not the shortest (52), sizes the pool: 5 blocks.
        (["--max-new-tokens", "5", "--total-blocks", "4"], "needs 5 KV blocks"),
        (["--max-running", "0"], "argument --max-running: must be >= 1"),
        (["--seed", "-1"], "argument --seed: must be >= 0"),
        (["--seed", str(2**64)], "argument --seed: must be <= 9223372036854775807"),
        (["--threads", "-2"], "argument --threads: must be >= 0"),
        (["--dtype", "half"], "argument --dtype: 'half' is not a dtype"),
        (["--device", "gpu"], "argument --device: 'gpu' is not a device"),
        (["--system", "You are brief."], "--system needs --model DIR"),
        (["--prompt", "Hello"], "--prompt needs --model DIR"),
        (["--model", "meta-llama/Llama-3.2-1B"], "is not a checkpoint directory"),
    ]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(("argv", "message"), demo_errors(), ids=lambda v: str(v))
def test_demo_refuses_a_bad_value(argv: list[str], message: str, capsys) -> None:
    line = usage_error(FIRST_RUN.main, argv, capsys)
    assert line.startswith(f"python -m {STEP_NAMES[0]}.run: error:") and message in line, line


@pytest.mark.usefixtures("no_work", "no_cuda")
def test_demo_refuses_cuda_on_a_torch_without_it(capsys) -> None:
    line = usage_error(FIRST_RUN.main, ["--device", "cuda"], capsys)
    assert "cannot use CUDA" in line


@pytest.mark.usefixtures("no_work")
def test_no_chat_template_needs_a_model(capsys) -> None:
    line = usage_error(LAST_RUN.main, ["--no-chat-template"], capsys)
    assert "--no-chat-template needs --model DIR" in line


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", NOT_INTEGERS)
@pytest.mark.parametrize("flag", DEMO_INT_FLAGS)
def test_demo_integer_flags_refuse_what_is_not_an_integer(flag: str, value: str, capsys) -> None:
    line = usage_error(LAST_RUN.main, [f"{flag}={value}"], capsys)
    assert f"argument {flag}: {value!r} is not an integer" in line, line


def test_demo_pool_just_big_enough_is_accepted() -> None:
    need = demo.blocks_for_longest_request(16, 16)
    parser = demo.build_parser("run")
    assert demo.read_options(parser, ["--total-blocks", str(need)]).engine.total_blocks == need


# ---- --help --------------------------------------------------------------------------------------


def help_text(main, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("which", ["bench", "demo", "text"])
def test_help_shows_every_default_and_no_rest_markup(
    which: str, capsys, toy_checkpoint: Path
) -> None:
    mains = {"bench": showcase.main, "demo": FIRST_RUN.main}
    text_main = lambda argv: FIRST_RUN.main(["--model", str(toy_checkpoint), *argv])  # noqa: E731
    text = help_text(mains.get(which, text_main), capsys)
    options = set(re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE))
    assert len(options) >= 8
    assert text.count("(default:") == len(options), "an option without its default"
    assert "``" not in text and "`" not in text


def test_demo_help_names_the_chapter(capsys) -> None:
    text = help_text(FIRST_RUN.main, capsys)
    assert 'the chapter "Paged Prefix Cache"' in text and "prefix cache" in text


# ---- what the bench prints: the table, the header, the notes -------------------------------------


def fake_row(name: str, seconds: float, computed_prefill: int) -> showcase.Row:
    result = RunResult([[1]], seconds, 4, 3, 160, 96, computed_prefill, 12)
    return showcase.Row(name, "what it fixed", [seconds], result, new_tokens=16)


def test_a_subset_is_compared_with_its_first_step(tmp_path: Path) -> None:
    rows = [fake_row("step14_6", 2.0, 64), fake_row("step14_7", 1.0, 64)]
    extra = [fake_row("step14_7 (no cache)", 1.6, 160)]
    text = report.table(rows, extra)
    assert "vs step14_6" in text and "vs step14 " not in text
    lines = text.strip().splitlines()
    aligned = {len(line.rsplit("|", 2)[0]) for line in lines}  # all but the free-width last
    assert len(aligned) == 1, "columns stay aligned"
    assert [line.split("|")[5].strip() for line in lines] == [
        "vs step14_6",
        "------------:",
        "1.00x",
        "2.00x",
        "1.25x",
    ]
    args = SimpleNamespace(repeats=1)
    cfg, workload = preset("tiny"), Workload()
    report.save(str(tmp_path), cfg, workload, args, rows, extra, True, machine_gflops=50.0)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["baseline"] == "step14_6"
    assert [r["speedup_vs_baseline"] for r in data["rows"]] == [1.0, 2.0, 1.25]
    assert [r["computed_prefill_tokens"] for r in data["rows"]] == [64, 64, 160]


def test_table_shows_computed_tokens_and_a_dash_for_hf_reuse() -> None:
    hf_result = RunResult([[1]], 1.0, computed_prefill_tokens=160, computed_decode_tokens=12)
    hf = showcase.Row("HF generate", "transformers", [1.0], hf_result, 16)
    lines = report.table([fake_row("step14", 1.0, 64)], [hf]).splitlines()
    titles = [cell.strip() for cell in lines[1].split("|")]
    reuse, computed = titles.index("prefix reuse"), titles.index("computed tokens")
    assert [lines[3].split("|")[i].strip() for i in (reuse, computed)] == ["60%", "64 + 12"]
    assert [lines[4].split("|")[i].strip() for i in (reuse, computed)] == ["-", "160 + 12"]


def test_token_check_wording() -> None:
    rows = [fake_row("step14", 1.0, 64)]
    assert report.check_tokens(rows, [[1]]).message.endswith(
        "every row produced the same tokens as the dense reference model"
    )
    assert "reference check skipped" in report.check_tokens(rows, None).message
    assert not report.check_tokens(rows, [[2]]).ok


def test_header_counts_in_good_english(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report.torch, "get_num_threads", lambda: 1)
    one = report.header(preset("tiny"), Workload(), 1, "tiny", machine_gflops=81.25)
    assert "1 thread\n" in one and "1 run per row" in one and "threads" not in one
    assert one.count("1 thread") == 1  # said once
    assert "81.2 GFLOP/s on a 1024x1024 float32 matmul" in one and "model tiny:" in one
    monkeypatch.setattr(report.torch, "get_num_threads", lambda: 2)
    assert "2 threads" in report.header(preset("tiny"), Workload(), 3, "tiny", 1.0)


def test_phases_say_how_long_and_how_to_skip_a_slow_reference() -> None:
    fast = report.phases({"steps": 12.34, "reference check": 2.0})
    assert fast == "time: steps 12.3 s, reference check 2.0 s"
    slow = report.phases({"steps": 12.0, "Hugging Face": 3.0, "reference check": 95.0})
    assert "Hugging Face 3.0 s" in slow and "--no-reference" in slow


# ---- FLOPs, by hand ------------------------------------------------------------------------------

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


# ---- the banner's KV sizes, by hand --------------------------------------------------------------


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


# ---- progress on stderr --------------------------------------------------------------------------


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


# ---- the text front end's words ------------------------------------------------------------------


def test_one_token_is_singular() -> None:
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens"
    assert plural(0, "new token") == "0 new tokens"


def test_a_short_system_prompt_says_why_it_cannot_hit() -> None:
    note = short_prefix_note(12, "You are brief.", 16)
    assert "their first 12 tokens ('You are brief.'), fewer than one block of 16" in note
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
    assert LAST_RUN.main([*argv, "--prompt", "sat", "--prompt", "ran"]) == 0
    out = capsys.readouterr().out
    assert "(1 token, finish_reason=length)" in out and "(1 tokens" not in out
    assert "system prompt: 'the cat' (3 tokens," in out  # <s> the cat
    assert "0/2 requests hit" in out
    assert "their first 3 tokens ('the cat'), fewer than one block of 16" in out
    assert "--block-size 2" in out


# ---- run.py: one dispatcher, a front end per flag ------------------------------------------------


def test_run_routes_model_to_the_text_front_end_and_the_rest_to_the_demo(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model`` (also as ``--model=DIR``) chooses the text front end, nothing the demo: each
    gets the whole command line, read into its own options."""
    ran: list[tuple[str, object]] = []
    for front_end in main.FRONT_ENDS:
        module = main.load(front_end)
        monkeypatch.setattr(module, "run", lambda step, options, m=module: ran.append((m, options)))
    FIRST_RUN.main(["--max-new-tokens", "3"])
    FIRST_RUN.main(["--model", str(toy_checkpoint), "--prompt", "the"])
    FIRST_RUN.main([f"--model={toy_checkpoint}", "--max-new-tokens", "3"])
    (demo_run, demo_options), (text_run, text_options), (_, other) = ran
    assert demo_run is demo and demo_options.max_new_tokens == 3
    assert text_run is text_cli and text_options.prompts == ["the"]
    assert other.text.sampling_params.max_tokens == 3 and other.prompts == [text_cli.EXAMPLE_PROMPT]


@pytest.mark.usefixtures("no_work")
def test_a_flag_of_the_other_front_end_says_which_flag_it_needs(
    toy_checkpoint: Path, capsys
) -> None:
    text_only = usage_error(FIRST_RUN.main, ["--max-new-tokens", "2", "--stream"], capsys)
    assert text_only.endswith("error: --stream needs --model DIR (a checkpoint's text)")
    model = ["--model", str(toy_checkpoint)]
    demo_only = usage_error(FIRST_RUN.main, [*model, "--trace-round", "batched"], capsys)
    assert "--trace-round is for the demo's own requests: it does not go with --model" in demo_only
    typo = usage_error(FIRST_RUN.main, ["--strem"], capsys)
    assert "unrecognized arguments: --strem" in typo


def test_the_demo_does_not_import_the_text_front_end() -> None:
    """The dispatcher knows the front ends; the demo knows only itself and what they share."""
    imported = imported_modules(ROOT / "common" / "front" / "demo.py")
    assert not {"text", "text_cli", "stream", "chat"} & {name.split(".")[-1] for name in imported}


def test_ctrl_c_while_torch_is_imported_is_one_line() -> None:
    """Ctrl-C in the first seconds, while torch is still being imported, ends the command as it
    does later: one line, and by SIGINT (the shell reads 130), no traceback. ``-X importtime``
    reports every module as its import ends: a line naming torch means torch is under way."""
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", f"{STEP_NAMES[0]}.run"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "torch" in line:
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    said = [line for line in err.splitlines() if line and not line.startswith("import time:")]
    assert process.returncode == -signal.SIGINT, err
    assert said == [f"python -m {STEP_NAMES[0]}.run: interrupted"] and out == ""


# ---- the context length --------------------------------------------------------------------------


def test_the_context_limit_says_where_it_came_from_and_a_raised_one_warns(
    toy_checkpoint: Path,
) -> None:
    """``--max-model-len`` below the request is blamed for the refusal, not the checkpoint;
    above the checkpoint's ``max_position_embeddings`` it serves, with one warning line."""
    base = [f"{STEP_NAMES[-1]}.run", "--model", str(toy_checkpoint), "--prompt", "the"]
    low = run_python("-m", *base, "--max-model-len", "4", "--max-new-tokens", "8")
    assert low.returncode == 1 and "Traceback" not in low.stderr
    assert "(max_model_len (--max-model-len); the checkpoint was trained on 8192" in low.stderr
    high = run_python("-m", *base, "--max-model-len", "100000", "--max-new-tokens", "2")
    assert high.returncode == 0, high.stderr
    assert high.stderr.splitlines() == [
        "warning: max_model_len 100000 is past the 8192 positions the checkpoint was trained "
        "on (its max_position_embeddings): a longer request runs the model on positions it "
        "never saw, and its text may fall apart"
    ]
    plain = run_python("-m", *base, "--max-new-tokens", "2")
    assert plain.returncode == 0 and plain.stderr == ""


# ---- end to end, and the wiring ------------------------------------------------------------------


def test_a_tiny_subset_runs_end_to_end(tmp_path: Path, capsys) -> None:
    first, last = STEP_NAMES[-2], STEP_NAMES[-1]
    argv = "--model tiny --requests 2 --prefix-len 8 --tail-len 4 --new-tokens 2 --repeats 1"
    code = showcase.main(
        [*argv.split(), "--no-hf", "--steps", f"{first},{last}", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"vs {first}" in out and "computed tokens" in out and "peak KV MiB" in out
    assert f"| {last} (warm prefix) " in out and f"| {last} (no cache) " in out
    assert "same tokens as the dense reference model" in out
    assert "max_running=2" in out  # --max-running 0: every request at once
    assert re.search(r"^time: steps \d+\.\d s, reference check \d+\.\d s$", out, re.MULTILINE)
    assert json.loads((tmp_path / "results.json").read_text())["baseline"] == first


def test_python_m_bench_exits_2_with_one_line() -> None:
    """The real entry point, in a fresh interpreter: also no numpy warning from torch."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--requests", "-3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        "python -m bench: error: argument --requests: must be >= 1, got -3"
    )
    assert "NumPy" not in proc.stderr and "Traceback" not in proc.stderr


def test_numpy_is_a_dependency() -> None:
    """Without numpy, torch prints "Failed to initialize NumPy" on every command."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dependencies = \[[^\]]*"numpy', pyproject, re.MULTILINE)


def test_a_step_stands_without_the_bench_package() -> None:
    """``python -m <step>.run`` imports its flag checks from common/, never from bench/."""
    code = (
        f"import sys, {STEP_NAMES[-1]}.run; "
        "print([m for m in sys.modules if m == 'bench' or m.startswith('bench.')])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


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


# ---- the documented commands print no warning ----------------------------------------------------
#
# ``python -W error::UserWarning`` turns a Python warning into a failure; transformers' logged
# warnings are caught by requiring an empty stderr.

RUN = "step14_7.run"


@pytest.fixture(scope="module")
def llama32_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3.2's RoPE (llama3 scaling of an 8192-token original context, 32x, declared
    max_position_embeddings 131072), bf16 weights and eos [<|im_end|>, <|endoftext|>]."""
    chat = pytest.importorskip("tests.front.test_chat_template")
    from common.config import Llama3RopeScaling

    folder = tmp_path_factory.mktemp("llama32") / "ckpt"
    chat.save_chat_checkpoint(folder, rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192))
    edit_json(
        folder / "config.json",
        max_position_embeddings=131072,
        eos_token_id=[2, 0],
        dtype="bfloat16",
    )
    return folder


def quiet_commands(folder: Path, out: Path) -> dict[str, list[str]]:
    """The README's and docs' commands, on the Llama-3.2-style checkpoint, sized down."""
    small = ["--repeats", "1", "--requests", "2", "--prefix-len", "8", "--tail-len", "4"]
    return {
        "demo": [RUN, "--max-new-tokens", "2"],
        "text": [RUN, "--model", str(folder), "--max-new-tokens", "4", "--prompt", "Water"],
        "bench": ["bench", *small, "--new-tokens", "2", "--steps", "step14_7", "--out", str(out)],
        "bench-model": [
            "bench",
            *small,
            *("--new-tokens", "2", "--steps", "step14_7", "--model", str(folder)),
            *("--out", str(out)),
        ],
    }


@pytest.mark.parametrize("name", ["demo", "text", "bench", "bench-model"])
def test_the_documented_commands_print_no_warning(
    llama32_style: Path, tmp_path: Path, name: str
) -> None:
    argv = quiet_commands(llama32_style, tmp_path)[name]
    proc = run_python("-W", "error::UserWarning", "-m", *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
