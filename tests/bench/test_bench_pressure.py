"""``python -m bench --workload pressure`` and ``--total-blocks``: what memory on demand buys.

Two dozen short prompts whose answers stop at their own eos within 13 tokens, asked with
``max_new_tokens=64``, in a pool of 48 blocks of 4 tokens, eight at a time at most. Reserving
each request's worst case (prompt + 64 tokens: 17 to 19 blocks) would run two at a time; the
engine, which takes blocks as tokens need them, must run at least four per round on average,
in every step, with the dense reference's tokens (each request stopped at its own eos) and
identical figures (step14_9's longer chunks: but for the rounds they take). A smaller pool
must preempt, and change no token. ``--total-blocks`` below
the largest request's whole life is refused before any work, with one ``error:`` line.

The bench serves requests ``while engine.has_work``, with no bound on rounds: every test here
runs under ``guard_every_engine`` (``tests/conftest.py``), so an engine that never finishes
(a request never admitted, say) fails its test in seconds instead of hanging the suite.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from bench import cli
from bench.batch import BatchRunner, Row, RunResult
from bench.costs import Floor
from bench.models import bench_config, load_step_model
from bench.reference import Reference
from bench.rows import notes, table
from bench.workloads import pressure
from bench.workloads.pressure import Pressure
from bench.workloads.shared_prefix import SharedPrefix
from common.config import preset
from common.inputs import blocks_for_request
from front.workload import pressure_prompt_lengths, pressure_prompts
from tests.helpers import (
    MAX_ROUNDS_PER_ENGINE,
    STEP_NAMES,
    bench_usage_error,
    has_fix,
    same_work_figures,
)

pytestmark = pytest.mark.usefixtures("guard_every_engine")


# ---- the flags ---------------------------------------------------------------------------------


def test_each_workload_has_its_own_defaults() -> None:
    shared = cli.parse([])
    assert shared.workload == "shared-prefix"
    got = (shared.requests, shared.new_tokens, shared.max_running, shared.block_size)
    assert got == (16, 32, 0, 16) and shared.total_blocks is None
    assert (shared.prefix_len, shared.tail_len) == (256, 32)
    small = cli.parse(["--workload", "pressure"])
    got = (small.requests, small.new_tokens, small.max_running, small.block_size)
    assert got == (24, 64, 8, 4) and small.total_blocks == 48
    assert (small.prefix_len, small.tail_len) == (None, None)  # not read
    given = cli.parse(["--workload", "pressure", "--requests", "5", "--block-size", "8"])
    assert (given.requests, given.block_size, given.new_tokens) == (5, 8, 64)


def test_the_pressure_prompts_are_short_and_drawn_lengths_first() -> None:
    """4 to 11 tokens each; the lengths do not depend on the vocabulary (the pool is checked
    against the longest before any model exists)."""
    lengths = pressure_prompt_lengths()
    assert len(lengths) == 24 and min(lengths) >= 4 and max(lengths) <= 11
    for vocab in (512, 1024, 50_000):
        assert [len(p) for p in pressure_prompts(24, vocab)] == lengths


def test_worst_case_reservation_runs_about_two_at_a_time() -> None:
    """The arithmetic the bench prints under its table: 48 // 17 = 2."""
    w = Pressure()
    reserved = [blocks_for_request(n, w.max_new_tokens, 4) for n in w.prompt_lengths()]
    assert min(reserved) >= 17 and w.total_blocks // min(reserved) == 2


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "need"),
    [
        (["--workload", "pressure", "--total-blocks", "18"], "needs 19 KV blocks of 4 tokens"),
        (["--total-blocks", "19"], "288 prompt + 32 new tokens needs 20 KV blocks of 16 tokens"),
        (["--workload", "pressure", "--new-tokens", "200", "--total-blocks", "48"], "needs 53"),
        (["--block-size", "8", "--total-blocks", "39"], "needs 40 KV blocks of 8 tokens"),
    ],
    ids=["pressure", "shared-prefix", "more-new-tokens", "block-size"],
)
def test_a_pool_too_small_for_the_largest_request_is_refused(
    argv: list[str], need: str, capsys
) -> None:
    line = bench_usage_error(argv, capsys)
    blocks = argv[argv.index("--total-blocks") + 1]
    assert need in line and f"the pool has {blocks}: raise total_blocks (--total-blocks)" in line
    assert "(--max-new-tokens)" in line  # the core's flag name, which the bench takes too


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--total-blocks", "0"], "argument --total-blocks: must be >= 1, got 0"),
        (["--total-blocks", "2.5"], "argument --total-blocks: '2.5' is not an integer"),
        (["--workload", "tight"], "argument --workload: invalid choice: 'tight'"),
        (["--workload", "pressure", "--prefix-len", "8"], "--prefix-len: --workload pressure"),
        (["--workload", "pressure", "--tail-len", "0"], "--tail-len: --workload pressure"),
    ],
    ids=["zero", "float", "workload", "prefix-len", "tail-len"],
)
def test_bad_pressure_flags_are_one_error_line(argv: list[str], message: str, capsys) -> None:
    line = bench_usage_error(argv, capsys)
    assert message in line, line


def test_a_pool_exactly_the_largest_request_is_accepted() -> None:
    options = cli.parse(["--workload", "pressure", "--total-blocks", "19"])
    longest = max(pressure.workload_of(options).prompt_lengths())
    assert options.total_blocks == 19 == blocks_for_request(longest, 64, 4)
    assert cli.parse(["--workload", "pressure", "--max-new-tokens", "9"]).new_tokens == 9


def test_help_names_each_workloads_default(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "(default: 16 for shared-prefix, 24 for pressure, unused for scale, 32 for serving, "
        "unused for replicas, unused for restart)"
    ) in text
    assert (
        "(default: room for every request at once for shared-prefix, 48 for pressure, "
        "unused for scale, room for every request at once for serving, room for every request at "
        "once for replicas, room for every request at once for restart)"
    ) in text
    assert (
        "(default: 256 for shared-prefix, unused for pressure, unused for scale, 64 for serving, "
        "256 for replicas, 256 for restart)"
    ) in text


# ---- every step on the pressure workload -------------------------------------------------------

MODEL = "demo"  # python -m bench's default


@cache
def pressure_setup(total_blocks: int, model: str = MODEL) -> tuple[Pressure, list, list]:
    """(workload with its eos ids, prompts, the dense reference's tokens), as the bench makes
    them: eos from the reference's own answers, each request stopped at its eos."""
    workload = Pressure(total_blocks=total_blocks)
    cfg = bench_config(workload, model, block_size=4)
    prompts = workload.prompts(cfg.vocab_size)
    reference = Reference(cfg, None)
    workload = pressure.pick_eos(workload, prompts, reference)
    return workload, prompts, reference.tokens(prompts, workload.max_new_tokens, workload.eos)


@cache
def pressure_run(step_name: str, total_blocks: int, model: str = MODEL) -> RunResult:
    workload, prompts, _ = pressure_setup(total_blocks, model)
    cfg = bench_config(workload, model, block_size=4)
    return BatchRunner(load_step_model(step_name, cfg)).run(prompts, workload)


def figures(result: RunResult) -> dict:
    """Everything a run reports but its time."""
    return {k: v for k, v in asdict(result).items() if k != "seconds"}


def test_each_request_stops_early_at_its_own_eos() -> None:
    workload, _, expected = pressure_setup(48)
    assert len(set(workload.eos)) > 1, "one eos per request, not one for all"
    for answer, eos in zip(expected, workload.eos):
        assert answer[-1] == eos and len(answer) <= 13 < workload.max_new_tokens


def test_every_step_runs_four_or_more_per_round_with_the_reference_tokens(
    step: ModuleType,
) -> None:
    """The Done-when of the pressure workload: >= 4 requests per round on average where
    reservation runs 2, tokens equal to the reference, the same figures in every step."""
    _, _, expected = pressure_setup(48)
    result = pressure_run(step.__name__, 48)
    assert result.outputs == expected
    assert result.seqs_per_round >= 4
    assert result.rounds > 0 and result.seqs_scheduled == result.seqs_per_round * result.rounds
    assert result.requests == 24 and result.blocks_peak <= 48
    first = figures(pressure_run(STEP_NAMES[0], 48))
    assert same_work_figures(figures(result), step) == same_work_figures(first, step)


def test_a_smaller_pool_preempts_and_changes_no_token(step: ModuleType) -> None:
    """Half the pool: requests are preempted and recomputed, every step counts the same
    preemptions (up to step14_8: step14_9's longer chunks take their blocks sooner), and the
    tokens stay the reference's (the tiny model: the same workload)."""
    _, _, expected = pressure_setup(24, "tiny")
    result = pressure_run(step.__name__, 24, "tiny")
    assert result.outputs == expected
    assert result.preemptions > 0
    if not has_fix(step, "step14_9"):
        assert figures(result) == figures(pressure_run(STEP_NAMES[0], 24, "tiny"))


def test_a_run_reports_the_engine_s_own_counters() -> None:
    """requests/round and preemptions come from EngineStats' own fields, not a neighbour that
    happens to be non-zero too (evictions, resumed tokens, requests)."""
    workload, prompts, expected = pressure_setup(24, "tiny")
    runner = BatchRunner(
        load_step_model(STEP_NAMES[-1], bench_config(workload, "tiny", block_size=4))
    )
    engine = runner.engine(workload)
    result = runner.serve(engine, prompts, workload)
    s = engine.stats
    assert result.outputs == expected
    assert (result.preemptions, result.rounds, result.seqs_scheduled) == (
        s.preemptions,
        s.rounds,
        s.seqs_scheduled,
    )
    assert result.seqs_per_round == s.seqs_per_round
    others = {s.evictions, s.resumed_cached_tokens, s.requests, s.requests_hit}
    assert s.preemptions not in others, "the figures must tell a wrong field apart"


def test_a_stuck_engine_fails_the_test_instead_of_hanging() -> None:
    """The guard the tests here run under: an engine ``BatchRunner`` builds, left with a request
    that its rounds never schedule (a livelock), raises once it has run
    ``MAX_ROUNDS_PER_ENGINE`` rounds, instead of looping for ever in ``serve_requests``."""
    workload = Pressure()
    model = load_step_model(STEP_NAMES[-1], bench_config(workload, "tiny", block_size=4))
    engine = BatchRunner(model).engine(workload)
    engine.add_request([1, 2, 3], 2)
    engine._schedule = lambda: iter(())  # every round runs nobody: the request never moves
    for _ in range(MAX_ROUNDS_PER_ENGINE):
        engine.step()
    assert engine.has_work
    with pytest.raises(AssertionError, match="still has work"):
        engine.step()


def test_the_default_pool_is_roomy_enough_never_to_preempt() -> None:
    """What docs/benchmarks.md says of the 48-block pool: 0 preemptions, 8 a round at most."""
    result = pressure_run(STEP_NAMES[-1], 48)
    assert result.preemptions == 0 and 4 <= result.seqs_per_round <= 8


# ---- what the bench prints ---------------------------------------------------------------------


FLOOR = Floor(10**9, 100.0)


def fake_row(name: str, result: RunResult) -> Row:
    return Row(name, "what it fixed", [result])


def cells(table: str) -> list[dict[str, str]]:
    lines = table.strip().splitlines()
    titles = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(titles, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]
    ]


def test_the_table_shows_requests_per_round_and_preemptions() -> None:
    """From rounds, seqs_scheduled and preemptions, each from its own field; "-" for a row
    without an engine (HF)."""
    engine = RunResult(
        [[1]], 1.0, requests=4, prompt_tokens=40, rounds=8, seqs_scheduled=52, preemptions=3
    )
    hf = RunResult([[1]], 1.0)
    rows = cells(table([fake_row("step14", engine)], [fake_row("HF generate", hf)], FLOOR))
    assert (rows[0]["requests/round"], rows[0]["preemptions"]) == ("6.50", "3")
    assert (rows[1]["requests/round"], rows[1]["preemptions"]) == ("-", "-")
    no_preemption = RunResult([[1]], 1.0, requests=4, prompt_tokens=40, rounds=2, seqs_scheduled=8)
    assert cells(table([fake_row("step14", no_preemption)], [], FLOOR))[0]["preemptions"] == "0"


def test_the_notes_say_what_reservation_would_run() -> None:
    workload = Pressure(eos=tuple(range(24)))
    cfg = preset(MODEL, block_size=4, total_blocks=48)
    outputs = [[1] * 9] * 24
    result = RunResult(outputs, 1.0, requests=24, rounds=37, seqs_scheduled=243, preemptions=0)
    options = cli.parse(["--workload", "pressure", "--repeats", "1"])
    text = " ".join(notes([fake_row("step14", result)], cfg, workload, options, FLOOR).split())
    assert "worst-case reservation would run at most 2 at a time" in text
    assert "each request reserves 17 to 19 blocks (prompt + max_new_tokens) of the 48-block" in text
    assert "(EngineStats.seqs_per_round; step14: 243 over 37 rounds)" in text
    assert "dense cache" not in text, "there is no HF row to explain"
    shared = notes([fake_row("step14", result)], preset(MODEL), SharedPrefix(), options, FLOOR)
    assert "worst-case reservation would run all 16 at a time too (max_running)" in shared


def test_the_pressure_run_end_to_end(tmp_path: Path, capsys) -> None:
    """The real command on the tiny model, two steps: the new columns, the reservation line,
    the HF row skipped with its reason, the reference check, and results.json."""
    last = STEP_NAMES[-1]
    argv = ["--workload", "pressure", "--model", "tiny", "--repeats", "1"]
    code = cli.main([*argv, "--steps", f"{STEP_NAMES[0]},{last}", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "24 requests: unrelated prompts of 4 to" in out and "max_running=8" in out
    assert "block_size=4, 48 blocks" in out
    assert "requests/round" in out and "preemptions" in out
    assert "worst-case reservation would run at most 2 at a time" in out
    assert "CTranslate2 rows skipped: one batched generate cannot stop each request" in out
    assert "(warm prefix)" not in out and "(no cache)" not in out
    assert "same tokens as the dense reference model" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["workload"]["kind"] == pressure.NAME
    assert len(data["settings"]["workload"]["eos"]) == 24
    first, second = data["rows"]
    assert first["seqs_per_round"] >= 4 and first["rounds"] > 0
    if not has_fix(last, "step14_9"):  # from it on, other rounds and preemptions (its README)
        keys = ("rounds", "seqs_scheduled", "seqs_per_round", "preemptions")
        assert [first[k] for k in keys] == [second[k] for k in keys]
    assert second["rounds"] > 0


def test_the_pressure_workload_is_documented() -> None:
    """docs/benchmarks.md names the workload, the flags and the new columns."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "benchmarks.md").read_text()
    for words in ("--workload pressure", "--total-blocks", "`requests/round`", "`preemptions`"):
        assert words in text, words
    assert "python -m bench --workload pressure" in (root / "README.md").read_text()
