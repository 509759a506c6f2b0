"""Guards before the work: memory, the context length, Ctrl-C, and the small refusals.

Each guard must answer before any slow step, with one line and a non-zero status from the
command lines, or a clear exception from the API that changed nothing. The memory guard is
tried on a simulated small machine (``available_bytes`` patched), so no test needs the memory
it refuses. Ctrl-C is a real SIGINT sent to a running command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench import cli as bench_cli
from bench.workloads.shared_prefix import SharedPrefix
from common import memory
from common.errors import ContextLengthError, RequestError, ResourceError
from front import demo
from front.main import main
from tests.helpers import ROOT, STEP_NAMES, tiny_config, usage_error

MIB = 2**20


@pytest.fixture
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with 1 MiB available, whatever this one has (the check is on)."""
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda device: MIB)


# ---- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg", [tiny_config(), tiny_config(num_kv_heads=2, tie_word_embeddings=True)]
)
def test_the_check_counts_what_the_model_allocates(step: ModuleType, cfg) -> None:
    """The figures compared with the memory are the model's own: its parameters' bytes and its
    KV pool's, in every step, with grouped-query attention and tied embeddings too."""
    model = step.TinyTransformerPaged(cfg)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert memory.weight_bytes(cfg) == sum(params.values())
    pools = model.kv_pool_k.nbytes + model.kv_pool_v.nbytes
    assert memory.kv_pool_bytes(cfg) == pools


def test_a_model_the_machine_cannot_hold_is_refused(step: ModuleType, small_machine) -> None:
    with pytest.raises(ResourceError) as info:
        step.TinyTransformerPaged(tiny_config(total_blocks=4096))
    message = str(info.value)
    assert "the KV pool (4,096 blocks of 4 tokens)" in message and "the weights" in message
    assert "1.0 MiB available" in message and "--total-blocks" in message
    assert isinstance(info.value, MemoryError)


def test_the_check_can_be_skipped(step: ModuleType, small_machine, monkeypatch) -> None:
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    step.TinyTransformerPaged(tiny_config())  # no error: the user knows better


def test_a_checkpoint_whose_weights_do_not_fit_is_refused_before_any_is_read(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A machine that holds the KV pool but not the weights too: ``from_pretrained`` refuses
    before a weight is read (``read_safetensors``, what the loading path calls, would fail
    the test), and the command line says it in one line."""
    import common.checkpoint

    step_name = STEP_NAMES[-1]
    cfg = common.checkpoint.checkpoint_config(toy_checkpoint, total_blocks=64)
    room = memory.kv_pool_bytes(cfg) + memory.weight_bytes(cfg) // 2  # the pool fits alone
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda device: room)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a weight was read before the memory check")

    monkeypatch.setattr(common.checkpoint, "read_safetensors", never)
    step = __import__(step_name)
    with pytest.raises(ResourceError, match="not enough memory") as refused:
        step.TinyTransformerPaged.from_pretrained(toy_checkpoint, config=cfg)
    assert "the weights" in str(refused.value)
    argv = ["--model", str(toy_checkpoint), "--total-blocks", "64", "--prompt", "the"]
    assert main(step_name, argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not enough memory" in err and "the weights" in err


def test_the_bench_refuses_before_it_draws_a_prompt(small_machine, monkeypatch, capsys) -> None:
    """A workload the machine cannot hold is one error line, before the prompts are drawn (a
    100-million-token prefix once took four minutes to draw, then died in torch)."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the prompts were drawn before the memory check")

    monkeypatch.setattr(SharedPrefix, "prompts", never)
    assert bench_cli.main(["--no-hf", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench: error: not enough memory")
    assert "the prompts" in err[0] and "the KV pool" in err[0]


def run_command(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != memory.SKIP_ENV}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--prefix-len", "100000000", "--no-reference", "--repeats", "1"],
        [f"{STEP_NAMES[0]}.run", "--total-blocks", "100000000"],
    ],
    ids=["bench-prefix", "demo-pool"],
)
def test_a_size_no_machine_holds_is_one_line(args: list[str], tmp_path: Path) -> None:
    """The real commands, on this machine: 13 TB of KV is refused at once, in one line."""
    done = run_command([*args, *(["--out", str(tmp_path)] if args[0] == "bench" else [])])
    assert done.returncode == 1, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "error: not enough memory" in err[0] and "Traceback" not in err[0]
    assert not list(tmp_path.iterdir())


def test_no_memory_check_flag_sets_the_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    options = demo.read_options(demo.build_parser("run"), ["--no-memory-check"])
    assert options.engine.no_memory_check and os.environ[memory.SKIP_ENV] == "1"


# ---- the context length ---------------------------------------------------------------------


def test_a_request_past_the_context_length_is_refused(step: ModuleType) -> None:
    """prompt + max_new_tokens beyond ``max_model_len`` is refused at ``add_request``, naming
    the context length, and the engine is untouched; at the limit it is accepted."""
    cfg = tiny_config(max_model_len=20)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg))
    with pytest.raises(RequestError, match="context length of 20 tokens"):
        engine.add_request(list(range(1, 11)), 11)
    assert not engine.has_work
    engine.add_request(list(range(1, 11)), 10)
    assert engine.has_work


@pytest.mark.parametrize(
    ("limits", "source"),
    [
        ({"max_model_len": 20}, "set by the caller"),
        ({"max_model_len": 20, "max_position_embeddings": 20}, "checkpoint's max_position"),
        ({"max_model_len": 20, "max_position_embeddings": 16}, "trained on 16 positions"),
    ],
)
def test_the_context_length_error_carries_its_numbers_and_its_source(
    step: ModuleType, limits: dict[str, int], source: str
) -> None:
    """A ``ContextLengthError`` of its own kind (a server answers it without reading text):
    the prompt, the tokens asked for and the limit, and a message that says where the limit
    came from: the checkpoint, or a ``max_model_len`` raised (or set) by the caller."""
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(tiny_config(**limits)))
    with pytest.raises(ContextLengthError, match=source) as info:
        engine.add_request(list(range(1, 16)), 6)
    error = info.value
    assert (error.prompt_tokens, error.max_tokens, error.max_model_len) == (15, 6, 20)
    assert error.param == "max_new_tokens" and "21" in str(error)


def test_the_checkpoint_sets_the_context_length_and_it_can_be_raised(toy_checkpoint) -> None:
    from common.checkpoint import checkpoint_config, max_position_embeddings

    limit = max_position_embeddings(toy_checkpoint)
    assert checkpoint_config(toy_checkpoint).max_model_len == limit
    assert checkpoint_config(toy_checkpoint, max_model_len=limit * 4).max_model_len == limit * 4


def test_run_refuses_past_the_context_length_and_the_flag_allows_it(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """``--max-new-tokens`` past the checkpoint's positions: refused, and the message names the
    context length before the pool; ``--max-model-len`` lets it run. The checkpoint is the toy
    one trained on 64 positions, so that running past them takes a moment on any machine."""
    from common.checkpoint import max_position_embeddings

    short = shutil.copytree(toy_checkpoint, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    limit = max_position_embeddings(short)
    assert limit == 64
    base = [f"{STEP_NAMES[-1]}.run", "--model", str(short), "--prompt", "water boils at"]
    base += ["--max-new-tokens", str(limit), "--total-blocks", str(limit)]
    refused = run_command(base)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "context length of" in line and "--max-model-len" in line
    allowed = run_command([*base, "--max-model-len", str(2 * limit)])
    assert allowed.returncode == 0, allowed.stderr


# ---- Ctrl-C ---------------------------------------------------------------------------------


ENDED_BY_SIGINT = -signal.SIGINT  # subprocess says -2; a shell, 128 + 2 = 130


def interrupt(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Start ``python -m args``, send SIGINT once it has printed its first line (it is at
    work), and collect what it printed."""
    env = {k: v for k, v in os.environ.items() if k != memory.SKIP_ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = process.stdout.readline()
    assert first, "it printed nothing"
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(args, process.returncode, first + out, err)


def test_ctrl_c_ends_the_bench_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = interrupt(["bench", "--no-hf", "--requests", "64", "--out", str(out)])
    assert done.returncode == ENDED_BY_SIGINT
    assert done.stderr.strip().splitlines() == ["python -m bench: interrupted"]
    assert not out.exists()


def test_ctrl_c_ends_the_demo_with_one_line() -> None:
    done = interrupt([f"{STEP_NAMES[0]}.run", "--max-new-tokens", "64"])
    assert done.returncode == ENDED_BY_SIGINT
    assert done.stderr.strip().splitlines() == [f"python -m {STEP_NAMES[0]}.run: interrupted"]


# ---- the small refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace-round", "small-pool"], "--trace-round chooses what --trace or --trace-png"),
        (["--dtype", "auto"], "--dtype auto needs --model DIR"),
    ],
    ids=["trace-round-alone", "dtype-auto-without-model"],
)
def test_a_flag_that_would_do_nothing_is_refused(argv: list[str], message: str, capsys) -> None:
    run = __import__(f"{STEP_NAMES[0]}.run").run
    line = usage_error(run.main, argv, capsys)
    assert message in line, line


def test_trace_round_with_a_checkpoint_is_refused(toy_checkpoint: Path, capsys) -> None:
    run = __import__(f"{STEP_NAMES[0]}.run").run
    argv = ["--model", str(toy_checkpoint), "--trace", "--trace-round", "small-pool"]
    line = usage_error(run.main, argv, capsys)
    assert "--trace-round is for the demo's own requests: it does not go with --model" in line


def test_bench_dtype_auto_needs_a_checkpoint(capsys) -> None:
    line = usage_error(bench_cli.main, ["--dtype", "auto"], capsys)
    assert "--dtype auto needs --model DIR" in line


def test_run_without_a_prompt_says_what_it_completes(toy_checkpoint: Path) -> None:
    done = run_command([f"{STEP_NAMES[-1]}.run", "--model", str(toy_checkpoint)])
    assert done.returncode == 0, done.stderr
    assert "no --prompt given: completing 'The capital of France is'" in done.stdout


def test_dtype_auto_runs_a_checkpoint_in_its_stored_dtype(toy_checkpoint: Path) -> None:
    done = run_command(
        [
            f"{STEP_NAMES[-1]}.run",
            "--model",
            str(toy_checkpoint),
            "--dtype",
            "auto",
            "--prompt",
            "the",
        ]
    )
    assert done.returncode == 0, done.stderr
    assert "float32" in done.stdout  # toy_checkpoint is stored in float32


def test_a_truncated_weight_file_says_to_fetch_it_again(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    import shutil

    from common.checkpoint import load_checkpoint
    from common.errors import CheckpointError

    folder = tmp_path / "cut"
    shutil.copytree(toy_checkpoint, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"damaged or incomplete.*fetch it again"):
        load_checkpoint(folder)


def test_a_trace_png_that_cannot_be_written_says_why(tmp_path: Path, capsys) -> None:
    """The refusal carries the system's reason, as ``--out`` does. (As root a read-only folder
    is still writable, so there the target is in ``/proc``, where nobody may create a file.)"""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        target, reason = folder / "pool.png", "Permission denied"
    elif Path("/proc/self").is_dir():
        target, reason = Path("/proc/pool.png"), os.strerror(2)
    else:
        pytest.skip("no folder here refuses root a new file")
    run = __import__(f"{STEP_NAMES[0]}.run").run
    line = usage_error(run.main, ["--trace-png", str(target)], capsys)
    assert f"cannot write there ({reason})" in line


def test_generate_text_uses_one_thread_by_default(toy_checkpoint: Path) -> None:
    from front.options import EngineOptions
    from front.text import TextOptions, generate_text

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        generate_text(STEP_NAMES[-1], toy_checkpoint, ["the"], TextOptions(max_new_tokens=2))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        torch_default = TextOptions(max_new_tokens=2, engine=EngineOptions(threads=0))
        generate_text(STEP_NAMES[-1], toy_checkpoint, ["the"], torch_default)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
