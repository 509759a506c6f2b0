"""``--model DIR``: a local checkpoint through ``python -m bench`` and every step's ``run.py``.

The checkpoint is the tiny one ``tests/test_checkpoint.py`` saves with Hugging Face's
``save_pretrained`` (grouped-query attention, tied embeddings, a word-level tokenizer), and
HF's own greedy answers on it are the expected text.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from bench import showcase
from tests.conftest import STEP_NAMES
from tests.test_checkpoint import (
    NEW_TOKENS,
    PROMPTS,
    SYSTEM,
    checkpoint,  # noqa: F401 (the fixture, visible to pytest here)
)


@pytest.fixture
def saved(request: pytest.FixtureRequest) -> dict[str, object]:
    """test_checkpoint's ``checkpoint`` fixture: the folders, HF's answers, the tokenizer."""
    return request.getfixturevalue("checkpoint")


def test_bench_runs_on_a_checkpoint(saved: dict[str, object], tmp_path: Path, capsys) -> None:
    """Every row (two steps, warm prefix, no cache, HF) computes with the checkpoint's weights
    and config, and all of them give the dense reference's tokens."""
    folder = saved["single"]
    argv = "--requests 3 --prefix-len 8 --tail-len 3 --new-tokens 3 --repeats 1 --block-size 4"
    steps = f"{STEP_NAMES[0]},{STEP_NAMES[-1]}"
    code = showcase.main(
        [*argv.split(), "--model", str(folder), "--steps", steps, "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"model {folder}: d_model=64, 2 layers, 4 heads, vocab 62," in out
    assert "| HF generate " in out and f"| {STEP_NAMES[-1]} (warm prefix) " in out
    assert "every row produced the same tokens as the dense reference model" in out
    data = json.loads((tmp_path / "results.json").read_text())
    model = data["settings"]["model"]
    assert (model["num_kv_heads"], model["tie_word_embeddings"], model["seed"]) == (
        "2",
        "True",
        "None",
    )
    assert data["settings"]["model_name"] == str(folder)


@pytest.mark.parametrize("step_name", [STEP_NAMES[0], STEP_NAMES[-1]])
def test_run_py_serves_text_from_a_checkpoint(
    step_name: str, saved: dict[str, object], capsys
) -> None:
    """``python -m <step>.run --model DIR --system ... --prompt ...``: HF's answers, word for
    word, and the shared system prompt served from the prefix cache."""
    run = importlib.import_module(f"{step_name}.run")
    argv = ["--model", str(saved["single"]), "--system", SYSTEM, "--block-size", "4"]
    argv += ["--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    decode = saved["tokenizer"].decode
    for prompt, ids in zip(PROMPTS, saved["expected"]):
        assert f"] {prompt}\n" in out
        assert f"-> {decode(ids, skip_special_tokens=True)}  ({len(ids)} tokens)" in out
    assert out.startswith(f"{step_name}: {saved['single']}")
    cache = re.search(r"prefix cache: \d+/3 requests hit, (\d+)/(\d+) prompt tokens", out)
    assert cache is not None, out
    assert 0 < int(cache[1]) < int(cache[2])
