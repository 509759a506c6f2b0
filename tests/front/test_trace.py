"""The round-by-round trace (``front/trace.py``, ``run.py --trace``) and its picture
(``front/trace_plot.py``, ``run.py --trace-png FILE``).

The trace watches an engine as its observer, replacing nothing, so it must tell what the
engine did: the blocks it
adopted are the tokens the stats call cached, the pool adds up after every round, every
ref_count is the requests holding the block plus the cache. And since every step moves the same
blocks in the same rounds, every step records the same trace, up to step14_8 (step14_9's longer
chunks move them in fewer rounds). The demo prints it and draws it; a bad picture path
stops the demo before any work, with one error line.
"""

from __future__ import annotations

import importlib
import random
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from common.status import SequenceStatus
from front import demo
from front.steps import load_step
from front.trace import RoundTrace, RoundTracer, format_trace
from front.workload import demo_prompts
from tests.conftest import STEP_NAMES, guard_against_hangs, tiny_config
from tests.helpers import budget_args, has_fix

ROOT = Path(__file__).resolve().parents[2]
BS = 4
POOL_LINE = re.compile(
    r"pool: (?P<free>\d+) free, (?P<in_use>\d+) in use \(\d+ cached\), (?P<only>\d+) cached only"
)


def demo_options(argv: list[str]) -> demo.DemoOptions:
    """What ``python -m <step>.run argv`` (the demo) reads from its flags."""
    return demo.read_options(demo.build_parser("run"), argv)


def shared_prefix_prompts(seed: int, n: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 512) for _ in range(3 * BS)]
    return [prefix + [rng.randrange(1, 512) for _ in range(rng.randint(0, 6))] for _ in range(n)]


def traced(step: ModuleType, total_blocks: int, seed: int = 0) -> tuple[list[RoundTrace], object]:
    """A batch of requests behind a shared prefix, an abort, more requests, a reset at rest,
    and one more request: every kind of block movement the trace knows, in a pool of
    ``total_blocks``. Returns the records and the engine's stats."""
    cfg = tiny_config(block_size=BS, total_blocks=total_blocks)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=4)
    guard_against_hangs(engine)
    tracer = RoundTracer(engine)
    prompts = shared_prefix_prompts(seed)
    ids = [engine.add_request(p, 7) for p in prompts[:5]]
    for _ in range(4):
        engine.step()
    engine.abort(ids[1])
    ids += [engine.add_request(p, 5) for p in prompts[5:]]
    while engine.has_work:
        engine.step()
    assert engine.reset_prefix_cache()
    engine.generate([prompts[0]], 3)
    tracer.detach()
    assert engine.ref_count_problems() == []
    return tracer.rounds, engine.stats


@cache
def first_step_trace(total_blocks: int) -> tuple[list[RoundTrace], object]:
    return traced(load_step(STEP_NAMES[0]), total_blocks)


@pytest.mark.parametrize("total_blocks", [64, 9])
def test_every_step_records_the_same_trace(step: ModuleType, total_blocks: int) -> None:
    """Roomy and tight (preemptions, evictions): the records, the text and the stats."""
    if has_fix(step, "step14_9"):
        pytest.skip("step14_9's chunks move the blocks in other rounds; traced as the next test")
    rounds, stats = traced(step, total_blocks)
    first_rounds, first_stats = first_step_trace(total_blocks)
    assert format_trace(rounds) == format_trace(first_rounds)
    assert rounds == first_rounds
    assert stats == first_stats


def test_the_tight_scenario_moves_blocks_every_way() -> None:
    rounds, stats = first_step_trace(9)
    work = [w for r in rounds for w in r.work]
    assert stats.preemptions > 0 and stats.evictions > 0
    assert {w.ended for w in work} == {"", "finished", "preempted", "aborted"}
    assert any(w.resumed for w in work) and any(w.waits for w in work)
    assert any(r.cleared for r in rounds)


@pytest.mark.parametrize("total_blocks", [64, 9])
def test_the_trace_tells_what_the_engine_did(step: ModuleType, total_blocks: int) -> None:
    """What the engine tells its observer adds up to what its counters say, in every step."""
    rounds, stats = traced(step, total_blocks)
    work = [w for r in rounds for w in r.work]
    assert all(w.preempted_for is not None for w in work if w.ended == "preempted")
    assert sum(w.end - w.start for w in work if w.kind == "prefill") == (
        stats.computed_prefill_tokens
    )
    assert sum(w.kind == "decode" for w in work) == stats.computed_decode_tokens
    assert sum(w.ended == "preempted" for w in work) == stats.preemptions
    assert sum(len(w.evicted) for w in work) == stats.evictions
    for r in rounds:
        assert r.pool.problems() == [], f"round {r.number}"  # ref_count = holders + cache
        allocated = {b for w in r.work for b in w.allocated}
        for w in r.work:
            assert set(w.adopted) <= set(r.pool.cached) | set(r.evicted)  # adopted: cached
            assert all(b not in r.pool.ref_counts or b in allocated for b in w.freed)
        for line in POOL_LINE.finditer(format_trace([r])):
            assert sum(int(n) for n in line.groups()) == r.pool.total_blocks
    last = rounds[-1].pool
    assert (last.num_free, len(last.cached)) == (stats.blocks_free, stats.blocks_cached)


def test_a_cold_batched_run_adopts_what_the_stats_call_cached(step: ModuleType) -> None:
    """The chapter's demo requests (block_size 4): every adopted block is prompt the cache
    served, and every block the trace says was cached is in the cache when the round ends."""
    cfg = tiny_config(block_size=BS, total_blocks=128)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=4)
    tracer = RoundTracer(engine)
    engine.generate(demo_prompts(cfg.vocab_size, BS), 6)
    adopted = [b for r in tracer.rounds for w in r.work for b in w.adopted]
    assert len(adopted) * BS == engine.stats.cached_tokens > 0
    for r in tracer.rounds:
        cached_now = {b for w in r.work for b in w.cached}
        assert cached_now <= set(r.pool.cached)
    text = format_trace(tracer.rounds)
    assert text.startswith("round 1 ") and "no block moves" in text
    assert re.search(r"adopt \[0[ \]]", text), "a request adopts the first block"


def test_full_blocks_the_cache_refuses_are_named(step: ModuleType) -> None:
    """A prompt answered twice: the second answer recomputes the prompt's last block, a copy
    of a cached one, and the output block after it cannot be cached (its parent is not)."""
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(tiny_config(block_size=BS)))
    prompt = list(range(1, 7))  # a block and a half
    engine.generate([prompt], 3)  # writes positions 0-7: blocks 0 and 1 are cached
    tracer = RoundTracer(engine)
    engine.generate([prompt], 8)  # writes 0-12: its own block 1 is a copy, block 2 an orphan
    work = [w for r in tracer.rounds for w in r.work]
    copies = [b for w in work for b in w.copies]
    orphans = [b for w in work for b in w.orphans]
    assert len(copies) == 1 and len(orphans) == 1
    text = format_trace(tracer.rounds)
    assert f"full [{copies[0]}] not cached (the cache has that prefix)" in text
    assert f"full [{orphans[0]}] not cached (the block before it is not)" in text


def test_a_preempted_request_resumes_and_is_aborted_in_the_trace(step: ModuleType) -> None:
    """A request preempted once is traced "preempted", then "resumed" (not "new") when it is
    admitted again; preempted a second time and aborted from the queue, it is traced "aborted",
    between rounds, with nothing left to free."""
    cfg = tiny_config(block_size=BS, total_blocks=6)
    # step14_9: under a budget of two blocks a round, which preempts the third request twice too
    budget = budget_args(step, 2 * BS)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=3, **budget)
    guard_against_hangs(engine)
    tracer = RoundTracer(engine)
    for i in range(3):
        engine.add_request(shared_prefix_prompts(i, 1)[0][: 2 * BS - 1], 12)

    def preempted(times: int):
        return [s for s in engine.scheduler.waiting if s.num_preemptions == times]

    while not preempted(1):
        engine.step()
    (victim,) = preempted(1)
    while victim.status is SequenceStatus.PREEMPTED:
        engine.step()
    admissions = [w for r in tracer.rounds for w in r.work if w.seq_id == victim.seq_id]
    assert [(w.new, w.resumed) for w in admissions if w.new or w.resumed] == [
        (True, False),
        (False, True),
    ]
    while victim not in preempted(2):
        engine.step()
    engine.abort(victim.seq_id)
    last = tracer.rounds[-1]
    assert last.between and [(w.seq_id, w.ended, w.freed) for w in last.work] == [
        (victim.seq_id, "aborted", [])
    ]
    assert "aborted: frees nothing" in format_trace([last])
    while engine.has_work:
        engine.step()
    assert engine.ref_count_problems() == []


def test_the_tracer_replaces_nothing_and_detaches(step: ModuleType) -> None:
    """The tracer is the engine's observer: while it watches, no method of the engine, its
    scheduler, KV cache manager, prefix cache, block manager or model is replaced on the
    instance (an attribute of its own, as ``guard_against_hangs`` sets, survives), and after
    ``detach`` nobody watches."""
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(tiny_config()))
    guard_against_hangs(engine)  # an instance attribute of its own: it must survive
    guarded, kvm = engine.step, engine.kv_cache_manager
    parts = [engine, engine.scheduler, kvm, kvm.prefix_cache, kvm.block_manager, engine.model]
    before = [set(vars(part)) for part in parts]
    tracer = RoundTracer(engine)
    engine.generate([list(range(1, 10))], 3)
    assert [set(vars(part)) for part in parts] == before
    assert tracer.rounds
    tracer.detach()
    seen = len(tracer.rounds)
    engine.generate([list(range(1, 10))], 3)
    assert len(tracer.rounds) == seen  # detached: nobody tells it any more
    assert engine.step is guarded


def test_a_refused_first_block_is_a_copy_not_an_orphan(step: ModuleType) -> None:
    """A one-block prompt sent again is recomputed into a block of its own (its last token's
    logits are needed), which the cache refuses: it holds that prefix. The block has no parent,
    so it is a copy, never "the block before it is not" cached."""
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(tiny_config(block_size=BS)))
    prompt = list(range(1, BS + 1))  # exactly one block
    engine.generate([prompt], 1)
    tracer = RoundTracer(engine)
    engine.generate([prompt], 1)
    (copy,) = [b for r in tracer.rounds for w in r.work for b in w.copies]
    assert not [b for r in tracer.rounds for w in r.work for b in w.orphans]
    text = format_trace(tracer.rounds)
    assert f"full [{copy}] not cached (the cache has that prefix)" in text
    assert "the block before it is not" not in text


# ---- the demo: --trace, --trace-png --------------------------------------------------------


def run_demo(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    run = importlib.import_module(f"{STEP_NAMES[-1]}.run")
    assert run.main(argv) == 0
    return capsys.readouterr().out


def test_the_demo_prints_and_draws_the_batched_round(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "pool.png"
    out = run_demo(["--max-new-tokens", "3", "--trace", "--trace-png", str(png)], capsys)
    assert "Trace of the batched round, cold cache:" in out
    trace = out[out.index("\nround 1 ") :]
    assert "req 3  new  adopt [0 1 2]" in trace  # the leapfrog, in round 1
    assert f"The pool, blocks x rounds: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_demo_traces_the_small_pool_round(capsys) -> None:
    out = run_demo(["--max-new-tokens", "4", "--trace", "--trace-round", "small-pool"], capsys)
    assert "Trace of the batched round in a small pool:" in out
    if has_fix(STEP_NAMES[-1], "step14_9"):  # a whole prompt's blocks are taken at admission
        assert "waits (its first chunk does not fit)" in out and "resumed" not in out
    else:
        assert "preempted" in out and "resumed" in out


def test_the_traced_demo_round_is_the_timed_one() -> None:
    """The demo traces its batched round again, after the timed rounds: the same work."""
    step = load_step(STEP_NAMES[-1])
    options = demo_options(["--max-new-tokens", "4"])
    cfg = options.config()
    rounds = demo.traced_round(step, cfg, options)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=4)
    engine.generate(demo_prompts(cfg.vocab_size, cfg.block_size), 4)
    adopted = sum(len(w.adopted) for r in rounds for w in r.work)
    assert adopted * cfg.block_size == engine.stats.cached_tokens
    assert len(rounds) == engine.stats.rounds


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no/such/dir/pool.png", "there is no directory"),
        (".", "is a directory"),
    ],
)
def test_a_bad_trace_png_stops_the_demo_at_once(
    path: str, message: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "load_step", lambda name: pytest.fail("work started"))
    run = importlib.import_module(f"{STEP_NAMES[0]}.run")
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--trace-png", path])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert captured.out == "" and len(errors) == 1 and message in errors[0], captured.err


def test_trace_png_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "matplotlib" else real_find_spec(name, *args),
    )
    with pytest.raises(SystemExit) as exit_info:
        demo_options(["--trace-png", str(tmp_path / "pool.png")])
    assert exit_info.value.code == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "pip install -e '.[plot]'" in error


# ---- the text front end -------------------------------------------------------------------


def test_the_text_front_end_traces_its_run(toy_checkpoint: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "text.png"
    system = "you are a concise assistant you are a concise assistant"
    argv = ["--model", str(toy_checkpoint), "--block-size", "4", "--system", system]
    argv += ["--prompt", "the capital of france is", "--prompt", "water boils at"]
    out = run_demo([*argv, "--max-new-tokens", "4", "--trace", "--trace-png", str(png)], capsys)
    assert "Trace of serving the prompts:" in out
    assert "req 1  new  adopt [0" in out  # the system prompt's blocks, shared
    assert png.stat().st_size > 0


# ---- step14's README ------------------------------------------------------------------------


def test_step14_readme_shows_the_picture_and_the_command_that_made_it() -> None:
    text = (ROOT / "step14" / "README.md").read_text()
    picture = re.search(r"!\[[^\]]*\]\(\.\./(docs/[\w.-]+\.png)\)", text)
    assert picture, "step14's README shows the pool picture"
    assert (ROOT / picture.group(1)).stat().st_size > 10_000
    assert f"python -m step14.run --trace --trace-png {picture.group(1)}" in text


def test_step14_readme_trace_excerpts_are_real_output() -> None:
    """The trace excerpts in step14's README are what ``--trace`` prints today: of the batched
    round, and of the small-pool round."""
    text = (ROOT / "step14" / "README.md").read_text()
    section = text[text.index("## Watching the pool") :]
    excerpts = re.findall(r"^```\n(round \d+ .*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert len(excerpts) == 2, "the batched round, then the small-pool round"
    step = load_step(STEP_NAMES[0])
    for excerpt, which in zip(excerpts, ["batched", "small-pool"], strict=True):
        options = demo_options(["--trace", "--trace-round", which])
        trace = format_trace(demo.traced_round(step, options.config(), options)).splitlines()
        lines = [line for line in excerpt.splitlines() if line != "..."]
        assert [line for line in lines if line not in trace] == [], which


def test_a_request_short_of_its_first_decode_block_is_short_of_a_token(step: ModuleType) -> None:
    """A request whose last prefill chunk ran in the round before needs a block for its first
    decode token: the trace says "its next token", not "its next chunk". Pool of 3 blocks of 4:
    A (5 tokens) and B (4 tokens) prefill in round 1; in round 2 A's last chunk takes the last
    free block, and B, the youngest, finds none for its token and preempts itself."""
    cfg = tiny_config(block_size=BS, total_blocks=3)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=2)
    guard_against_hangs(engine)
    tracer = RoundTracer(engine)
    engine.add_request([1, 2, 3, 4, 5], 3)
    b = engine.add_request([6, 7, 8, 9], 4)
    engine.step()
    engine.step()
    (short,) = [w for w in tracer.rounds[1].work if w.seq_id == b]
    assert (short.short, short.ended, short.preempted_for) == ("its next token", "preempted", b)
    assert "no block for its next token" in format_trace(tracer.rounds[1:2])
    while engine.has_work:
        engine.step()
