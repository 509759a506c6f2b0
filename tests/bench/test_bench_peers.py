"""The peers beside the steps (``bench/peers/``): CTranslate2 converted from the model's Hugging
Face twin, and what happens where it cannot run.

Without ``ctranslate2`` (CI installs ``.[test]`` only) a run skips its rows with one line and
still passes; the tests that need the package skip. A dtype it refuses to compute in here
(its CPU build: bfloat16, float16) skips its rows with its reason, never a traceback. With it,
both rows give the dense reference's tokens, count the static prompt once (cold) or not at all
(warm), and run on ``--threads`` threads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import cli
from bench.costs import dense_work, model_flops
from bench.peers import ct2, hf_twin
from bench.workloads.shared_prefix import SharedPrefix
from common.config import Llama3RopeScaling, preset
from tests.helpers import STEP_NAMES

TINY_RUN = ["--model", "tiny", "--requests", "3", "--prefix-len", "8", "--tail-len", "4"]
TINY_RUN += ["--block-size", "4"]  # the prefix fills two blocks: the engine computes it once
TINY_RUN += ["--new-tokens", "3", "--repeats", "1", "--no-hf", "--steps", STEP_NAMES[-1]]
SKIP_LINE = "  (CTranslate2 rows skipped: pip install -e '.[peers]' to add them)"


def test_without_ctranslate2_its_rows_skip_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == "ctranslate2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cli.main([*TINY_RUN, "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "CTranslate2 rows" in line] == [SKIP_LINE]
    assert "| CTranslate2" not in "\n".join(out)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"dtype": "float64"}, "it computes in float32, float16, bfloat16, not float64"),
        (
            {"rope_scaling": Llama3RopeScaling(4.0, 1.0, 4.0, 64)},
            "to start from 8192 positions, this model's from 64",
        ),
    ],
    ids=["float64", "llama3-context"],
)
def test_a_model_it_cannot_compute_is_skipped_with_the_reason(changes, why, capsys) -> None:
    if importlib.util.find_spec("ctranslate2") is None:
        assert not ct2.available(preset("tiny", **changes))  # the missing package, said first
        return
    assert not ct2.available(preset("tiny", **changes))
    assert why in capsys.readouterr().out
    assert ct2.available(preset("tiny", rope_scaling=Llama3RopeScaling(4.0, 1.0, 4.0, 8192)))


REFUSED = (
    "Requested bfloat16 compute type, but the target device or backend do not support "
    "efficient bfloat16 computation."
)  # what CTranslate2's CPU build raises when it loads a model to compute in bfloat16


def test_a_dtype_it_cannot_compute_in_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A stand-in CTranslate2 that refuses the dtype as the real one does: its rows skip with
    its reason, and the run (the steps and HF in bfloat16) ends well."""

    def refuse(*args: object) -> None:
        raise ValueError(REFUSED)

    monkeypatch.setattr(ct2, "available", lambda cfg: True)
    monkeypatch.setattr(ct2, "load_generator", refuse)
    argv = [arg for arg in TINY_RUN if arg != "--no-hf"] + ["--dtype", "bfloat16", "--quiet"]
    assert cli.main([*argv, "--no-reference", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    skips = [line for line in out.splitlines() if "CTranslate2 rows" in line]
    assert skips == [f"  (CTranslate2 rows skipped: bfloat16 on cpu: {REFUSED})"]
    assert "| CTranslate2" not in out and "| HF generate" in out
    assert "every row produced the same tokens" in out


def test_the_converter_reads_the_token_ids_as_the_vocabulary() -> None:
    vocabulary = ct2.IdVocabulary(5).get_vocab()
    assert vocabulary == {"0": 0, "1": 1, "2": 2, "3": 3, "4": 4}
    assert ct2.IdVocabulary.eos_token in vocabulary and ct2.IdVocabulary.bos_token in vocabulary


# ---- with ctranslate2 installed -------------------------------------------------------------

WORKLOAD = SharedPrefix(num_requests=3, prefix_len=8, tail_len=4, max_new_tokens=3, max_running=3)


@pytest.fixture(scope="module")
def generator_threads() -> list[int]:
    """The ``intra_threads`` every ``ctranslate2.Generator`` made by the bench was given."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    seen: list[int] = []
    real = ctranslate2.Generator

    def recording(*args: object, **kwargs: object):
        seen.append(kwargs["intra_threads"])
        return real(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(ctranslate2, "Generator", recording)
    yield seen
    mp.undo()


@pytest.mark.parametrize("threads", [1, 2])
def test_both_rows_give_the_reference_tokens_on_the_bench_threads(
    threads: int, generator_threads: list[int], tmp_path: Path, capsys
) -> None:
    argv = [*TINY_RUN, "--threads", str(threads), "--quiet", "--out", str(tmp_path)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    assert generator_threads[-1] == threads
    rows = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    cold, warm = rows["CTranslate2"], rows["CTranslate2 (warm prefix)"]
    assert (cold["computed_prefill_tokens"], warm["computed_prefill_tokens"]) == (8 + 3 * 4, 3 * 4)
    assert cold["computed_decode_tokens"] == warm["computed_decode_tokens"] == 3 * 2
    assert cold["flops"] == rows[STEP_NAMES[-1]]["flops"], "the prefix once, as the engine"
    assert warm["flops"] == model_flops(preset("tiny"), dense_work(3, 12, 3, 8, True))
    assert (
        "every row produced the same tokens as the dense reference model" in capsys.readouterr().out
    )


def test_without_a_shared_prefix_there_is_no_warm_row(generator_threads: list[int]) -> None:
    cfg = preset("tiny")
    workload = SharedPrefix(3, 0, 6, 3, 3)
    made = ct2.rows(hf_twin(cfg, None, workload), cfg, workload.prompts(512), workload, 1, timed)
    assert [name for name, _ in made] == ["CTranslate2"]


def timed(name: str, fixes: str, run, warmup: bool = False):
    return name, run()


def test_ctranslate2_runs_after_every_torch_row_is_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its generator's threads slow torch's while it lives: the rows registered before it are
    measured first, and its own after."""
    from bench import peers
    from bench.options import BenchOptions

    events: list[str] = []
    monkeypatch.setattr(ct2, "available", lambda cfg: True)
    monkeypatch.setattr(peers, "hf_twin", lambda *args: object())
    monkeypatch.setattr(peers.hf, "rows", lambda *args: events.append("hf registered") or [])
    monkeypatch.setattr(ct2, "rows", lambda *args: events.append("ct2 made") or [])
    options = BenchOptions("shared-prefix", "tiny", tuple(STEP_NAMES), 1, "out")
    measure = lambda: events.append("measured")  # noqa: E731
    peers.peer_rows(preset("tiny"), None, SharedPrefix(), options, None, measure)
    assert events == ["hf registered", "measured", "ct2 made"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_dtype_its_cpu_build_refuses_skips_its_rows_with_its_reason(
    dtype: str, tmp_path: Path, capsys
) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    if dtype in ctranslate2.get_supported_compute_types("cpu"):
        pytest.skip(f"this CTranslate2 computes in {dtype} on this CPU")
    argv = [*TINY_RUN, "--dtype", dtype, "--no-reference", "--quiet", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    skips = [line for line in out.splitlines() if "CTranslate2 rows" in line]
    assert len(skips) == 1 and f"Requested {dtype} compute type" in skips[0], skips
    assert "| CTranslate2" not in out
