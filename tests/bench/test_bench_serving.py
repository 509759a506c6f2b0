"""``python -m bench --workload serving``: time to first token and per output token.

The figures themselves are timings, so nothing here asserts on how fast a step is. What is
tested is that the benchmark measures what it says: the arrivals are a seeded Poisson process
of the asked rate; TTFT counts from the arrival (not from admission) and TPOT divides by the
gaps between tokens; the percentiles are numpy's; the driver, on a fake clock whose every round
takes one second, gives the latencies worked out by hand, idle waits included in no latency;
a small run serves every request all its tokens, the same in every cell; bad flags stop the
run before any work, in one line; and the figures docs/benchmarks.md shows are those of the
run saved beside it (docs/serving-cpu.json).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench import cli, latency
from bench.models import load_step_model
from bench.workloads import serving
from common import memory
from common.config import preset
from tests.helpers import ROOT, STEP_NAMES, bench_usage_error, budget_args

# ---- the arrivals ----------------------------------------------------------------------------


def test_arrivals_are_a_seeded_poisson_process() -> None:
    """The same seed gives the same times, another seed others; the first request comes at 0
    and the gaps between arrivals are exponential of mean 1 / rate (the mean and the standard
    deviation of an exponential are equal: evenly spaced or uniform gaps would fail)."""
    times = latency.poisson_arrivals(20_000, 4.0, seed=0)
    assert times == latency.poisson_arrivals(20_000, 4.0, seed=0)
    assert times != latency.poisson_arrivals(20_000, 4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 4.0, rel=0.05)
    assert latency.poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_the_workload_draws_its_arrivals_from_its_own_rate_and_seed() -> None:
    workload = serving.ServingWorkload(num_requests=5, request_rate=2.0, seed=3)
    assert workload.arrival_times() == latency.poisson_arrivals(5, 2.0, 3)
    assert "5 requests arriving at 2/s (Poisson, seed 3)" in workload.describe()
    requests = workload.timed_requests(512)
    assert [r.prompt for r in requests] == workload.prompts(512)
    assert [r.arrival for r in requests] == workload.arrival_times()
    assert {r.max_tokens for r in requests} == {workload.max_new_tokens}


# ---- the figures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),  # an even count: the mean of the middle two
        ([3, 1, 2], 50, 2),  # unsorted input
        (list(range(101)), 99, 99),  # rank 99 exactly
        (list(range(1, 11)), 99, 9.91),  # between the two slowest
        (list(range(1, 11)), 100, 10),
        (list(range(1, 11)), 0, 1),
        ([7.5], 99, 7.5),
    ],
)
def test_percentile_interpolates_as_numpy_does(values: list[float], p: float, expected) -> None:
    assert latency.percentile(values, p) == pytest.approx(expected)


def test_ttft_and_tpot_of_hand_built_times() -> None:
    """TTFT: arrival to first token. TPOT: the time after the first token over the tokens
    after the first; none for a one-token answer, which is left out of the percentiles."""
    slow = latency.RequestTimes(arrival=1.0)
    for now, tokens in [(1.5, 1), (1.7, 2), (2.1, 3)]:
        slow.record(now, tokens)
    assert (slow.ttft, slow.tpot) == (pytest.approx(0.5), pytest.approx(0.3))
    one = latency.RequestTimes(arrival=0.0)
    one.record(0.25, 1)
    assert (one.ttft, one.tpot) == (0.25, None)
    run = latency.RunFigures([slow, one], busy_s=1.05)
    assert run.ttft(50) == pytest.approx(0.375) and run.ttft(99) == pytest.approx(0.4975)
    assert run.tpot(50) == pytest.approx(0.3) and run.tpot(99) == pytest.approx(0.3)
    assert run.duration_s == pytest.approx(2.1) and run.output_tokens == 4
    assert run.busy == pytest.approx(0.5)
    assert latency.RunFigures([one], busy_s=0.25).tpot(50) is None


class FakeTimer:
    """A ``time.perf_counter`` whose every reading is one second after the last: each round
    (one reading before, one after) takes exactly one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("step_name", STEP_NAMES)
@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_the_driver_times_each_request_from_its_arrival(step_name: str, cache: bool) -> None:
    """Rounds of one second, blocks of 4 tokens. A (8 tokens, at 0): two chunks, first token
    at 2, then one a round: 3, 4. B (A's first block + 4 of its own, at 2.5) is added when the
    round running at its arrival ends, at 3; with the cache it adopts A's first block and its
    first token comes at 4 (TTFT 1.5), without it at 5 (TTFT 2.5). C (4 tokens, at 100) finds
    the engine idle: the clock jumps to 100 (no latency, not busy), first token at 101."""
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    prompts, arrivals = [a, [*a[:4], 9, 10, 11, 12], [13, 14, 15, 16]], [0.0, 2.5, 100.0]
    # step14_9: a budget of one block beside the other three requests' decode tokens keeps
    # the chunks of a block, and so this timeline
    model = replace(
        load_step_model(step_name, preset("tiny")), engine_args=budget_args(step_name, 7)
    )
    serve = serving.engine_serve(model, serving.Setting(step_name, cache, 4), FakeTimer())
    run = serve([latency.TimedRequest(p, t, 3) for p, t in zip(prompts, arrivals)])
    a_times, b_times, c_times = run.requests
    assert (a_times.first_token, a_times.last_token, a_times.tokens) == (2.0, 4.0, 3)
    assert (a_times.ttft, a_times.tpot) == (2.0, 1.0)
    assert b_times.ttft == (1.5 if cache else 2.5)
    assert (c_times.first_token, c_times.ttft, c_times.tpot) == (101.0, 1.0, 1.0)
    rounds = 6 if cache else 7  # A and B together until B's last token, then C alone: 3
    assert run.busy_s == rounds + 3 and run.stats["rounds"] == rounds + 3
    assert [len(out) for out in run.outputs] == [3, 3, 3]


# ---- the whole bench -------------------------------------------------------------------------


def cell(name: str, outputs: list[list[int]], tokens: int = 2) -> serving.ServingCell:
    times = latency.RequestTimes(0.0, 1.0, 2.0, tokens)
    run = latency.RunFigures([times] * len(outputs), 1.0, outputs=outputs)
    return serving.ServingCell(name, serving.Setting(name, True, 4), [run])


def test_check_catches_tokens_that_disagree_and_requests_cut_short() -> None:
    good = [[1, 2], [3, 4]]
    assert serving.check_cells([cell("a", good), cell("b", good)], 2, good) == []
    wrong = serving.check_cells([cell("a", good), cell("b", [[1, 2], [3, 5]])], 2, good)
    assert any(
        "b, prefix cache on, run 1: tokens differ from the dense reference" in p for p in wrong
    )
    assert any("tokens differ from a's first run" in p for p in wrong)
    short = serving.check_cells([cell("a", good, tokens=1)], 2, None)
    assert short == ["a, prefix cache on, run 1: a request was not timed with all its tokens"]


SMALL_RUN = ["--workload", "serving", "--model", "tiny", "--block-size", "4", "--quiet"]
SMALL_RUN += ["--requests", "6", "--prefix-len", "8", "--tail-len", "4", "--new-tokens", "3"]


def test_a_small_serving_run_gives_every_request_all_its_tokens(tmp_path: Path, capsys) -> None:
    """Two steps, cache on and off, and the last step one at a time, twice round: every
    request of every run is timed with all its tokens, the same tokens in every cell as the
    dense reference's (the run's status is 0), and serving.json holds every figure."""
    argv = [*SMALL_RUN, "--steps", "step14,step14_7", "--repeats", "2", "--max-running", "4"]
    argv += ["--request-rate", "50", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "6 requests arriving at 50/s (Poisson, seed 0)" in out
    assert "TTFT p50 ms" in out and "TPOT p99 ms" in out and "step14_7 (one at a time)" in out
    assert "every request's tokens equal the dense reference and each other" in out
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["arrivals"] == latency.poisson_arrivals(6, 50.0, 0)
    assert data["tokens_identical"] is True
    cells = [(c["name"], c["prefix_cache"], c["max_running"]) for c in data["cells"]]
    assert cells == [
        ("step14", True, 4),
        ("step14", False, 4),
        ("step14_7", True, 4),
        ("step14_7", False, 4),
        ("step14_7 (one at a time)", True, 1),
    ]
    for c in data["cells"]:
        assert len(c["runs"]) == 2
        for run in c["runs"]:
            assert len(run["each_ttft_ms"]) == len(run["each_tpot_ms"]) == 6
            assert min(run["each_ttft_ms"]) > 0 and min(run["each_tpot_ms"]) > 0
            p99 = latency.percentile(run["each_ttft_ms"], 99)
            assert run["ttft_ms"]["p99"] == pytest.approx(p99, abs=1e-3)
            assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
            assert run["busy_s"] <= run["duration_s"]
    reuse = [run["stats"]["cached_tokens"] for c in data["cells"] for run in c["runs"]]
    assert all(reuse[i] > 0 for i in (0, 1, 4, 5, 8, 9)) and not any(reuse[i] for i in (2, 3, 6, 7))


def test_a_checkpoint_s_weights_serve_every_cell_and_the_reference(
    toy_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    """With --model DIR, every step's model and the dense reference read the checkpoint's
    weights (a model left with seeded weights would give other tokens: status 1)."""
    argv = ["--workload", "serving", "--model", str(toy_checkpoint), "--block-size", "4"]
    argv += ["--requests", "4", "--prefix-len", "4", "--tail-len", "2", "--new-tokens", "2"]
    argv += ["--steps", "step14_7", "--repeats", "1", "--quiet", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "every request's tokens equal the dense reference" in capsys.readouterr().out


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request-rate", "0"], "--request-rate: must be > 0 (or inf: all at once), got '0'"),
        (["--request-rate=-2"], "must be > 0"),
        (["--request-rate", "nan"], "must be > 0"),
        (["--request-rate", "fast"], "'fast' is not a number of requests per second"),
        (["--prefix-len", "0", "--tail-len", "0"], "a prompt needs at least one token"),
        (["--sweep-cached", "0,8"], "--sweep-cached: only --workload scale reads it"),
        (["--total-blocks", "2"], "the pool has 2: raise total_blocks (--total-blocks)"),
    ],
    ids=["zero", "negative", "nan", "text", "empty-prompt", "sweep", "pool"],
)
def test_bad_serving_flags_are_one_error_line(argv: list[str], message: str, capsys) -> None:
    line = bench_usage_error(["--workload", "serving", *argv], capsys)
    assert message in line, line


@pytest.mark.usefixtures("no_work")
def test_the_rate_is_refused_for_other_workloads_and_defaults_are_the_workload_s(capsys) -> None:
    for other in ("shared-prefix", "scale"):
        line = bench_usage_error(["--workload", other, "--request-rate", "4"], capsys)
        assert "--request-rate: only --workload serving and --workload replicas read it" in line
    args = cli.parse(["--workload", "serving"])
    assert serving.workload_of(args) == serving.ServingWorkload()
    assert (args.model, args.block_size, args.request_rate) == ("demo", 16, 16.0)
    given = cli.parse(["--workload", "serving", "--request-rate", "inf"])
    assert serving.workload_of(given).request_rate == math.inf


def test_a_pool_the_machine_cannot_hold_is_refused_first(monkeypatch, capsys) -> None:
    """The memory check runs before the serving bench builds anything."""
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)
    monkeypatch.setattr(serving, "run_cells", lambda *a, **k: pytest.fail("work started"))
    assert cli.main(["--workload", "serving", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench: error: not enough memory")


# ---- the documented run ----------------------------------------------------------------------

SAVED = json.loads((ROOT / "docs" / "serving-cpu.json").read_text())


def documented_rows() -> dict[tuple[str, str], list[str]]:
    """docs/benchmarks.md's serving table, by (step, prefix cache): the cells of each row."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## The serving workload") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| step1"):
            rows[cells[0], cells[1]] = cells[2:]
    return rows


def test_the_documented_figures_are_those_of_the_saved_run() -> None:
    """docs/benchmarks.md's serving table is docs/serving-cpu.json's best run of each cell,
    every step in order, from a one-thread run of the default command whose tokens agreed; and
    the saved percentiles are those of the saved per-request figures."""
    settings = SAVED["settings"]
    assert SAVED["machine"]["threads"] == 1 and SAVED["tokens_identical"] is True
    default = {**asdict(serving.ServingWorkload()), "kind": "serving", "request_rate": 16.0}
    assert settings["workload"] == default
    assert (settings["model_name"], settings["repeats"]) == ("demo", 3)
    saved = list(dict.fromkeys(c["step"] for c in SAVED["cells"]))
    # every step in order; step14_10 came the day after this run, and the page says so (with
    # no tier it runs step14_9's code: a run of it beside the others is in scale-cpu.json)
    assert saved == STEP_NAMES[: len(saved)] and STEP_NAMES[len(saved) :] in ([], ["step14_10"])
    rows = documented_rows()
    assert len(rows) == len(SAVED["cells"])
    for c in SAVED["cells"]:
        best = c["runs"][c["best_run"]]
        assert min(run["busy_s"] for run in c["runs"]) == best["busy_s"]
        flag = "!" if c["spread"] > SAVED["spread_flag"] else ""
        reuse = best["stats"]["cached_tokens"] / best["stats"]["prompt_tokens"]
        shown = [
            f"{best['ttft_ms']['p50']:.1f}",
            f"{best['ttft_ms']['p99']:.1f}",
            f"{best['tpot_ms']['p50']:.1f}",
            f"{best['tpot_ms']['p99']:.1f}",
            f"{best['output_tokens_per_s']:.1f}",
            f"{best['busy_s'] / best['duration_s']:.0%}{flag}",
            f"{reuse:.0%}",
        ]
        assert rows[c["name"], "on" if c["prefix_cache"] else "off"] == shown, c["name"]
        for run in c["runs"]:
            for what in ("ttft", "tpot"):
                each = run[f"each_{what}_ms"]
                for p in (50, 99):
                    expected = latency.percentile(each, p)
                    assert run[f"{what}_ms"][f"p{p}"] == pytest.approx(expected, abs=1e-3)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert f"Measured on {SAVED['date'].split()[0]}" in text
