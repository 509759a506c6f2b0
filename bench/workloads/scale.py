"""--workload scale: the engine's own cost, not the model's. Distinct short prompts on a
one-layer model (the toy preset): time per request as the requests grow (--sweep-requests)
and as the cache already holds more blocks (--sweep-cached, served --sweep-requests' first
count of requests). Every block operation is O(1), so every row stays flat; the last column
is the growth from the smallest size to the largest. Results go to --out: scale.json, and
scale.png when matplotlib is installed.

A block pool must cost the same per request whether it serves a hundred requests or a
hundred thousand, and whether its cache holds nothing or a million blocks. In the requests
sweep, the pool can keep every block the requests fill: the cache grows with them. In the
cached sweep, the cache already holds C blocks no request uses, in a pool with room for the
running requests only: once the free pool is gone, every allocation evicts a cached block.
The C blocks are put in the cache untimed, through the KV cache manager's own calls, the way a
finished request leaves them (``fill_cache``). Their token ids lie outside the vocabulary, so
no request can hit them and the model never reads their KV, which is never written.

A cell is milliseconds per request, the total and the engine's own share (the total minus the
model's: ``model_clock``), from its fastest run; the repeats go round every cell in turn, so a
busy spell of the machine spreads over all of them. Above ``FLAT``, a growth is a cost that
grows with the size. Every step must give the dense reference's tokens and the same
``EngineStats`` in a cell.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.config import PRESETS
from common.device import synchronize
from common.inputs import blocks_for_request
from front.cli import plural

from .. import charts
from ..cells import Cell, markdown
from ..models import StepModel, check_workload_memory, load_step_model, model_config
from ..options import BenchOptions
from ..progress import Progress
from ..reference import reference_tokens
from ..saved import saved_run_head, write_json

NAME = "scale"
SUMMARY = "time per request as the requests and the cache grow (the engine's own cost)"
DEFAULTS = dict(
    new_tokens=4,
    max_running=64,
    block_size=4,
    model="toy",
    sweep_requests=(512, 4096),
    sweep_cached=(0, 20_000, 100_000),
)
NOT_READ = "draws its own prompts and sizes its own runs (--sweep-requests, --sweep-cached)"
HELP = __doc__.split("\n\n")[0]

REQUESTS, CACHED = "requests", "cached"
HEADINGS = {REQUESTS: "requests served", CACHED: "blocks already cached"}
PROMPT_LENGTHS = (5, 8)  # tokens: two blocks of the toy model's four
FILLER_CHAIN = 4  # blocks per filler request
FILLER_TOKEN = 1 << 40  # filler token ids start here: beyond every vocabulary
FLAT = 1.5  # a growth above this is a cost that grows with the size, beyond a busy machine's


@dataclass(frozen=True)
class ScaleWorkload:
    """The two sweeps' sizes and the requests' shape."""

    requests: tuple[int, ...] = (512, 4096)  # the requests sweep: requests per run
    cached: tuple[int, ...] = (0, 20_000, 100_000)  # the cached sweep: blocks cached first
    cache_requests: int = 512  # requests per run of the cached sweep
    max_new_tokens: int = 4
    max_running: int = 64
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Distinct short prompts, as many as the largest run needs; a run of N takes the
        first N, so a smaller run's requests are a prefix of a larger one's."""
        rng, (low, high) = random.Random(self.seed), PROMPT_LENGTHS
        count = max(*self.requests, self.cache_requests)
        return [
            [rng.randrange(vocab_size) for _ in range(rng.randint(low, high))] for _ in range(count)
        ]

    def pool_blocks(self, sweep: str, size: int, block_size: int) -> int:
        """Requests sweep: room to cache every block of ``size`` requests. Cached sweep: the
        ``size`` cached blocks plus room for the running requests only."""
        per_request = blocks_for_request(PROMPT_LENGTHS[1], self.max_new_tokens, block_size)
        if sweep == REQUESTS:
            return size * per_request
        return size + self.max_running * per_request


@dataclass(frozen=True)
class Point:
    """Where a cell sits: its sweep, its size there, and how many requests it serves."""

    sweep: str
    size: int
    requests: int


@dataclass
class ScaleRun:
    """One run: ms per request (total, and the engine's own), its figures, its tokens."""

    total_ms: float
    engine_ms: float
    stats: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        return self.total_ms


ScaleCell = Cell[Point, ScaleRun]


def workload_of(options: BenchOptions) -> ScaleWorkload:
    return ScaleWorkload(
        requests=options.sweep_requests,
        cached=options.sweep_cached,
        cache_requests=options.sweep_requests[0],
        max_new_tokens=options.new_tokens,
        max_running=options.running(max(options.sweep_requests)),
    )


def check(options: BenchOptions) -> None:
    if options.model not in PRESETS:
        raise ValueError("--model: --workload scale runs on a preset (the prompts are random ids)")


def fill_cache(step, manager, num_blocks: int, hold: bool = False) -> list:
    """Put ``num_blocks`` blocks in ``manager``'s prefix cache the way requests leave them:
    each filler request caches a chain of ``FILLER_CHAIN`` full blocks, then lets go (its
    blocks are the cache's alone, evictable), or with ``hold`` keeps holding them, as a running
    request does (they are returned)."""
    block_size, held, pool = manager.block_size, [], manager.pool_figures()
    if num_blocks > pool["blocks_free"]:  # it would evict what it just cached
        raise ValueError(
            f"the free pool has no room for {num_blocks} more cached blocks "
            f"({pool['blocks_free']} free)"
        )
    first = pool["blocks_cached"] // FILLER_CHAIN
    for i in range(first, first + num_blocks // FILLER_CHAIN):
        seq = step.Sequence(-1 - i, [FILLER_TOKEN + i] * (FILLER_CHAIN * block_size), 1)
        assert manager.allocate_slots(seq, FILLER_CHAIN * block_size)
        for k in range(1, FILLER_CHAIN + 1):
            manager.cache_blocks(seq, k * block_size)
        if hold:
            held.append(seq)
        else:
            manager.free(seq)
    return held


@contextmanager
def model_clock(model: torch.nn.Module) -> Iterator[list[float]]:
    """The seconds spent in the model while the block runs, from each call's embedding
    lookup to its logits (forward hooks: nothing is patched). The rest of a run is the
    engine's own: scheduling, block bookkeeping, hashing, the glue around each model call."""
    spent, started, device = [0.0], [0.0], model.cfg.device

    def start(module: torch.nn.Module, args: tuple) -> None:
        synchronize(device)
        started[0] = time.perf_counter()

    def stop(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        synchronize(device)
        spent[0] += time.perf_counter() - started[0]

    hooks = [
        model.model.embed_tokens.register_forward_pre_hook(start),
        model.lm_head.register_forward_hook(stop),
    ]
    try:
        yield spent
    finally:
        for hook in hooks:
            hook.remove()


def run_once(model: StepModel, point: Point, prompts, workload: ScaleWorkload) -> ScaleRun:
    """``prompts`` once through a fresh engine (its cache filled first in the cached sweep)."""
    engine = model.engine(max_running=workload.max_running)
    if point.sweep == CACHED:
        fill_cache(model.step, engine.kv_cache_manager, point.size)
        engine.reset_stats()
    with model_clock(model.model) as in_model, torch.inference_mode():
        start = time.perf_counter()
        outputs = engine.generate(prompts, workload.max_new_tokens)
        synchronize(model.cfg.device)
        seconds = time.perf_counter() - start
    s, ms = engine.stats, 1000 / len(prompts)
    stats = ("cached_tokens", "computed_prefill_tokens", "computed_decode_tokens", "evictions")
    figures = {name: getattr(s, name) for name in (*stats, "preemptions", "blocks_cached")}
    return ScaleRun(seconds * ms, (seconds - in_model[0]) * ms, figures, outputs)


def run_sweeps(cfg, workload: ScaleWorkload, options: BenchOptions, progress: Progress) -> list:
    """Every step at every size, ``--repeats`` times round, one model (and pool) at a time."""
    prompts = workload.prompts(cfg.vocab_size)
    points = [Point(REQUESTS, n, n) for n in workload.requests]
    points += [Point(CACHED, c, workload.cache_requests) for c in workload.cached]
    cells = [ScaleCell(step, point) for step in options.steps for point in points]
    for repeat in range(options.repeats):
        for cell in cells:
            p = cell.setting
            with progress.task(f"{cell.name}: {p.sweep} {p.size:,}, run {repeat + 1}"):
                pool = workload.pool_blocks(p.sweep, p.size, cfg.block_size)
                cfg_here = cfg.replace(total_blocks=pool)
                model = load_step_model(cell.name, cfg_here, options=options)
                cell.runs.append(run_once(model, p, prompts[: p.requests], workload))
                del model  # its KV pool: one at a time
    return cells


def check_cells(cells: list[ScaleCell], expected: list[list[int]] | None) -> list[str]:
    """Tokens that differ from the reference or from the first step's at the same point, and
    stats that differ between steps. Empty: all agree."""
    problems, first = [], {}
    for cell in cells:
        p = cell.setting
        where, base = f"{cell.name}, {p.sweep} {p.size:,}", first.setdefault(p, cell)
        if expected is not None and any(r.outputs != expected[: p.requests] for r in cell.runs):
            problems.append(f"{where}: tokens differ from the dense reference")
        if any(r.outputs != base.runs[0].outputs for r in cell.runs):
            problems.append(f"{where}: tokens differ from {base.name}'s")
        if cell.runs[0].stats != base.runs[0].stats:
            mine, theirs = cell.runs[0].stats, base.runs[0].stats
            problems.append(f"{where}: stats {mine} differ from {base.name}'s {theirs}")
    return problems


def sweep_of(cells: list[ScaleCell], sweep: str) -> dict[str, dict[int, ScaleCell]]:
    """One sweep's cells: step -> size -> cell."""
    by_step: dict[str, dict[int, ScaleCell]] = {}
    for cell in cells:
        if cell.setting.sweep == sweep:
            by_step.setdefault(cell.name, {})[cell.setting.size] = cell
    return by_step


def growth(by_size: dict[int, ScaleCell]) -> float:
    """A step's time per request at the largest size over the smallest."""
    return by_size[max(by_size)].best.total_ms / by_size[min(by_size)].best.total_ms


def verdict(by_step: dict[str, dict[int, ScaleCell]]) -> str:
    """The line under a sweep's table: the largest growth, and whether it is flat."""
    worst = max(by_step, key=lambda step: growth(by_step[step]))
    ratio = growth(by_step[worst])
    if ratio <= FLAT:
        return f"largest growth of any step: {ratio:.2f}x ({worst}): flat (at most {FLAT}x)"
    return f"largest growth of any step: {ratio:.2f}x ({worst}): it grows with the size"


def table(sweep: str, by_step: dict[str, dict[int, ScaleCell]]) -> str:
    """A row per step, a column per size, and the growth from the smallest to the largest."""
    sizes = sorted({size for by_size in by_step.values() for size in by_size})
    titles = ["step", *(f"{s:,}" for s in sizes), f"{sizes[-1]:,} vs {sizes[0]:,}"]
    rows = [
        [
            step,
            *(f"{c.best.total_ms:.3f} ({c.best.engine_ms:.3f})" for c in by_size.values()),
            f"{growth(by_size):.2f}x",
        ]
        for step, by_size in by_step.items()
    ]
    heading = f"{HEADINGS[sweep]}: ms per request, total (the engine's own)"
    return f"{heading}\n{markdown(titles, rows)}\n{verdict(by_step)}"


def run(options: BenchOptions, progress: Progress) -> int:
    """Both sweeps, their tables, ``scale.json`` and ``scale.png``; 0 when all agree."""
    workload = workload_of(options)
    largest = max(
        workload.pool_blocks(CACHED, max(workload.cached), options.block_size),
        workload.pool_blocks(REQUESTS, max(workload.requests), options.block_size),
    )
    check_workload_memory(options, largest, max(*workload.requests) * PROMPT_LENGTHS[1])
    cfg = model_config(options, largest)
    print(
        f"scale: distinct prompts of {PROMPT_LENGTHS[0]} to {PROMPT_LENGTHS[1]} tokens, "
        f"{workload.max_new_tokens} new tokens each, max_running={workload.max_running}; model "
        f"{options.model} ({plural(cfg.num_layers, 'layer')}, d_model {cfg.d_model}), "
        f"block_size {cfg.block_size}, {options.dtype}, "
        f"{plural(torch.get_num_threads(), 'thread')}; the fastest of "
        f"{plural(options.repeats, 'run')} per cell"
    )
    cells = run_sweeps(cfg, workload, options, progress)
    expected = reference_tokens(options, progress, cfg, None, workload)
    return report(options, cfg, workload, cells, expected)


def report(options: BenchOptions, cfg, workload, cells: list[ScaleCell], expected) -> int:
    """Each sweep's table, the token and stats check, ``scale.json`` and the chart."""
    sweeps = {sweep: sweep_of(cells, sweep) for sweep in (REQUESTS, CACHED)}
    print("\n\n".join(table(sweep, by_step) for sweep, by_step in sweeps.items()))
    problems = check_cells(cells, expected)
    against = "each other" if expected is None else "the dense reference and each other"
    print("\n".join(problems) or f"every cell's tokens equal {against}; every step's stats agree")
    print(f"results: {save(options, cfg, workload, cells)}")
    lines = {
        HEADINGS[sweep]: {
            step: {size: (c.best.total_ms, c.best.engine_ms) for size, c in by_size.items()}
            for step, by_size in by_step.items()
        }
        for sweep, by_step in sweeps.items()
    }
    charts.sweeps(Path(options.out) / "scale.png", lines)
    return 1 if problems else 0


def save(options: BenchOptions, cfg, workload: ScaleWorkload, cells: list[ScaleCell]) -> str:
    """``scale.json``: the settings, and every repeat of every cell."""
    data = {
        **saved_run_head(cfg, asdict(workload), options, omit=("total_blocks",)),
        "cells": [
            {
                **asdict(cell.setting),
                "step": cell.name,
                "total_ms": [run.total_ms for run in cell.runs],
                "engine_ms": [run.engine_ms for run in cell.runs],
                "stats": cell.runs[0].stats,
            }
            for cell in cells
        ],
    }
    return write_json(options.out, "scale.json", data)
