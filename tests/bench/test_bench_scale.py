"""``python -m bench --workload scale``: time per request as the work and the cache grow.

The figures themselves are timings, so nothing here asserts on them
(``tests/engine/test_pool_cost.py`` pins the O(1) cost by counting instead). What is tested is that
the sweep measures what it says: the cache really holds the blocks it claims, none of them reachable
by a real prompt; every cell's tokens are checked against the dense reference and across steps, and
a disagreement fails the run; the model's time is split off without patching anything; the flags are
checked before any work; a small run writes its table, its growth ratios and ``scale.json``; and the
growth is the largest size over the smallest, with its verdict, "flat" only when it is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import cli
from bench.workloads import scale
from common.config import preset
from front.steps import load_step
from tests.helpers import STEP_NAMES, bench_usage_error

SMALL_RUN = ["--workload", "scale", "--sweep-requests", "8,16", "--sweep-cached", "0,64"]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "scale", "--prefix-len", "8"], "--prefix-len: --workload scale draws"),
        (["--workload", "scale", "--requests", "8"], "--requests: --workload scale draws"),
        (["--workload", "scale", "--total-blocks", "9"], "--total-blocks: --workload scale"),
        (["--sweep-requests", "8,16"], "--sweep-requests: only --workload scale reads it"),
        (["--workload", "pressure", "--sweep-cached", "0,8"], "--sweep-cached: only --workload"),
        (["--workload", "scale", "--sweep-requests", "16,8"], "two or more sizes, increasing"),
        (["--workload", "scale", "--sweep-cached", "0"], "two or more sizes, increasing"),
        (["--workload", "scale", "--sweep-cached", "0,x"], "not a comma-separated list"),
        (["--workload", "scale", "--sweep-cached=-5,0"], "sizes must be >= 0"),
    ],
    ids=[
        "prefix-len",
        "requests",
        "total-blocks",
        "not-scale",
        "pressure",
        "order",
        "one",
        "text",
        "negative",
    ],
)
def test_bad_scale_flags_are_one_error_line(argv: list[str], message: str, capsys) -> None:
    line = bench_usage_error(argv, capsys)
    assert message in line, line


def test_scale_defaults_and_a_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    args = cli.parse(["--workload", "scale"])
    workload = scale.ScaleWorkload()
    assert (args.sweep_requests, args.sweep_cached) == (workload.requests, workload.cached)
    assert (args.model, args.block_size, args.new_tokens, args.max_running) == ("toy", 4, 4, 64)
    assert scale.workload_of(args) == workload
    (tmp_path / "config.json").write_text("{}")
    line = bench_usage_error(["--workload", "scale", "--model", str(tmp_path)], capsys)
    assert "--workload scale runs on a preset" in line


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_fill_cache_leaves_exactly_that_many_evictable_blocks(step_name: str) -> None:
    """The cached sweep's premise: the cache holds the blocks, all evictable (held by the cache
    alone), the free pool is what is left, and no prompt of the vocabulary can hit them."""
    step = load_step(step_name)
    manager = step.KVCacheManager(100, 4, enable_prefix_cache=True)
    scale.fill_cache(step, manager, 64)
    assert (len(manager.prefix_cache), manager.prefix_cache.num_evictable) == (64, 64)
    assert manager.block_manager.num_free == 36 and manager.num_available_blocks == 100
    held = scale.fill_cache(step, manager, 32, hold=True)
    assert len(held) == 32 // scale.FILLER_CHAIN and len(manager.prefix_cache) == 96
    assert manager.prefix_cache.num_evictable == 64  # the held ones are not evictable
    assert min(t for seq in held for t in seq.prompt_ids) >= scale.FILLER_TOKEN
    with pytest.raises(ValueError, match="no room"):
        scale.fill_cache(step, manager, 8)


def test_model_clock_times_the_model_and_patches_nothing() -> None:
    """The model's share is measured by forward hooks, removed afterwards: it is part of the
    run's time, whether the step calls the model once per sequence (step14) or once per round
    (step14_7), and no attribute of the model is replaced."""
    for step_name in ("step14", "step14_7"):
        step = load_step(step_name)
        model = step.TinyTransformerPaged(preset("toy"))
        engine = step.PagedPrefixCacheEngine(model)
        attributes = set(vars(model))
        with scale.model_clock(model) as spent, torch.inference_mode():
            start = time.perf_counter()
            engine.generate([[1, 2, 3, 4, 5]], 3)
            total = time.perf_counter() - start
        assert 0 < spent[0] < total
        assert not model.model.embed_tokens._forward_pre_hooks
        assert not model.lm_head._forward_hooks
        assert set(vars(model)) == attributes


def cell(step: str, outputs: list[list[int]], evictions: int = 0, size: int = 2, ms: float = 1.0):
    point = scale.Point(scale.REQUESTS, size, 2)
    return scale.ScaleCell(
        step, point, [scale.ScaleRun(ms, ms / 2, {"evictions": evictions}, outputs)]
    )


def test_check_catches_tokens_and_stats_that_disagree() -> None:
    good = [[1, 2], [3, 4]]
    assert scale.check_cells([cell("a", good), cell("b", good)], [*good, [5, 6]]) == []
    wrong = scale.check_cells([cell("a", good), cell("b", [[1, 2], [3, 5]])], good)
    assert any("b, requests 2: tokens differ from the dense reference" in p for p in wrong)
    assert any("tokens differ from a's" in p for p in wrong)
    stats = scale.check_cells([cell("a", good), cell("b", good, evictions=1)], None)
    assert len(stats) == 1 and "stats" in stats[0]


def sweep(ms_by_size: dict[int, float]) -> dict[str, dict[int, scale.ScaleCell]]:
    """One step's cells of one sweep, each a run of ``ms`` per request."""
    cells = [cell("step14", [], size=size, ms=ms) for size, ms in ms_by_size.items()]
    return scale.sweep_of(cells, scale.REQUESTS)


def test_growth_is_the_largest_size_over_the_smallest_with_its_verdict() -> None:
    """A cost that grows with the work reads above 1x and is not flat; one that does not
    reads 1x, flat; one that falls (a fixed cost spread over more requests) reads below 1x."""
    grows = sweep({512: 1.0, 4096: 3.0, 1024: 2.0})
    assert scale.growth(grows["step14"]) == 3.0
    assert "3.00x (step14): it grows with the size" in scale.verdict(grows)
    flat = sweep({0: 2.0, 100_000: 2.0 * scale.FLAT})
    assert f"{scale.FLAT:.2f}x (step14): flat (at most {scale.FLAT}x)" in scale.verdict(flat)
    assert scale.growth(sweep({8: 2.0, 16: 1.0})["step14"]) == 0.5
    text = scale.table(scale.REQUESTS, grows)
    assert "| 4,096 vs 512 |" in text and "3.00x |" in text and "it grows with the size" in text


def test_a_small_scale_run_prints_both_sweeps_and_saves_them(tmp_path: Path, capsys) -> None:
    steps = "step14,step14_7"
    argv = [*SMALL_RUN, "--steps", steps, "--repeats", "1", "--max-running", "2", "--quiet"]
    argv += ["--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "requests served: ms per request" in out and "blocks already cached" in out
    assert "| 16 vs 8 |" in out and "| 64 vs 0 |" in out
    assert out.count("largest growth of any step") == 2
    assert "every cell's tokens equal the dense reference and each other" in out
    data = json.loads((tmp_path / "scale.json").read_text())
    cells = data["cells"]
    assert {(c["step"], c["sweep"], c["size"]) for c in cells} == {
        (s, sweep, size)
        for s in steps.split(",")
        for sweep, sizes in ((scale.REQUESTS, (8, 16)), (scale.CACHED, (0, 64)))
        for size in sizes
    }
    for c in cells:
        assert c["requests"] == (c["size"] if c["sweep"] == scale.REQUESTS else 8)
        assert 0 < min(c["engine_ms"]) < min(c["total_ms"])
    cached = [c for c in cells if c["sweep"] == scale.CACHED and c["size"] == 64]
    assert all(c["stats"]["evictions"] > 0 for c in cached)  # room for 2 requests: it evicts
