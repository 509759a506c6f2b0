"""The chapter's demo (``python -m <step>.run``) in every step: the figures it must print."""

from __future__ import annotations

import importlib
import re

import pytest

from common.config import preset
from common.stats import EngineStats
from front import demo
from tests.helpers import STEP_NAMES

ROUND = re.compile(
    r"^(?P<label>.+?)\s+[\d.]+ ms\s+hit rate (?P<hit>\d+% \(\d+/\d+\))\s+"
    r"tokens \d+% \((?P<cached>\d+)/(?P<prompt>\d+)\)\s+"
    r"computed (?P<prefill>\d+) prefill \+ (?P<decode>\d+) decode tokens$",
    re.MULTILINE,
)


def demo_output(step_name: str, capsys: pytest.CaptureFixture, new_tokens: int) -> str:
    run = importlib.import_module(f"{step_name}.run")
    assert run.main(["--max-new-tokens", str(new_tokens)]) == 0, "a check printed ❌"
    return capsys.readouterr().out


def rounds(out: str) -> dict[str, dict[str, str]]:
    """Each round's line, by label: its hit rate and token counts."""
    return {m["label"]: m.groupdict() for m in ROUND.finditer(out)}


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_demo_prints_the_chapter_figures(step_name: str, capsys: pytest.CaptureFixture) -> None:
    out = demo_output(step_name, capsys, new_tokens=4)
    by_label = rounds(out)
    assert by_label["Round 1 (cold cache), serial"]["hit"] == "90% (9/10)"
    assert by_label["Round 2 (hot cache), serial"]["hit"] == "100% (10/10)"
    assert by_label["Round 3 (cache off), serial"]["hit"] == "0% (0/10)"
    assert any(label.startswith("Batched (max_running") for label in by_label)
    assert out.count("✅") == 5 and "❌" not in out


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_demo_small_pool_round_preempts_and_loses_nothing(
    step_name: str, capsys: pytest.CaptureFixture
) -> None:
    """The last round runs the batched requests again in a pool too small for them: it must
    preempt (the default demo, 16 new tokens, in every step alike), say what that cost, and
    still give the reference's tokens."""
    out = demo_output(step_name, capsys, new_tokens=16)
    pool = demo.small_pool_blocks(16, 16)
    line = re.search(rf"Batched, {pool}-block pool .*\n\s+(\d+) preemptions?, (\d+) tokens", out)
    assert line is not None, out
    preemptions, resumed = int(line[1]), int(line[2])
    assert preemptions > 0 and resumed > 0
    check = f"Small pool: outputs identical to the reference ({preemptions} preemptions) ✅"
    assert check in out
    cost = out[out.index("In the small pool") :].split("\n\n")[0].replace("\n", " ")
    assert f"{preemptions} preemptions cost" in cost and f"{resumed} tokens came back" in cost


@pytest.mark.parametrize("step_name", [STEP_NAMES[0], STEP_NAMES[-1]])
def test_demo_counts_the_tokens_it_computed(step_name: str, capsys) -> None:
    """Every round says how many prompt tokens the model really computed (the rest came from
    the cache) and how many it decoded; the cache-off round computes the whole prompt."""
    out = demo_output(step_name, capsys, new_tokens=3)
    by_label = rounds(out)
    assert len(by_label) == 5
    del by_label[f"Batched, {demo.small_pool_blocks(16, 3)}-block pool"]  # recomputes output
    for line in by_label.values():
        assert int(line["prefill"]) == int(line["prompt"]) - int(line["cached"])
        assert int(line["decode"]) == 10 * (3 - 1)  # the first new token comes from prefill
    cold, hot, off = (
        int(by_label[f"Round {i} ({name}), serial"]["prefill"])
        for i, name in ((1, "cold cache"), (2, "hot cache"), (3, "cache off"))
    )
    assert hot < cold < off
    meaning = out[out.index("What the numbers mean") :].split("\n\n")[0].replace("\n", " ")
    assert f"computed {off} prompt tokens with the cache off, {cold} cold and {hot} hot" in meaning
    assert "Decode is the same 20 tokens in every round" in meaning


def test_demo_without_decode_says_only_what_prefill_saved(capsys) -> None:
    out = demo_output(STEP_NAMES[-1], capsys, new_tokens=1)
    assert "1 new token each" in out
    assert "What the numbers mean" in out and "Decode is" not in out


def test_token_check_requires_identity_in_float32_and_counts_in_half() -> None:
    same, differ = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    assert demo.token_check("Same", same, same, exact=True) == (True, "Same ✅")
    assert demo.token_check("Same", same, same, exact=False) == (True, "Same ✅")
    assert demo.token_check("Same", differ, same, exact=True) == (False, "Same ❌")
    assert demo.token_check("Same", differ, same, exact=False) == (True, "Same: 1/2 requests ⚠️")


def test_demo_in_float16_reports_mismatches_and_says_why(capsys) -> None:
    """float16 rounding may flip a near-tie (chunked vs whole prompt): the demo counts such
    mismatches and explains them instead of failing; ref counts are still required."""
    run = importlib.import_module(f"{STEP_NAMES[-1]}.run")
    assert run.main(["--dtype", "float16", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "❌" not in out and "Every block's ref_count sane" in out
    assert ("⚠️" in out) == ("In float16, the same sums done in another order" in out)


def test_small_pool_check_fails_on_wrong_tokens_or_broken_ref_counts() -> None:
    """The small-pool line is ✅ only when the outputs are the reference's and every block is
    back at rest; either failure makes it ❌ and fails the demo."""
    stats = EngineStats(preemptions=2)
    want = [[1, 2], [3, 4]]
    assert demo.small_pool_check(demo.Round(want, stats), want, exact=True) == (
        True,
        "Small pool: outputs identical to the reference (2 preemptions) ✅",
    )
    ok, line = demo.small_pool_check(demo.Round([[1, 2], [3, 5]], stats), want, exact=True)
    assert not ok and line.endswith("❌")
    broken = ["block 3: ref_count 2, expected 1"]
    ok, line = demo.small_pool_check(demo.Round(want, stats, broken), want, exact=True)
    assert not ok and "ref counts broken: block 3" in line and line.endswith("❌")


def demo_rounds(**broken: object) -> demo.DemoRounds:
    """What ``run_rounds`` hands ``print_checks`` when every round went right, with the rounds
    named in ``broken`` replaced."""
    good, stats = [[1, 2], [3, 4]], EngineStats(blocks_free=512, preemptions=1)
    rounds = {
        "cold": demo.Round(good, stats),
        "hot": demo.Round(good, stats),
        "off": demo.Round(good, stats),
        "batched": demo.Round(good, stats),
        "small_pool": demo.Round(good, stats),
        "reference": good,
    }
    return demo.DemoRounds(**{**rounds, **broken})


BROKEN_ROUNDS = {
    "hot-tokens": {"hot": demo.Round([[1, 2], [3, 5]], EngineStats())},
    "ref-counts-at-rest": {
        "hot": demo.Round([[1, 2], [3, 4]], EngineStats(), ["block 7: ref_count 2, expected 1"])
    },
    "batched-tokens": {"batched": demo.Round([[1, 2], [9, 4]], EngineStats())},
    "reference-tokens": {"reference": [[1, 2], [3, 3]]},
    "small-pool-tokens": {"small_pool": demo.Round([[1, 2], [4, 3]], EngineStats(preemptions=1))},
    "small-pool-ref-counts": {
        "small_pool": demo.Round(
            [[1, 2], [3, 4]], EngineStats(), ["block 2: ref_count 1, expected 0"]
        )
    },
}


@pytest.mark.parametrize("broken", BROKEN_ROUNDS.values(), ids=BROKEN_ROUNDS.keys())
def test_the_demo_fails_when_any_check_fails(broken: dict, capsys) -> None:
    """The demo's exit status is its checks': 0 when all five pass, 1 (and a ❌) when any
    one fails, whichever it is."""
    cfg = preset("demo")
    assert demo.print_checks(cfg, demo_rounds()) == 0
    out = capsys.readouterr().out
    assert out.count("✅") == 5 and "❌" not in out
    assert demo.print_checks(cfg, demo_rounds(**broken)) == 1
    assert "❌" in capsys.readouterr().out
