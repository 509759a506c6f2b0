"""``python -m bench``'s command line, and what the shared-prefix table prints.

- A bad value of any flag ends in argparse's form: one ``error:`` line, the last on stderr,
  exit status 2, before any work starts (``no_work``: the workload's run never begins). Every
  name in ``--steps`` is checked; integer flags refuse ``2.5``, ``1e3``, ``inf`` and ``nan``;
  an unusable ``--out`` is refused in well under a second.
- ``--help`` shows every default, in plain text.
- The table, header and notes say what was measured: the speed-up against the first step run,
  the computed tokens, the GFLOP and the machine's matmul rate counted the same way (two FLOPs
  per multiply-add, checked against arithmetic done by hand here).
- A status line on stderr while a slow row runs, only on a terminal and not with ``--quiet``;
  stdout gets the same whole lines either way.
- The wiring: the real ``python -m bench`` in a fresh interpreter, and the layers of the
  package (the command line and the workloads above the shared pieces).

(Moved here from ``tests/front/test_cli.py`` with the bench's own layer; the demo's flags stay
there.)
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import cli, costs, progress
from bench.batch import BatchRunner, Row, RunResult, Timing, measure
from bench.costs import Floor, TokenWork, matmul_gflops, model_flops
from bench.models import load_step_model
from bench.options import BenchOptions
from bench.rows import check_tokens, header, phases, save, table
from bench.workloads import WORKLOADS
from bench.workloads.shared_prefix import SharedPrefix
from common.config import ModelConfig, preset
from tests.helpers import NOT_INTEGERS, STEP_NAMES, run_python, usage_error

ROOT = Path(__file__).resolve().parents[2]
FLOOR = Floor(10**9, 100.0)


# ---- a bad flag is one error line, before any work -----------------------------------------------

BENCH_ERRORS = [
    (["--requests", "-3"], "argument --requests: must be >= 1, got -3"),
    (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["--requests", "many"], "argument --requests: 'many' is not an integer"),
    (["--prefix-len", "-5"], "argument --prefix-len: must be >= 0, got -5"),
    (["--tail-len", "-1"], "argument --tail-len: must be >= 0"),
    (["--prefix-len", "0", "--tail-len", "0"], "a prompt needs at least one token"),
    (["--new-tokens", "0"], "argument --new-tokens/--max-new-tokens: must be >= 1"),
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
    (
        ["--steps", "step14_7,step14_8", "--max-num-batched-tokens", "64"],
        "--max-num-batched-tokens needs step14_9 or later: step14_8's engine has no "
        "max_num_batched_tokens (--steps step14_7,step14_8)",
    ),
    (
        ["--steps", "step14_8,step14_9", "--max-num-batched-tokens", "30"],
        "block_size + max_running - 1 = 31",  # 16 requests at once, blocks of 16
    ),
]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"), BENCH_ERRORS, ids=[" ".join(a) for a, _ in BENCH_ERRORS]
)
def test_bench_refuses_a_bad_value(argv: list[str], message: str, capsys) -> None:
    line = usage_error(cli.main, argv, capsys)
    assert line.startswith("python -m bench: error:") and message in line, line


@pytest.mark.usefixtures("no_work", "no_cuda")
def test_bench_refuses_cuda_on_a_torch_without_it(capsys) -> None:
    line = usage_error(cli.main, ["--device", "cuda"], capsys)
    assert "argument --device: 'cuda': torch" in line and "cannot use CUDA" in line


@pytest.mark.usefixtures("no_work")
def test_bench_refuses_an_out_that_is_a_file(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    line = usage_error(cli.main, ["--out", str(a_file)], capsys)
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


@pytest.mark.usefixtures("no_work")
def test_bad_out_fails_before_any_work(capsys) -> None:
    """However big the model, an unusable ``--out`` is found in well under a second (the
    workload's run is made to fail loudly, so "before" cannot mean "fast enough on a small
    model")."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        cli.main(["--out", "/proc/bench-results"])
    assert time.perf_counter() - start < 1.0
    assert info.value.code == 2
    assert "cannot write in /proc" in capsys.readouterr().err


@pytest.mark.usefixtures("no_work")
def test_bench_model_directory_needs_a_config_json(tmp_path, capsys) -> None:
    """A folder that is not a checkpoint is refused by the --model type, before any work (a
    real checkpoint runs: tests/core/test_checkpoint.py)."""
    line = usage_error(cli.main, ["--model", str(tmp_path)], capsys)
    assert "is neither a preset" in line and "no config.json" in line


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    "steps",
    [f"{STEP_NAMES[0]},step99", f"{STEP_NAMES[0]},{STEP_NAMES[-1]},nope", "nope,step14"],
    ids=["second", "last", "first"],
)
def test_every_step_name_is_checked_before_any_work(steps: str, capsys) -> None:
    line = usage_error(cli.main, ["--steps", steps], capsys)
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


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", NOT_INTEGERS)
@pytest.mark.parametrize("flag", BENCH_INT_FLAGS)
def test_bench_integer_flags_refuse_what_is_not_an_integer(flag: str, value: str, capsys) -> None:
    line = usage_error(cli.main, [f"{flag}={value}"], capsys)
    assert f"{value!r} is not an integer" in line and f"argument {flag}" in line, line


def test_bench_accepts_the_edge_values() -> None:
    options = cli.parse(
        [
            *("--prefix-len", "0", "--threads", "0", "--max-running", "0"),
            *("--steps", f" {STEP_NAMES[-1]} , {STEP_NAMES[0]} "),
        ]
    )
    assert (options.prefix_len, options.threads, options.max_running) == (0, 0, 0)
    assert options.steps == (STEP_NAMES[-1], STEP_NAMES[0])  # the order given, blanks ignored
    assert cli.parse([]).steps == tuple(STEP_NAMES)
    assert cli.parse(["--steps", "all"]).steps == tuple(STEP_NAMES)


def test_the_engine_flags_are_the_front_ends_own() -> None:
    """--device, --dtype, --block-size, --total-blocks, --threads and --no-memory-check come
    from ``front.cli.add_engine_flags``: the same help as the demo's."""
    from front.cli import ENGINE_FLAGS

    actions = {a.dest: a for a in cli.build_parser()._actions}
    for dest in ("device", "block_size", "total_blocks", "threads"):
        assert actions[dest].help == ENGINE_FLAGS[dest][2], dest
    assert "no_memory_check" in actions and "seed" not in actions


# ---- --help --------------------------------------------------------------------------------------


def test_help_shows_every_default_and_no_rest_markup(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = set(re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE))
    assert len(options) >= 8
    assert text.count("(default:") == len(options), "an option without its default"
    assert "``" not in text and "`" not in text
    words = " ".join(text.split())
    for name, workload in WORKLOADS.items():
        assert f"--workload {name}" in words and f"{name}: {workload.SUMMARY}" in words


# ---- what the bench prints: the table, the header, the notes -------------------------------------


def fake_row(name: str, seconds: float, computed_prefill: int) -> Row:
    result = RunResult([[1] * 16], seconds, 4, 3, 160, 96, computed_prefill, 12)
    return Row(name, "what it fixed", [result])


def test_a_subset_is_compared_with_its_first_step(tmp_path: Path) -> None:
    rows = [fake_row("step14_6", 2.0, 64), fake_row("step14_7", 1.0, 64)]
    extra = [fake_row("step14_7 (no cache)", 1.6, 160)]
    text = table(rows, extra, FLOOR)
    assert "vs step14_6" in text and "vs step14 " not in text
    lines = text.strip().splitlines()
    assert len({len(line) for line in lines}) == 1, "columns stay aligned"
    assert [line.split("|")[5].strip() for line in lines] == [
        "vs step14_6",
        "------------:",
        "1.00x",
        "2.00x",
        "1.25x",
    ]
    options = BenchOptions("shared-prefix", "tiny", ("step14_6",), 1, str(tmp_path))
    save(options, preset("tiny"), SharedPrefix(), (rows, extra), True, Floor(10**9, 50.0))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["baseline"] == "step14_6"
    assert [r["speedup_vs_baseline"] for r in data["rows"]] == [1.0, 2.0, 1.25]
    assert [r["computed_prefill_tokens"] for r in data["rows"]] == [64, 64, 160]


def test_table_shows_computed_tokens_and_a_dash_for_hf_reuse() -> None:
    hf_result = RunResult([[1]], 1.0, computed_prefill_tokens=160, computed_decode_tokens=12)
    hf = Row("HF generate", "transformers", [hf_result])
    lines = table([fake_row("step14", 1.0, 64)], [hf], FLOOR).splitlines()
    titles = [cell.strip() for cell in lines[1].split("|")]
    reuse, computed = titles.index("prefix reuse"), titles.index("computed tokens")
    assert [lines[3].split("|")[i].strip() for i in (reuse, computed)] == ["60%", "64 + 12"]
    assert [lines[4].split("|")[i].strip() for i in (reuse, computed)] == ["-", "160 + 12"]


def test_token_check_wording() -> None:
    rows = [fake_row("step14", 1.0, 64)]
    assert check_tokens(rows, [[1] * 16]).message.endswith(
        "every row produced the same tokens as the dense reference model"
    )
    assert "reference check skipped" in check_tokens(rows, None).message
    assert not check_tokens(rows, [[2]]).ok
    other = Row("step14_7", "", [RunResult([[1] * 16], 1.0), RunResult([[2] * 16], 1.0)])
    assert not check_tokens([*rows, other], None).ok, "every run of a row is checked"


def test_header_counts_in_good_english(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    options = BenchOptions("shared-prefix", "tiny", (), 1, "unused")
    one = header(preset("tiny"), "what", options, machine_gflops=81.25)
    assert "1 thread\n" in one and "1 run per row" in one and "threads" not in one
    assert one.count("1 thread") == 1  # said once
    assert "81.2 GFLOP/s on a 1024x1024 float32 matmul" in one and "model tiny:" in one
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert "2 threads" in header(preset("tiny"), "what", options, 1.0)


def test_rows_run_in_passes_so_a_busy_moment_costs_one_run_of_each(capsys) -> None:
    """Pass after pass, every row once per pass, a warm-up before the first: a disturbance
    lands on one run of several rows, never on every run of one row."""
    order: list[str] = []

    def timing(name: str, warmup: bool = False) -> Timing:
        def run() -> RunResult:
            order.append(name)
            return RunResult([[1]], float(len(order)))

        return Timing(Row(name, ""), run, warmup)

    timings = [timing("a", warmup=True), timing("b"), timing("c")]
    measure(timings, 2, progress.Progress(enabled=False))
    assert order == ["a", "a", "b", "c", "a", "b", "c"]
    assert [t.row.seconds for t in timings] == [[2.0, 5.0], [3.0, 6.0], [4.0, 7.0]]
    assert re.findall(r"^  (\w) ", capsys.readouterr().out, re.MULTILINE) == ["a", "b", "c"]


def test_a_phase_adds_up_and_one_within_another_counts_for_itself(monkeypatch) -> None:
    from bench import rows as rows_module

    clock = iter([0.0, 1.0, 3.0, 10.0, 20.0, 21.0])  # each phase's start and end, in order
    monkeypatch.setattr(rows_module.time, "perf_counter", lambda: next(clock))
    batch = rows_module.BatchRun.__new__(rows_module.BatchRun)
    batch.seconds, batch.nested = {}, 0.0
    with batch.phase("peers"), batch.phase("runs"):  # runs 1 to 3, within peers 0 to 10
        pass
    with batch.phase("runs"):
        pass
    assert batch.seconds == {"runs": 3.0, "peers": 8.0}


def test_phases_say_how_long_and_how_to_skip_a_slow_reference() -> None:
    fast = phases({"steps": 12.34, "reference check": 2.0})
    assert fast == "time: steps 12.3 s, reference check 2.0 s"
    slow = phases({"steps": 12.0, "Hugging Face": 3.0, "reference check": 95.0})
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
    *("--new-tokens", "2", "--repeats", "2", "--no-hf", "--no-ctranslate2", "--no-reference"),
    *("--steps", STEP_NAMES[-1]),
]


@pytest.mark.parametrize("quiet", [False, True], ids=["terminal", "quiet"])
def test_bench_shows_each_row_and_its_repeats_on_a_terminal(
    quiet: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.001)
    monkeypatch.setattr(sys, "stderr", Terminal())
    real_run = BatchRunner.run

    def slow_run(self: BatchRunner, *args: object, **kwargs: object) -> object:
        """Long enough for the status line to be drawn, however busy the machine."""
        time.sleep(0.2)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "run", slow_run)
    argv = [*ARGV, "--out", str(tmp_path), *(["--quiet"] if quiet else [])]
    assert cli.main(argv) == 0
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
    runner = BatchRunner(load_step_model(STEP_NAMES[-1], preset("tiny")))
    assert runner.computed_so_far() == ""  # between runs
    runner.live = TokenWork(tokens=1234)
    assert runner.computed_so_far() == "1,234 tokens computed"


# ---- end to end, and the wiring ------------------------------------------------------------------


def test_a_tiny_subset_runs_end_to_end(tmp_path: Path, capsys) -> None:
    first, last = STEP_NAMES[-2], STEP_NAMES[-1]
    argv = "--model tiny --requests 2 --prefix-len 8 --tail-len 4 --new-tokens 2 --repeats 1"
    code = cli.main(
        [*argv.split(), "--no-hf", "--steps", f"{first},{last}", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"vs {first}" in out and "computed tokens" in out and "peak KV MiB" in out
    assert f"| {last} (warm prefix) " in out and f"| {last} (no cache) " in out
    assert "same tokens as the dense reference model" in out
    assert "max_running=2" in out  # --max-running 0: every request at once
    assert re.search(r"^time: steps \d+\.\d s, .*reference check \d+\.\d s$", out, re.MULTILINE)
    assert json.loads((tmp_path / "results.json").read_text())["baseline"] == first


def test_the_budget_goes_to_the_steps_that_take_it() -> None:
    """``--max-num-batched-tokens`` with steps before and from step14_9: only the engines of
    the steps that take it get it; the others run as they are."""
    from bench.models import load_step_model

    options = cli.parse(["--steps", "step14_8,step14_9", "--max-num-batched-tokens", "64"])
    cfg = preset("tiny")
    assert load_step_model("step14_8", cfg, options=options).engine_args == {}
    model = load_step_model("step14_9", cfg, options=options)
    assert model.engine(max_running=4).max_num_batched_tokens == 64


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


def imported_modules(path: Path) -> set[str]:
    """Every module a file of ``bench/`` imports, relative imports resolved."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


SHARED = sorted(p for p in (ROOT / "bench").rglob("*.py") if p.parent.name in ("bench", "peers"))


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(ROOT / "bench")))
def test_the_shared_pieces_import_no_workload(path: Path) -> None:
    """The command line reads the workloads, the workloads use the shared pieces (models,
    reference, cells, costs, peers, the report): never the other way round."""
    if path.name in ("cli.py", "__main__.py"):
        return
    upward = {n for n in imported_modules(path) if n.startswith(("bench.workloads", "bench.cli"))}
    assert not upward, upward
