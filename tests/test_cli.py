"""The command lines: ``python -m bench`` and every step's ``python -m <step>.run``.

A bad value of any flag must end in one argparse ``error:`` line and exit status 2 before any
work starts (no model built, nothing printed on stdout), and ``--help`` must show every default.
The parsers are called in-process; one subprocess checks the real ``python -m bench`` wiring.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import report, showcase
from bench.harness import RunResult, Workload
from common.config import preset
from common.front import demo
from tests.helpers import STEP_NAMES

ROOT = Path(__file__).resolve().parent.parent
DEMO = importlib.import_module(f"{STEP_NAMES[0]}.run")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave like a CPU-only torch even on a machine with a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the showcase gets as far as building a step's engine."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(showcase, "StepRunner", refuse)
    monkeypatch.setattr(demo, "load_step", refuse)


def expect_usage_error(main, argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run ``main(argv)``; it must exit 2 with one ``error:`` line and print nothing on stdout.
    Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", "nothing may run before the flags are checked"
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    return errors[0]


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
    line = expect_usage_error(showcase.main, argv, capsys)
    assert line.startswith("python -m bench: error:") and message in line, line


@pytest.mark.usefixtures("no_work", "no_cuda")
def test_bench_refuses_cuda_on_a_torch_without_it(capsys) -> None:
    line = expect_usage_error(showcase.main, ["--device", "cuda"], capsys)
    assert "argument --device: 'cuda': torch" in line and "cannot use CUDA" in line


@pytest.mark.usefixtures("no_work")
def test_bench_refuses_an_out_that_is_a_file(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    line = expect_usage_error(showcase.main, ["--out", str(a_file)], capsys)
    assert "is not a folder" in line


@pytest.mark.usefixtures("no_work")
def test_bench_model_directory_needs_a_config_json(tmp_path, capsys) -> None:
    """A folder that is not a checkpoint is refused by the --model type, before any work (a
    real checkpoint runs: tests/test_checkpoint.py)."""
    line = expect_usage_error(showcase.main, ["--model", str(tmp_path)], capsys)
    assert "is neither a preset" in line and "no config.json" in line


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


def demo_errors() -> list[tuple[list[str], str]]:
    return [
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["--block-size", "0"], "argument --block-size: must be >= 1"),
        (["--total-blocks", "-1"], "argument --total-blocks: must be >= 1"),
        (
            ["--total-blocks", "3"],
            "--total-blocks 3 is too small: the longest demo request needs 5",
        ),
        (["--max-running", "0"], "argument --max-running: must be >= 1"),
        (["--seed", "-1"], "argument --seed: must be >= 0"),
        (["--seed", str(2**64)], "argument --seed: must be <= 9223372036854775807"),
        (["--threads", "-2"], "argument --threads: must be >= 0"),
        (["--dtype", "half"], "argument --dtype: 'half' is not a dtype"),
        (["--device", "gpu"], "argument --device: 'gpu' is not a device"),
        (["--system", "You are brief."], "--system and --prompt need --model DIR"),
        (["--prompt", "Hello"], "--system and --prompt need --model DIR"),
        (["--model", "meta-llama/Llama-3.2-1B"], "is not a checkpoint directory"),
    ]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(("argv", "message"), demo_errors(), ids=lambda v: str(v))
def test_demo_refuses_a_bad_value(argv: list[str], message: str, capsys) -> None:
    line = expect_usage_error(DEMO.main, argv, capsys)
    assert line.startswith(f"python -m {STEP_NAMES[0]}.run: error:") and message in line, line


@pytest.mark.usefixtures("no_work", "no_cuda")
def test_demo_refuses_cuda_on_a_torch_without_it(capsys) -> None:
    line = expect_usage_error(DEMO.main, ["--device", "cuda"], capsys)
    assert "cannot use CUDA" in line


def test_demo_pool_just_big_enough_is_accepted() -> None:
    need = demo.blocks_for_longest_request(16, 16)
    assert demo.parse_args(STEP_NAMES[0], ["--total-blocks", str(need)]).total_blocks == need


def help_text(main, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("which", ["bench", "demo"])
def test_help_shows_every_default_and_no_rest_markup(which: str, capsys) -> None:
    text = help_text(showcase.main if which == "bench" else DEMO.main, capsys)
    options = set(re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE))
    assert len(options) >= 8
    assert text.count("(default:") == len(options), "an option without its default"
    assert "``" not in text and "`" not in text


def test_demo_help_names_the_chapter(capsys) -> None:
    text = help_text(DEMO.main, capsys)
    assert 'the chapter "Paged Prefix Cache"' in text and "prefix cache" in text


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
