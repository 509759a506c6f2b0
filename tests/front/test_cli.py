"""The command lines: every step's ``python -m <step>.run`` (the demo, and the text front end
with ``--model DIR``), and what they print (``python -m bench``'s own flags and table are in
``tests/bench/test_bench_cli.py``).

- A bad value of any flag ends in argparse's form: one ``error:`` line, the last on stderr,
  exit status 2, before any work starts (no model built, nothing on stdout). Integer flags
  refuse ``2.5``, ``1e3``, ``inf`` and ``nan``.
- ``--help`` shows every default, in plain text.
- The banner's KV sizes, by hand.
- The text front end says "1 token", and says why a system prompt shorter than one block
  cannot hit.
- The wiring: a step that runs without the bench package, and the commands the README and docs
  show (the bench's too) printing no warning.

The parsers are called in-process; subprocesses check the real entry points. A checkpoint
served through ``--model DIR`` is in ``tests/core/test_checkpoint.py``; a checkpoint or request a
command cannot serve (one ``error:`` line, exit 1) is in ``tests/front/test_bad_input.py``.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.cli import main as bench_main
from common.config import ModelConfig, preset
from front import demo, main, text_cli
from front.cli import plural
from front.text import short_prefix_note
from front.text_cli import describe
from tests.helpers import NOT_INTEGERS, STEP_NAMES, edit_json, run_python, usage_error

ROOT = Path(__file__).resolve().parents[2]
FIRST_RUN = importlib.import_module(f"{STEP_NAMES[0]}.run")
LAST_RUN = importlib.import_module(f"{STEP_NAMES[-1]}.run")


DEMO_INT_FLAGS = [
    "--block-size",
    "--total-blocks",
    "--max-new-tokens",
    "--max-running",
    "--seed",
    "--threads",
]


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
    mains = {"bench": bench_main, "demo": FIRST_RUN.main}
    text_main = lambda argv: FIRST_RUN.main(["--model", str(toy_checkpoint), *argv])  # noqa: E731
    text = help_text(mains.get(which, text_main), capsys)
    options = set(re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE))
    assert len(options) >= 8
    assert text.count("(default:") == len(options), "an option without its default"
    assert "``" not in text and "`" not in text


def test_demo_help_names_the_chapter(capsys) -> None:
    text = help_text(FIRST_RUN.main, capsys)
    assert 'the chapter "Paged Prefix Cache"' in text and "prefix cache" in text


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
    from front.hf import hf_llama
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
    imported = imported_modules(ROOT / "front" / "demo.py")
    assert not {"text", "text_cli", "stream", "chat"} & {name.split(".")[-1] for name in imported}


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
    """Every module a file imports (the module of a relative import as written)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = f"bench.{node.module or ''}".rstrip(".") if node.level else node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


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


# ---- an engine flag that only later steps take -------------------------------------------------


@pytest.mark.usefixtures("no_work")
def test_a_flag_of_a_later_steps_engine_is_refused_by_name(capsys) -> None:
    """``--max-num-batched-tokens`` before step14_9 (whose engine has no budget) is one error
    line that names the step it needs; from step14_9 on, one too small for ``--max-running``
    is refused with the core's rule, before anything loads."""
    earlier = importlib.import_module("step14_8.run")
    line = usage_error(earlier.main, ["--max-num-batched-tokens", "64"], capsys)
    assert "--max-num-batched-tokens needs step14_9 or later" in line, line
    if "step14_9" not in STEP_NAMES:
        return
    later = importlib.import_module("step14_9.run")
    line = usage_error(later.main, ["--max-num-batched-tokens", "18"], capsys)
    assert "max_num_batched_tokens must be an int >= block_size + max_running - 1 = 19" in line
    line = usage_error(later.main, ["--max-num-batched-tokens", "0"], capsys)
    assert "argument --max-num-batched-tokens: must be >= 1, got 0" in line


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-offloading-backend", "tape:x"], "unknown KV offloading backend 'tape:x'"),
        (["--kv-offloading-backend", "disk:"], "'disk:' needs a folder"),
        (["--kv-offloading-backend", "redis://h:1", "--kv-offloading-size", "2"], "takes no size"),
        (["--kv-offloading-size", "0"], "--kv-offloading-size: must be a number above 0"),
        (["--kv-offloading-size", "nan"], "--kv-offloading-size: must be a number above 0"),
    ],
)
def test_a_second_tier_the_step_cannot_use_is_one_line(argv: list[str], says: str, capsys) -> None:
    """step14_10's tier flags, refused before anything loads: by step14_9 (no tier), and by
    step14_10 when the tier cannot be (checked without opening it)."""
    earlier = importlib.import_module("step14_9.run")
    line = usage_error(earlier.main, ["--kv-offloading-size", "1"], capsys)
    assert "--kv-offloading-size needs step14_10 or later" in line, line
    line = usage_error(importlib.import_module("step14_10.run").main, argv, capsys)
    assert says in line, line


def test_the_budget_is_checked_once_and_reaches_the_engine_a_command_builds(
    llama32_style: Path,
) -> None:
    """The options' one check (``EngineOptions.refused_by``, where a command reads its flags
    and where ``generate_text`` takes them) refuses the flag, as a one-line user error, for an
    engine that does not take it, and a budget too small; the engine builder trusts the
    options and hands the flag to the engines that take it."""
    from common.errors import UserError
    from front.build import EngineBuilder, ModelSource
    from front.options import EngineOptions
    from front.text import TextOptions, generate_text

    options = EngineOptions(block_size=4, total_blocks=16, max_num_batched_tokens=40)
    with pytest.raises(UserError, match="needs step14_9 or later: step14_8's engine"):
        options.check_step("step14_8")
    with pytest.raises(UserError, match="needs step14_9 or later: step14_8's engine"):
        generate_text("step14_8", llama32_style, ["Hi"], TextOptions(engine=options))
    source = ModelSource.open("tiny", options)
    assert not hasattr(EngineBuilder("step14_8", source, options)(), "max_num_batched_tokens")
    if "step14_9" in STEP_NAMES:
        small = EngineOptions(block_size=4, max_num_batched_tokens=10)  # 4 + 8 - 1 = 11 at least
        assert "block_size + max_running - 1 = 11" in (small.refused_by("step14_9") or "")
        assert options.refused_by("step14_9") is None
        assert EngineBuilder("step14_9", source, options)().max_num_batched_tokens == 40
        default = EngineBuilder("step14_9", source, EngineOptions(block_size=4))()
        assert default.max_num_batched_tokens == 512
