"""A user's mistake ends in one line, not a traceback; and it ends before the slow part.

Every checkpoint or request problem a new user meets goes through the real command
(``python -m step14_7.run --model DIR ...`` and ``python -m bench --model DIR ...``, each in
a subprocess): the command must exit non-zero, print nothing on stdout, and print exactly one
line on stderr, ``<prog>: error: <what is wrong and what to do>``, with no ``Traceback``.
A bad flag keeps argparse's form (usage, then one ``error:`` line, exit 2).

What can be checked without the weights is checked before they are read: a missing
tokenizer.json or an unwritable ``--out`` fails in well under a second, however big the model
(timed in-process, where the interpreter's own start-up does not count; the model load is
also made to fail loudly, so "before" cannot mean "fast enough on a small model").

Last, the commands that the README and docs show print no warning, from torch, transformers
or anywhere else (``python -W error::UserWarning`` turns a Python warning into a failure;
transformers' logged warnings are caught by requiring an empty stderr).
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = "step14_7.run"
SUBPROCESS_TIMEOUT_S = 300


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def variant(base: Path, root: Path, name: str, edit: Callable[[Path], None]) -> Path:
    """A copy of checkpoint ``base`` with one thing wrong."""
    folder = root / name
    shutil.copytree(base, folder)
    edit(folder)
    return folder


def only_pytorch_bin(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"a pickle, never opened")


def garbage_weights_no_tokenizer(folder: Path) -> None:
    """No tokenizer.json, and weights that cannot be read: the tokenizer must be the error,
    which proves it is looked for before any weight."""
    (folder / "tokenizer.json").unlink()
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")


BROKEN: dict[str, Callable[[Path], None]] = {
    "pytorch-bin-only": only_pytorch_bin,
    "qwen2": lambda f: edit_config(f, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "mistral": lambda f: edit_config(
        f, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096
    ),
    "sliding-window": lambda f: edit_config(f, sliding_window=4096),
    "no-tokenizer": lambda f: (f / "tokenizer.json").unlink(),
    "no-tokenizer-bad-weights": garbage_weights_no_tokenizer,
    "wrong-shapes": lambda f: edit_config(f, num_key_value_heads=4),  # stored: 2 KV heads
    "broken-config": lambda f: (f / "config.json").write_text('{"vocab_size": 320,'),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A sound checkpoint (byte-level BPE tokenizer that adds no BOS, as GPT-2's, chat
    template, GQA, tied embeddings, llama3 RoPE) and one broken copy per entry of BROKEN."""
    chat = pytest.importorskip("tests.test_chat_template")
    root = tmp_path_factory.mktemp("user-errors")
    sound = chat.save_chat_checkpoint(root / "sound", add_bos=False)
    folders = {"sound": sound}
    for name, edit in BROKEN.items():
        folders[name] = variant(sound, root, name, edit)
    return folders


# (case id, module, argv with {NAME} for a checkpoint folder, words the error line must hold)
CASES: list[tuple[str, str, list[str], list[str]]] = [
    ("run-bin-only", RUN, ["--model", "{pytorch-bin-only}"], ["pytorch_model.bin", "convert"]),
    ("run-qwen2", RUN, ["--model", "{qwen2}"], ["model_type='qwen2'", "llama"]),
    ("run-mistral", RUN, ["--model", "{mistral}"], ["model_type='mistral'"]),
    ("run-sliding-window", RUN, ["--model", "{sliding-window}"], ["sliding_window=4096"]),
    ("run-no-tokenizer", RUN, ["--model", "{no-tokenizer}"], ["tokenizer.json"]),
    (
        "run-no-tokenizer-bad-weights",
        RUN,
        ["--model", "{no-tokenizer-bad-weights}"],
        ["tokenizer.json"],
    ),
    ("run-wrong-shapes", RUN, ["--model", "{wrong-shapes}"], ["k_proj.weight has shape"]),
    ("run-broken-config", RUN, ["--model", "{broken-config}"], ["config.json", "not valid JSON"]),
    (
        "run-prompt-longer-than-pool",
        RUN,
        ["--model", "{sound}", "--block-size", "4", "--total-blocks", "3"],
        ["prompt 1", "KV blocks", "--total-blocks"],
    ),
    (
        "run-new-tokens-beyond-pool",
        RUN,
        ["--model", "{sound}", "--max-new-tokens", "100000"],
        ["100000 new tokens", "--max-new-tokens"],
    ),
    (
        "run-empty-prompt-no-bos",
        RUN,
        ["--model", "{sound}", "--prompt", "", "--no-chat-template"],
        ["prompt 1 ('')", "empty", "no BOS"],
    ),
    ("bench-bin-only", "bench", ["--model", "{pytorch-bin-only}"], ["pytorch_model.bin"]),
    ("bench-qwen2", "bench", ["--model", "{qwen2}"], ["model_type='qwen2'"]),
    ("bench-mistral", "bench", ["--model", "{mistral}"], ["model_type='mistral'"]),
    ("bench-sliding-window", "bench", ["--model", "{sliding-window}"], ["sliding_window=4096"]),
    ("bench-wrong-shapes", "bench", ["--model", "{wrong-shapes}"], ["k_proj.weight has shape"]),
    ("bench-broken-config", "bench", ["--model", "{broken-config}"], ["not valid JSON"]),
]


def run_command(module: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def outcomes(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's command, run a few at a time (each mostly waits for its imports)."""
    out = tmp_path_factory.mktemp("bench-out")

    def one(case: tuple[str, str, list[str], list[str]]) -> subprocess.CompletedProcess[str]:
        _, module, argv, _ = case
        words = [checkpoints[a[1:-1]].as_posix() if a.startswith("{") else a for a in argv]
        if module == "bench":
            words += ["--out", str(out), "--repeats", "1", "--no-reference"]
        return run_command(module, words)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = list(pool.map(one, CASES))
    return {case[0]: result for case, result in zip(CASES, done)}


def assert_one_error_line(proc: subprocess.CompletedProcess[str], prog: str) -> str:
    """Non-zero exit, nothing on stdout, one stderr line in argparse's form, no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode != 0
    assert proc.stdout == "", "nothing may be printed before the problem is found"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("name", "module", "words"),
    [(name, module, words) for name, module, _, words in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_user_error_is_one_line(
    outcomes: dict[str, subprocess.CompletedProcess[str]], name: str, module: str, words: list[str]
) -> None:
    prog = "python -m bench" if module == "bench" else f"python -m {module}"
    line = assert_one_error_line(outcomes[name], prog)
    assert outcomes[name].returncode == 1
    for word in words:
        assert word in line, line


def test_template_refusal_is_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A template that refuses a system message (as Gemma's do) says so and how to do
    without."""
    folder = variant(checkpoints["sound"], tmp_path, "no-system", lambda f: None)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    proc = run_command(RUN, ["--model", str(folder), "--system", "Be brief.", "--prompt", "hi"])
    line = assert_one_error_line(proc, f"python -m {RUN}")
    assert "System role not supported" in line and "--no-chat-template" in line


@pytest.mark.parametrize(
    ("out", "words"),
    [("/proc/bench-results", "cannot write in /proc"), ("{file}/results", "is not a folder")],
    ids=["unwritable", "under-a-file"],
)
def test_bench_refuses_an_unusable_out_folder(tmp_path: Path, out: str, words: str) -> None:
    """A flag problem: argparse's usage, then one ``error:`` line, exit 2, no traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = run_command("bench", ["--out", out.replace("{file}", str(a_file))])
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == proc.stderr.splitlines()[-1]
    assert "argument --out" in errors[0] and words in errors[0], errors[0]


# ---- before the slow part ---------------------------------------------------------------------


def test_bad_out_fails_before_any_work(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from bench import showcase

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


def test_missing_tokenizer_fails_before_the_weights_load(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run = importlib.import_module(RUN)
    step = importlib.import_module(RUN.split(".")[0])

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before tokenizer.json was looked for")

    monkeypatch.setattr(step.TinyTransformerPaged, "from_pretrained", refuse)
    start = time.perf_counter()
    code = run.main(["--model", str(checkpoints["no-tokenizer-bad-weights"])])
    assert time.perf_counter() - start < 1.0
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "tokenizer.json" in captured.err


def test_requests_are_checked_before_the_weights_load(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run = importlib.import_module(RUN)
    step = importlib.import_module(RUN.split(".")[0])

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the requests were checked")

    monkeypatch.setattr(step.TinyTransformerPaged, "from_pretrained", refuse)
    argv = ["--model", str(checkpoints["sound"]), "--max-new-tokens", "100000"]
    assert run.main(argv) == 1
    assert "--max-new-tokens" in capsys.readouterr().err


def test_a_real_bug_keeps_its_traceback(checkpoints: dict[str, Path], monkeypatch) -> None:
    """Only user errors are shortened: anything else is a bug, and its traceback is kept."""
    run = importlib.import_module(RUN)
    step = importlib.import_module(RUN.split(".")[0])

    def bug(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(step.TinyTransformerPaged, "from_pretrained", bug)
    with pytest.raises(KeyError):
        run.main(["--model", str(checkpoints["sound"]), "--max-new-tokens", "2"])


# ---- no warnings --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama32_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3.2's RoPE (llama3 scaling of an 8192-token original context, 32x, declared
    max_position_embeddings 131072), bf16 weights and eos [<|im_end|>, <|endoftext|>]."""
    chat = pytest.importorskip("tests.test_chat_template")
    from common.config import Llama3RopeScaling

    folder = tmp_path_factory.mktemp("llama32") / "ckpt"
    chat.save_chat_checkpoint(folder, rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192))
    edit_config(folder, max_position_embeddings=131072, eos_token_id=[2, 0], dtype="bfloat16")
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
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
