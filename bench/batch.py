"""Every request at once through a fresh engine, timed: a row of the shared-prefix and
pressure workloads (and of the pytest-benchmark suites, ``bench/suites/``).

A row is a ``Cell`` of ``RunResult``s: its runs' times, and the figures of what it computed,
which every run shares (the work is the same each time; only the time varies).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from common.device import synchronize
from common.memory import kv_bytes_per_block

from .cells import Cell
from .costs import TokenWork, counting, model_flops
from .models import StepModel
from .progress import Progress

Row = Cell[str, "RunResult"]  # a row: its name, what it fixed, its runs
# The engine's counters a row keeps, under ``EngineStats``' names.
COUNTERS = ("requests", "requests_hit", "prompt_tokens", "cached_tokens", "blocks_peak")
COUNTERS += ("computed_prefill_tokens", "computed_decode_tokens", "rounds", "seqs_scheduled")
COUNTERS += ("preemptions",)


class Batch(Protocol):
    """What serving a batch needs to know of its workload."""

    max_new_tokens: int
    max_running: int
    eos: tuple[int, ...] | None  # one per request, or None: every answer runs to its length


@dataclass
class RunResult:
    """One run's tokens and time, the engine's counters, and what the run cost (a peer, with
    no engine, fills in the computed tokens, FLOPs and KV bytes from its own formulas)."""

    outputs: list[list[int]]
    seconds: float
    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    computed_decode_tokens: int = 0
    blocks_peak: int = 0  # the most blocks out of the free pool at once (0: not paged)
    kv_peak_bytes: int = 0  # the KV memory those blocks (or a dense cache) took
    flops: int = 0  # model FLOPs of what was computed (bench.costs.model_flops)
    # How many ran at once, and what memory pressure cost (0 for a row without an engine).
    rounds: int = 0  # rounds that ran at least one sequence
    seqs_scheduled: int = 0  # sequences run, summed over the rounds
    preemptions: int = 0

    @property
    def seqs_per_round(self) -> float:
        """Sequences a round ran, on average (``EngineStats.seqs_per_round``)."""
        return self.seqs_scheduled / self.rounds if self.rounds else 0.0


def serve_requests(engine, prompts: list[list[int]], workload: Batch) -> list[list[int]]:
    """Every prompt through ``engine``, served together, each stopped at its own eos if any."""
    if workload.eos is None:
        return engine.generate(prompts, workload.max_new_tokens)
    ids = [
        engine.add_request(prompt, workload.max_new_tokens, eos)
        for prompt, eos in zip(prompts, workload.eos, strict=True)
    ]
    while engine.has_work:
        engine.step()
    return [engine.pop_output(rid) for rid in ids]


class BatchRunner:
    """One step's model, kept across runs; each run gets a fresh engine (a cold cache)."""

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self.live: TokenWork | None = None  # the run in progress's count, for a status line

    def engine(
        self,
        workload: Batch,
        enable_prefix_cache: bool = True,
        earlier_prompt: list[int] | None = None,
    ):
        """A fresh engine; with ``earlier_prompt``, after that request was served (its prefix
        cached, as on a server that has seen traffic) and the counters zeroed (``blocks_peak``
        still counts the cached prefix: memory the timed requests use)."""
        engine = self.model.engine(
            max_running=workload.max_running, enable_prefix_cache=enable_prefix_cache
        )
        if earlier_prompt is not None:
            with torch.inference_mode():
                engine.generate([earlier_prompt], 1)
            engine.reset_stats()
        return engine

    def serve(self, engine, prompts: list[list[int]], workload: Batch) -> RunResult:
        """Time ``prompts`` through ``engine``: only this is measured."""
        cfg = self.model.cfg
        with counting(engine) as work:
            self.live = work
            start = time.perf_counter()
            with torch.inference_mode():
                outputs = serve_requests(engine, prompts, workload)
            synchronize(cfg.device)
            seconds = time.perf_counter() - start
        self.live = None
        work.sampled = sum(len(ids) for ids in outputs)
        s = engine.stats
        kv_peak_bytes, flops = s.blocks_peak * kv_bytes_per_block(cfg), model_flops(cfg, work)
        counters = {name: getattr(s, name) for name in COUNTERS}
        return RunResult(outputs, seconds, **counters, kv_peak_bytes=kv_peak_bytes, flops=flops)

    def run(
        self,
        prompts: list[list[int]],
        workload: Batch,
        enable_prefix_cache: bool = True,
        earlier_prompt: list[int] | None = None,
    ) -> RunResult:
        """A fresh engine (``earlier_prompt`` served first, untimed), then ``prompts``, timed."""
        engine = self.engine(workload, enable_prefix_cache, earlier_prompt)
        return self.serve(engine, prompts, workload)

    def computed_so_far(self) -> str:
        """The running engine's computed tokens so far, for the status line."""
        return f"{self.live.tokens:,} tokens computed" if self.live is not None else ""


@dataclass
class Timing:
    """A row to measure: how to run it once, and whether it first gets an untimed run."""

    row: Row
    run: Callable[[], RunResult]
    warmup: bool = False
    live: Callable[[], str] | None = None  # the status line's figure while a run goes on


def measure(timings: list[Timing], repeats: int, progress: Progress) -> None:
    """``repeats`` runs of every row, in passes: each pass runs every row once, so a moment
    when the machine is busy with something else costs one run of a few rows, never every
    run of one row, and each row's best run stands beside its neighbours' best (one line per
    row when all are done). ``warmup``: one untimed run before the first pass, since the first
    torch work of a process pays one-time costs (thread pools, kernel selection, the
    allocator growing) that no later run pays."""
    for timing in timings:
        if timing.warmup:
            run_once(timing, "warm-up run (untimed)", progress)
    for i in range(repeats):
        for timing in timings:
            timing.row.runs.append(run_once(timing, f"run {i + 1}/{repeats}", progress))
    for row in (timing.row for timing in timings):
        times = "".join(f" {s:6.2f}s" for s in row.seconds)
        print(f"  {row.name:<26}{times}" + (f"  ! {row.spread:.2f}x apart" if row.flagged else ""))


def run_once(timing: Timing, note: str, progress: Progress) -> RunResult:
    """One run of a row, its name and ``note`` on the status line while it is slow."""
    with progress.task(timing.row.name) as task:
        task.live, task.note = timing.live, note
        return timing.run()
