"""Bad input: refused with a message that says what is wrong, and nothing changed or started.

**The engine's API** (``add_request``, ``generate``, ``generate_serial``): a clear ValueError
at the door, and an engine left exactly as it was. The design lists what must be refused
(empty prompt, ids outside the vocabulary, non-integer ids, max_new_tokens < 1, a request the
whole pool could not hold) and promises the engine's state is untouched. Each bad input is
tried through all three on an engine that is mid-life (warm cache, one request queued), then
the engine is compared with a twin that never saw the bad input.

**The commands** (``python -m step14_7.run --model DIR ...`` and ``python -m bench --model DIR
...``, each in a subprocess): every checkpoint or request problem a new user meets ends in one
line, not a traceback. The command must exit 1, print nothing on stdout, and print exactly one
line on stderr, ``<prog>: error: <what is wrong and what to do>``; only a real bug keeps its
traceback. What can be checked without the weights is checked before they are read: a missing
tokenizer.json fails in well under a second, however big the model (timed in-process, where the
interpreter's own start-up does not count; the model load is also made to fail loudly, so
"before" cannot mean "fast enough on a small model"), and so does a request the pool cannot
hold.

A bad flag value (argparse's usage, one ``error:`` line, exit 2) is in ``tests/front/test_cli.py``;
the checkpoint loader's refusals, called in-process, in ``tests/core/test_checkpoint.py``.
"""

from __future__ import annotations

import importlib
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.errors import RequestError
from common.sampling_params import SamplingParams
from tests.helpers import EngineFactory, edit_json, reference_tokens, run_python, tiny_config

# ---- the engine's API: refused at the door, nothing changed --------------------------------------


BLOCK_SIZE = 4
TOTAL_BLOCKS = 8  # the pool holds 32 token slots: a request of 33 can never run
CFG = tiny_config(block_size=BLOCK_SIZE, total_blocks=TOTAL_BLOCKS)
VOCAB = CFG.vocab_size
MAX_NEW = 2


_rng = random.Random(7)
GOOD = [_rng.randrange(VOCAB) for _ in range(9)]
WARMUP = [[*GOOD[:8], _rng.randrange(VOCAB)]]
QUEUED = [*GOOD[:4], *(_rng.randrange(VOCAB) for _ in range(2))]


@dataclass(frozen=True)
class BadRequest:
    """``add_request`` arguments that must be refused."""

    prompt: object
    max_new_tokens: object = MAX_NEW
    eos_token_id: object = None
    sampling_params: object = None


BAD_REQUESTS: dict[str, BadRequest] = {
    "empty-list": BadRequest([]),
    "empty-tuple": BadRequest(()),
    "empty-tensor": BadRequest(torch.tensor([], dtype=torch.long)),
    "negative-id": BadRequest([1, -1, 2]),
    "id-equals-vocab": BadRequest([1, VOCAB, 2]),
    "id-far-above-vocab": BadRequest([10**20]),
    "float-ids": BadRequest([1.0, 2.0]),
    "fractional-id": BadRequest([1, 2.5]),
    "string-ids": BadRequest(["1", "2"]),
    "none-id": BadRequest([1, None]),
    "bool-ids": BadRequest([True, False]),
    "float-tensor": BadRequest(torch.tensor([1.0, 2.0])),
    "2d-tensor": BadRequest(torch.tensor([[1, 2], [3, 4]])),
    "string-prompt": BadRequest("hello"),
    "bytes-prompt": BadRequest(b"\x01\x02"),
    "none-prompt": BadRequest(None),
    "int-prompt": BadRequest(5),
    "max-new-zero": BadRequest([1, 2], max_new_tokens=0),
    "max-new-negative": BadRequest([1, 2], max_new_tokens=-3),
    "max-new-float": BadRequest([1, 2], max_new_tokens=2.0),
    "max-new-string": BadRequest([1, 2], max_new_tokens="2"),
    "max-new-none": BadRequest([1, 2], max_new_tokens=None),
    "eos-negative": BadRequest([1, 2], eos_token_id=-1),
    "eos-equals-vocab": BadRequest([1, 2], eos_token_id=VOCAB),
    "eos-float": BadRequest([1, 2], eos_token_id=1.0),
    "too-long-prompt": BadRequest([1] * (TOTAL_BLOCKS * BLOCK_SIZE + 1), max_new_tokens=1),
    "too-many-new-tokens": BadRequest([1, 2], max_new_tokens=TOTAL_BLOCKS * BLOCK_SIZE),
    "sampling-params-dict": BadRequest([1, 2], None, sampling_params={"temperature": 1.0}),
    "sampling-and-max-new": BadRequest([1, 2], sampling_params=SamplingParams(max_tokens=2)),
    "stop-id-equals-vocab": BadRequest(
        [1, 2], None, sampling_params=SamplingParams(max_tokens=2, stop_token_ids=[VOCAB])
    ),
    "too-many-sampled-tokens": BadRequest(
        [1, 2], None, sampling_params=SamplingParams(max_tokens=TOTAL_BLOCKS * BLOCK_SIZE)
    ),
}
TOO_BIG = ("too-long-prompt", "too-many-new-tokens")
# The argument each refusal names in ``RequestError.param`` (a server maps it to its field).
PARAM_OF = {
    **dict.fromkeys(
        [case for case in BAD_REQUESTS if case.startswith(("max-new", "too-many"))],
        "max_new_tokens",
    ),
    **dict.fromkeys([case for case in BAD_REQUESTS if case.startswith("eos-")], "eos_token_id"),
    "sampling-params-dict": "sampling_params",
    "sampling-and-max-new": "max_new_tokens",
    "stop-id-equals-vocab": "stop_token_ids",
}


def submit_add_request(engine, bad: BadRequest) -> object:
    return engine.add_request(
        bad.prompt, bad.max_new_tokens, bad.eos_token_id, sampling_params=bad.sampling_params
    )


def submit_generate(engine, bad: BadRequest) -> object:
    """The bad prompt comes last, after good ones: all or nothing means none is queued."""
    prompts = [GOOD, QUEUED, bad.prompt]
    return engine.generate(
        prompts, bad.max_new_tokens, bad.eos_token_id, sampling_params=bad.sampling_params
    )


def submit_generate_serial(engine, bad: BadRequest) -> object:
    prompts = [GOOD, bad.prompt]
    return engine.generate_serial(
        prompts, bad.max_new_tokens, bad.eos_token_id, sampling_params=bad.sampling_params
    )


SUBMITTERS: dict[str, Callable[[object, BadRequest], object]] = {
    "add_request": submit_add_request,
    "generate": submit_generate,
    "generate_serial": submit_generate_serial,
}


def mid_life_engine(make_engine: EngineFactory):
    """An engine with a warm cache and one request queued: "unchanged" is then non-trivial."""
    engine = make_engine(CFG, max_running=2)
    engine.generate(WARMUP, MAX_NEW)
    engine.add_request(QUEUED, MAX_NEW)
    return engine


def snapshot(engine) -> tuple[object, ...]:
    """What a caller sees of the engine: its figures (the queues' lengths and the pool's
    counts among them), every block and request of the pool, and whether work is left."""
    return (engine.stats, engine.snapshot(), engine.has_work)


def assert_same_future(engine, twin) -> None:
    """The engine behaves exactly like a twin that never saw the bad input: same next id, same
    tokens (those of the reference), same stats afterwards."""
    assert engine.add_request(GOOD, MAX_NEW) == twin.add_request(GOOD, MAX_NEW)
    outputs = engine.generate([GOOD, QUEUED], MAX_NEW)
    assert outputs == twin.generate([GOOD, QUEUED], MAX_NEW)
    assert outputs == reference_tokens(CFG, [GOOD, QUEUED], MAX_NEW)
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0)  # no seed: the engine's next
    assert engine.generate([GOOD], sampling_params=sampled) == twin.generate(
        [GOOD], sampling_params=sampled
    )
    assert not engine.has_work
    assert engine.stats == twin.stats
    assert engine.ref_count_problems() == []


@pytest.mark.parametrize("submit", SUBMITTERS.values(), ids=SUBMITTERS.keys())
@pytest.mark.parametrize("case", BAD_REQUESTS.keys())
def test_bad_input_is_refused_and_changes_nothing(
    make_engine: EngineFactory, case: str, submit: Callable[[object, BadRequest], object]
) -> None:
    """Every listed bad input raises ValueError, leaves the state as it was, and the engine
    goes on exactly as if the call had never been made."""
    engine, twin = mid_life_engine(make_engine), mid_life_engine(make_engine)
    before = snapshot(engine)
    with pytest.raises(ValueError):
        submit(engine, BAD_REQUESTS[case])
    assert snapshot(engine) == before
    assert_same_future(engine, twin)


@pytest.mark.parametrize("case", BAD_REQUESTS.keys())
def test_every_refusal_names_its_argument(make_engine: EngineFactory, case: str) -> None:
    """A ``RequestError`` whose ``param`` is the argument at fault (the prompt, unless named
    otherwise), so that a caller need not read the message to know which field to blame."""
    with pytest.raises(RequestError) as info:
        submit_add_request(make_engine(CFG), BAD_REQUESTS[case])
    assert info.value.param == PARAM_OF.get(case, "prompt_ids")


@pytest.mark.parametrize("case", TOO_BIG)
def test_too_big_request_error_says_the_pool_cannot_hold_it(
    make_engine: EngineFactory, case: str
) -> None:
    """The user must learn that the request can never run here, not just that it failed."""
    engine = make_engine(CFG)
    with pytest.raises(ValueError, match=r"(?i)pool|blocks") as info:
        submit_add_request(engine, BAD_REQUESTS[case])
    assert str(TOTAL_BLOCKS) in str(info.value)


def test_request_filling_the_whole_pool_is_accepted(make_engine: EngineFactory) -> None:
    """The boundary of the "could never run" check: exactly the pool's size is legal."""
    prompt = GOOD[:2] * (TOTAL_BLOCKS * BLOCK_SIZE // 2)  # 32 tokens
    max_new = 1  # needs ceil((32 + 1 - 1) / 4) = 8 blocks: all of them
    engine = make_engine(CFG)
    assert engine.generate([prompt], max_new) == reference_tokens(CFG, [prompt], max_new)
    assert engine.ref_count_problems() == []


VALID_PROMPT_FORMS: dict[str, Callable[[list[int]], object]] = {
    "tuple": tuple,
    "int64-tensor": lambda p: torch.tensor(p, dtype=torch.int64),
    "int32-tensor": lambda p: torch.tensor(p, dtype=torch.int32),
}


@pytest.mark.parametrize("form", VALID_PROMPT_FORMS.values(), ids=VALID_PROMPT_FORMS.keys())
def test_alternative_prompt_forms_are_accepted(
    make_engine: EngineFactory, form: Callable[[list[int]], object]
) -> None:
    """A 1-D integer tensor or a tuple is the same prompt as the list: same tokens out."""
    expected = reference_tokens(CFG, [GOOD], MAX_NEW)
    engine = make_engine(CFG)
    assert engine.generate([form(GOOD)], MAX_NEW) == expected
    assert engine.generate_serial([form(GOOD)], MAX_NEW) == expected
    request_id = engine.add_request(form(GOOD), MAX_NEW)
    assert isinstance(request_id, int)
    assert engine.has_work
    while engine.has_work:
        engine.step()
    assert engine.ref_count_problems() == []


def test_eos_at_the_vocabulary_edge_is_accepted(make_engine: EngineFactory) -> None:
    """eos ids 0 and vocab_size - 1 are real tokens: the range check must not be off by one."""
    engine = make_engine(CFG)
    for eos in (0, VOCAB - 1):
        outputs = engine.generate([GOOD], MAX_NEW, eos_token_id=eos)
        assert outputs == reference_tokens(CFG, [GOOD], MAX_NEW, eos)


@pytest.mark.parametrize(
    "bad",
    [BadRequest(GOOD, max_new_tokens=True), BadRequest(GOOD, eos_token_id=False)],
    ids=["max-new-bool", "eos-bool"],
)
def test_a_bool_is_not_an_integer_anywhere(make_engine: EngineFactory, bad: BadRequest) -> None:
    """True and False are ints to Python, but not a token count or a token id."""
    engine = make_engine(CFG)
    with pytest.raises(ValueError):
        submit_add_request(engine, bad)
    assert not engine.has_work


@pytest.mark.parametrize("serial", [False, True], ids=["generate", "generate_serial"])
def test_a_one_shot_iterable_prompt_is_served_or_refused_whole(
    make_engine: EngineFactory, serial: bool
) -> None:
    """``common.inputs.as_token_list`` takes any iterable of ints; generate must then either
    serve it (what add_request does with it) or refuse the whole call and change nothing."""
    engine = make_engine(CFG)
    run = engine.generate_serial if serial else engine.generate
    try:
        outputs = run([GOOD, iter(QUEUED)], MAX_NEW)
    except ValueError:
        assert not engine.has_work
        raise AssertionError("a valid prompt was refused") from None
    assert outputs == reference_tokens(CFG, [GOOD, QUEUED], MAX_NEW)


@pytest.mark.parametrize(
    "text", ["hello", "", b"\x01\x02", 5, None], ids=["str", "empty-str", "bytes", "int", "none"]
)
@pytest.mark.parametrize("serial", [False, True], ids=["generate", "generate_serial"])
def test_text_in_place_of_the_list_of_prompts_is_refused(
    make_engine: EngineFactory, text: object, serial: bool
) -> None:
    """generate takes a list of prompts: text in its place is refused with an error that says
    so, not read as one prompt per character (an empty string is not an empty batch), and so
    is a lone number or None, with a ValueError like every other bad input."""
    engine = make_engine(CFG)
    run = engine.generate_serial if serial else engine.generate
    with pytest.raises(ValueError, match="list of prompts"):
        run(text, MAX_NEW)
    assert not engine.has_work


# ---- the commands: one line, not a traceback -----------------------------------------------------


RUN = "step14_7.run"


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


def config_edit(**changes: object) -> Callable[[Path], None]:
    """A broken copy's edit: these fields of its config.json changed."""
    return lambda folder: edit_json(folder / "config.json", **changes)


BROKEN: dict[str, Callable[[Path], None]] = {
    "pytorch-bin-only": only_pytorch_bin,
    "qwen2": config_edit(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "mistral": config_edit(
        model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096
    ),
    "sliding-window": config_edit(sliding_window=4096),
    "no-tokenizer": lambda f: (f / "tokenizer.json").unlink(),
    "no-tokenizer-bad-weights": garbage_weights_no_tokenizer,
    "wrong-shapes": config_edit(num_key_value_heads=4),  # stored: 2 KV heads
    "broken-config": lambda f: (f / "config.json").write_text('{"vocab_size": 320,'),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A sound checkpoint (byte-level BPE tokenizer that adds no BOS, as GPT-2's, chat
    template, GQA, tied embeddings, llama3 RoPE) and one broken copy per entry of BROKEN."""
    chat = pytest.importorskip("tests.front.test_chat_template")
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
        "run-new-tokens-beyond-context",
        RUN,
        ["--model", "{sound}", "--max-new-tokens", "100000"],
        ["past the model's context length", "--max-new-tokens", "--max-model-len"],
    ),
    (
        "run-new-tokens-beyond-pool",
        RUN,
        ["--model", "{sound}", "--max-new-tokens", "150", "--total-blocks", "4"],
        ["150 new tokens", "--max-new-tokens", "--total-blocks"],
    ),
    ("bench-bin-only", "bench", ["--model", "{pytorch-bin-only}"], ["pytorch_model.bin"]),
    ("bench-qwen2", "bench", ["--model", "{qwen2}"], ["model_type='qwen2'"]),
    ("bench-mistral", "bench", ["--model", "{mistral}"], ["model_type='mistral'"]),
    ("bench-sliding-window", "bench", ["--model", "{sliding-window}"], ["sliding_window=4096"]),
    ("bench-wrong-shapes", "bench", ["--model", "{wrong-shapes}"], ["k_proj.weight has shape"]),
    ("bench-broken-config", "bench", ["--model", "{broken-config}"], ["not valid JSON"]),
]


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
        return run_python("-m", module, *words)

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
    proc = run_python("-m", RUN, "--model", str(folder), "--system", "Be brief.", "--prompt", "hi")
    line = assert_one_error_line(proc, f"python -m {RUN}")
    assert "System role not supported" in line and "--no-chat-template" in line


# ---- the commands: before the slow part ----------------------------------------------------------


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
