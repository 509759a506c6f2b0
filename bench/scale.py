"""``python -m bench --workload scale``: what a request costs as the work and the cache grow.

A block pool must cost the same per request whether it serves a hundred requests or a
hundred thousand, and whether its cache holds nothing or a million blocks: every block
operation is O(1). Two sweeps show it, every step side by side, on a model so small (the
``toy`` preset: one layer) that the engine's own work is a large part of each request:

- **requests**: N distinct short prompts, served together (up to ``max_running`` at a time) by
  a fresh engine whose pool can keep every block they fill: the cache grows with N;
- **cached**: the same first ``--cache-requests`` prompts, served by an engine whose cache
  already holds C blocks that no request uses, in a pool with room for the running requests
  only: once the free pool is gone, every allocation evicts a cached block.

The C blocks are put in the cache untimed, through the KV cache manager's own calls, the way a
finished request leaves them (``fill_cache``). Their token ids lie outside the vocabulary, so
no request can hit them and the model never reads their KV, which is never written.

Each cell is milliseconds per request: the total, and the engine's own share (the total minus
the model's: ``model_clock``). A cell is the fastest of ``--repeats`` runs, each through a fresh
engine; the repeats go round every cell in turn, so a busy spell of the machine spreads over
all of them. Every cell's tokens must equal the dense reference's, and every step must report
the same ``EngineStats`` in a cell.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.config import DTYPES, ModelConfig, preset
from common.front.steps import load_step
from common.inputs import blocks_for_request
from common.reference import ReferenceModel, reference_generate

from .costs import wait_for
from .progress import Progress
from .report import saved_run_head

REQUESTS, CACHED = "requests", "cached"
CELL = 18  # characters per column of the tables
PROMPT_LENGTHS = (5, 8)  # tokens: two blocks of the toy model's four
FILLER_CHAIN = 4  # blocks per filler request
FILLER_TOKEN = 1 << 40  # filler token ids start here: beyond every vocabulary


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
        rng = random.Random(self.seed)
        count = max(*self.requests, self.cache_requests)
        low, high = PROMPT_LENGTHS
        return [
            [rng.randrange(vocab_size) for _ in range(rng.randint(low, high))] for _ in range(count)
        ]

    def blocks_per_request(self, block_size: int) -> int:
        """The most blocks one request holds (its longest prompt + its new tokens)."""
        return blocks_for_request(PROMPT_LENGTHS[1], self.max_new_tokens, block_size)

    def pool_blocks(self, sweep: str, size: int, block_size: int) -> int:
        """Requests sweep: room to cache every block of ``size`` requests. Cached sweep: the
        ``size`` cached blocks plus room for the running requests only."""
        per_request = self.blocks_per_request(block_size)
        if sweep == REQUESTS:
            return size * per_request
        return size + self.max_running * per_request


@dataclass
class Cell:
    """One step's run at one size: milliseconds per request, and what the engine reported."""

    step: str
    sweep: str
    size: int
    requests: int
    total_ms: list[float] = field(default_factory=list)  # one per repeat
    engine_ms: list[float] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def best(self) -> int:
        """The fastest repeat's index."""
        return min(range(len(self.total_ms)), key=self.total_ms.__getitem__)


def fill_cache(step, manager, num_blocks: int, hold: bool = False) -> list:
    """Put ``num_blocks`` blocks in ``manager``'s prefix cache the way requests leave them:
    each filler request allocates a chain of ``FILLER_CHAIN`` blocks and caches each block
    once full, then lets go (``free``: its blocks are the cache's alone, evictable), or with
    ``hold`` keeps holding them, as a request still running does (they are returned). Their
    token ids lie beyond every vocabulary: no real prompt can match them."""
    block_size, held = manager.block_size, []
    if num_blocks > manager.block_manager.num_free:  # it would evict what it just cached
        raise ValueError(
            f"the free pool has no room for {num_blocks} more cached blocks "
            f"({manager.block_manager.num_free} free)"
        )
    first = len(manager.prefix_cache) // FILLER_CHAIN
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
    lookup to its logits (forward hooks on the model's first and last modules: nothing is
    patched). What is left of a run's time is the engine's own: scheduling, block bookkeeping,
    hashing, and the glue around each model call."""
    spent, started = [0.0], [0.0]
    device = model.cfg.device

    def start(module: torch.nn.Module, args: tuple) -> None:
        wait_for(device)
        started[0] = time.perf_counter()

    def stop(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        wait_for(device)
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


class ScaleRunner:
    """One step's model at one pool size, kept across repeats; a fresh engine every run."""

    def __init__(self, step_name: str, cfg: ModelConfig) -> None:
        self.step = load_step(step_name)
        self.model = self.step.TinyTransformerPaged(cfg)

    def run(self, cell: Cell, prompts: list[list[int]], workload: ScaleWorkload) -> None:
        """Serve ``prompts`` once through a fresh engine (its cache filled first, untimed, in
        the cached sweep); add the time per request to ``cell``."""
        engine = self.step.PagedPrefixCacheEngine(self.model, max_running=workload.max_running)
        if cell.sweep == CACHED:
            fill_cache(self.step, engine.kv_cache_manager, cell.size)
            engine.reset_stats()
        with model_clock(self.model) as in_model, torch.inference_mode():
            start = time.perf_counter()
            cell.outputs = engine.generate(prompts, workload.max_new_tokens)
            wait_for(self.model.cfg.device)
            seconds = time.perf_counter() - start
        ms = 1000 / len(prompts)
        cell.total_ms.append(seconds * ms)
        cell.engine_ms.append((seconds - in_model[0]) * ms)
        s = engine.stats
        cell.stats = {
            "cached_tokens": s.cached_tokens,
            "computed_prefill_tokens": s.computed_prefill_tokens,
            "computed_decode_tokens": s.computed_decode_tokens,
            "evictions": s.evictions,
            "preemptions": s.preemptions,
            "blocks_cached": s.blocks_cached,
        }


def run_scale(
    cfg: ModelConfig,
    workload: ScaleWorkload,
    steps: list[str],
    repeats: int,
    progress: Progress,
) -> list[Cell]:
    """Every step at every size of both sweeps, ``repeats`` times round."""
    prompts = workload.prompts(cfg.vocab_size)
    plan = [(REQUESTS, n, n) for n in workload.requests]
    plan += [(CACHED, c, workload.cache_requests) for c in workload.cached]
    cells = [Cell(step, sweep, size, n) for step in steps for sweep, size, n in plan]
    for repeat in range(repeats):
        for cell in cells:
            label = f"{cell.step}: {cell.sweep} {cell.size:,}, run {repeat + 1}/{repeats}"
            with progress.task(label):
                total_blocks = workload.pool_blocks(cell.sweep, cell.size, cfg.block_size)
                runner = ScaleRunner(cell.step, cfg.replace(total_blocks=total_blocks))
                runner.run(cell, prompts[: cell.requests], workload)
                del runner  # its KV pool: one at a time
    return cells


def reference_outputs(cfg: ModelConfig, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The dense, cache-free model's tokens for every prompt (the oracle)."""
    return reference_generate(ReferenceModel(cfg), prompts, new)


def check(cells: list[Cell], expected: list[list[int]] | None) -> list[str]:
    """What is wrong with the cells: tokens that differ from the reference, or from the first
    step's in the same cell, or stats that differ between steps. Empty: all agree."""
    problems, first = [], {}
    for cell in cells:
        key = (cell.sweep, cell.size)
        where = f"{cell.step}, {cell.sweep} {cell.size:,}"
        if expected is not None and cell.outputs != expected[: cell.requests]:
            problems.append(f"{where}: tokens differ from the dense reference")
        base = first.setdefault(key, cell)
        if cell.outputs != base.outputs:
            problems.append(f"{where}: tokens differ from {base.step}'s")
        if cell.stats != base.stats:
            problems.append(f"{where}: stats {cell.stats} differ from {base.step}'s {base.stats}")
    return problems


def growth(cells: list[Cell], step: str, sweep: str) -> float:
    """The step's time per request at the sweep's largest size over its smallest."""
    mine = sorted((c for c in cells if c.step == step and c.sweep == sweep), key=lambda c: c.size)
    return min(mine[-1].total_ms) / min(mine[0].total_ms)


def table(cells: list[Cell], steps: list[str], sweep: str) -> str:
    """One sweep: a row per step, a column per size (total ms per request, the engine's own
    in brackets), and the growth from the smallest size to the largest."""
    sizes = sorted({c.size for c in cells if c.sweep == sweep})
    by_key = {(c.step, c.size): c for c in cells if c.sweep == sweep}
    heading = "requests served" if sweep == REQUESTS else "blocks already cached"
    header = f"  {'step':<10}" + "".join(f"{size:>{CELL},}" for size in sizes)
    header += f"{f'{sizes[-1]:,} vs {sizes[0]:,}':>{CELL}}"
    lines = [f"  {heading}: ms per request, total (the engine's own)", header]
    for step in steps:
        row = f"  {step:<10}"
        for size in sizes:
            cell = by_key[step, size]
            figures = f"{cell.total_ms[cell.best]:.3f} ({cell.engine_ms[cell.best]:.3f})"
            row += f"{figures:>{CELL}}"
        lines.append(row + f"{growth(cells, step, sweep):>{CELL - 1}.2f}x")
    return "\n".join(lines)


def report(cells: list[Cell], steps: list[str], workload: ScaleWorkload) -> str:
    """Both tables, and the largest growth of any step in each sweep."""
    parts = []
    for sweep in (REQUESTS, CACHED):
        if any(c.sweep == sweep for c in cells):
            parts.append(table(cells, steps, sweep))
            worst = max(growth(cells, step, sweep) for step in steps)
            parts.append(f"  largest growth of any step: {worst:.2f}x")
    return "\n\n".join(parts)


def save(out: str, cfg: ModelConfig, workload: ScaleWorkload, cells: list[Cell]) -> Path:
    """``scale.json`` (every repeat of every cell, the settings) and, with matplotlib,
    ``scale.png``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        **saved_run_head(cfg, asdict(workload), omit=("total_blocks",)),
        "cells": [{k: v for k, v in asdict(cell).items() if k != "outputs"} for cell in cells],
    }
    path = folder / "scale.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    chart(folder / "scale.png", cells)
    return path


def chart(path: Path, cells: list[Cell]) -> None:
    """Time per request against each sweep's size, a line per step: flat is O(1)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no chart: pip install -e '.[plot]' for matplotlib)")
        return
    sweeps = [s for s in (REQUESTS, CACHED) if any(c.sweep == s for c in cells)]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6 * len(sweeps), 7), squeeze=False)
    steps = list(dict.fromkeys(c.step for c in cells))
    for col, sweep in enumerate(sweeps):
        for row, (what, label) in enumerate(
            [
                ("total_ms", "ms per request, total"),
                ("engine_ms", "ms per request, the engine's own"),
            ]
        ):
            ax = axes[row][col]
            for step in steps:
                mine = sorted(
                    (c for c in cells if c.step == step and c.sweep == sweep), key=lambda c: c.size
                )
                ax.plot(
                    [c.size for c in mine],
                    [getattr(c, what)[c.best] for c in mine],
                    marker="o",
                    label=step,
                )
            sizes = sorted({c.size for c in cells if c.sweep == sweep})
            ax.set_xscale("symlog", linthresh=max(1, min(s for s in sizes if s) // 2))
            ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_ylabel(label)
            ax.set_xlabel("requests served" if sweep == REQUESTS else "blocks already cached")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time per request as the work and the cache grow (flat: O(1) per block)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scale_bench(args, progress: Progress) -> int:
    """``python -m bench --workload scale``: both sweeps, the tables, ``scale.json``; 0 when
    every cell's tokens equal the dense reference's and every step's stats agree."""
    workload = ScaleWorkload(
        requests=args.sweep_requests,
        cached=args.sweep_cached,
        cache_requests=args.sweep_requests[0],
        max_new_tokens=args.new_tokens,
        max_running=args.max_running or max(args.sweep_requests),
    )
    cfg = preset(
        args.model, block_size=args.block_size, device=args.device, dtype=DTYPES[args.dtype]
    )
    print(
        f"scale: distinct prompts of {PROMPT_LENGTHS[0]} to {PROMPT_LENGTHS[1]} tokens, "
        f"{workload.max_new_tokens} new tokens each, max_running={workload.max_running}; model "
        f"{args.model} ({cfg.num_layers} layer(s), d_model {cfg.d_model}), block_size "
        f"{cfg.block_size}, {cfg.dtype}, {torch.get_num_threads()} thread(s); fastest of "
        f"{args.repeats} run(s) per cell"
    )
    cells = run_scale(cfg, workload, args.steps, args.repeats, progress)
    expected = None
    if not args.no_reference:
        with progress.task("dense reference"):
            prompts = workload.prompts(cfg.vocab_size)
            expected = reference_outputs(cfg, prompts, workload.max_new_tokens)
    print(report(cells, args.steps, workload))
    problems = check(cells, expected)
    against = "each other" if expected is None else "the dense reference and each other"
    print(
        "\n".join(problems)
        if problems
        else f"  every cell's tokens equal {against}; every step's stats agree"
    )
    print(f"results: {save(args.out, cfg, workload, cells)}")
    return 1 if problems else 0
