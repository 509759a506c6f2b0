"""``python -m bench --workload serving``: what a user waiting for an answer sees.

The other workloads hand the engine every request at once and time the whole batch. A server
is not asked that way: requests arrive one by one while earlier ones are being answered, and a
user cares about two delays, not the batch's total (vLLM's ``benchmark_serving`` reports the
same two):

- **TTFT**, time to first token: from the request's arrival to the round that hands back its
  first token. Queueing, then the prefill of its prompt: what the prefix cache shortens;
- **TPOT**, time per output token after the first: ``(last - first) / (tokens - 1)``, the pace
  of the answer once it streams. Every round that runs a decode token of it also runs whatever
  else is in the batch: what continuous batching (and step14_7's one model call per round)
  keeps low while new requests keep arriving.

Requests arrive as a seeded Poisson process at ``--request-rate`` requests per second
(exponential gaps between arrivals, the first at time 0, as ``benchmark_serving`` sends them;
``inf``: all at once). Every prompt is a shared prefix (a system prompt) and tokens of its own,
so the prefix cache has something to serve. Each step runs with the prefix cache on and off,
and the last step once more with ``max_running=1``: one request at a time, first come first
served, the baseline that shows what continuous batching buys.

The clock (``ServingClock``) is the wall clock with the idle waits cut out. The driver adds
every request whose arrival time has passed, runs one ``engine.step()`` and advances the
clock by the seconds that took (``time.perf_counter``: the real model calls are what is
measured). When the engine has nothing to do and the next request has not arrived, the clock
jumps to its arrival instead of sleeping: nobody is waiting then, so the jump changes no
latency, and the run costs its busy time only, without a sleep's overshoot. A request that
arrives while a round runs waits for the round's end, as it would on a real server, and that
wait is part of its TTFT.

The arrivals are the same in every cell, but how many requests share a round depends on how
fast the rounds are, so a run's rounds (and its prefix reuse) differ from step to step and
from run to run; the tokens do not (each request's are greedy, checked against the dense
reference). A cell shows the run with the least busy time of its ``--repeats`` (the others
were slowed by whatever else the machine was doing); the repeats go round every cell in turn.
The p99 of N requests sits ``0.99 * (N - 1)`` places up the sorted list: of the default 32, 69%
of the way from the second slowest request to the slowest.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.config import ModelConfig
from common.front.cli import plural
from common.front.steps import load_step
from common.reference import ReferenceModel, reference_generate

from .costs import wait_for
from .harness import Workload
from .progress import Progress
from .report import RERUN_HINT, saved_run_head
from .rows import SPREAD_FLAG

SERVING = "serving"


@dataclass(frozen=True)
class ServingWorkload(Workload):
    """The requests and when they arrive: ``num_requests`` prompts, each a ``prefix_len``-token
    shared prefix + ``tail_len`` tokens of its own, ``max_new_tokens`` each, arriving at
    ``request_rate`` per second (``math.inf``: all at time 0). Small by default, so that every
    step, cache on and off, three times round, runs in a minute or two on two CPU cores with
    the ``demo`` model."""

    num_requests: int = 32
    prefix_len: int = 64
    tail_len: int = 16
    max_new_tokens: int = 16
    max_running: int = 16
    kind: str = SERVING
    request_rate: float = 16.0

    def arrival_times(self) -> list[float]:
        """Each request's arrival, in seconds from the start (``poisson_arrivals``)."""
        return poisson_arrivals(self.num_requests, self.request_rate, self.seed)

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        return (
            f"{self.num_requests} requests arriving at {rate} (Poisson, seed {self.seed}): a "
            f"{self.prefix_len}-token shared prefix + {self.tail_len} own tokens each, "
            f"{self.max_new_tokens} new tokens, max_running={self.max_running}"
        )


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second: the first at 0,
    then gaps drawn from the exponential distribution of mean ``1 / rate`` (what vLLM's
    ``benchmark_serving`` sleeps between two requests). The generator is seeded apart from
    the prompts' (a string seed is hashed the same way in every process), so the same seed
    gives the same times. ``rate`` infinite: every request at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals {seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ---- one request's times, and the figures of many --------------------------------------------


@dataclass
class RequestTimes:
    """When a request arrived, and when the rounds that produced its first and its last token
    ended (the moment ``step()`` handed them back), on the serving clock."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def record(self, now: float, tokens: int) -> None:
        """A round that ended at ``now`` left the request with ``tokens`` tokens."""
        if self.first_token is None:
            self.first_token = now
        self.last_token, self.tokens = now, tokens

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to first token (queueing and prefill)."""
        assert self.first_token is not None, "the request produced no token"
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a one-token answer,
        which has no pace (vLLM leaves those out too)."""
        if self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile, interpolated linearly between the two nearest ranks (numpy's
    default, so the figures compare with ``benchmark_serving``'s): the sorted values' position
    ``p / 100 * (n - 1)``. p50 of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RunFigures:
    """One run of a cell: every request's times, the engine's busy seconds, its counters."""

    requests: list[RequestTimes]
    busy_s: float
    stats: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last token."""
        return max(r.last_token for r in self.requests) - min(r.arrival for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the run's duration (arrivals included: a step that keeps
        up with the arrivals shows the arrival rate's tokens, not its own top speed)."""
        return self.output_tokens / self.duration_s if self.duration_s else math.inf

    @property
    def busy(self) -> float:
        """The share of the run's duration the engine was working."""
        return self.busy_s / self.duration_s if self.duration_s else 1.0

    def ttft(self, p: float) -> float:
        return percentile([r.ttft for r in self.requests], p)

    def tpot(self, p: float) -> float | None:
        paces = [r.tpot for r in self.requests if r.tpot is not None]
        return percentile(paces, p) if paces else None

    @property
    def prefix_reuse(self) -> float:
        """Prompt tokens the prefix cache served, of all prompt tokens."""
        return self.stats.get("cached_tokens", 0) / max(self.stats.get("prompt_tokens", 0), 1)

    def to_json(self) -> dict[str, object]:
        """The run's figures, and each request's TTFT and TPOT in milliseconds (to the
        microsecond; None for a one-token answer's TPOT), in request order."""
        return {
            "busy_s": self.busy_s,
            "duration_s": self.duration_s,
            "output_tokens_per_s": self.tokens_per_s,
            "ttft_ms": {"p50": in_ms(self.ttft(50)), "p99": in_ms(self.ttft(99))},
            "tpot_ms": {"p50": in_ms(self.tpot(50)), "p99": in_ms(self.tpot(99))},
            "stats": self.stats,
            "each_ttft_ms": [round(in_ms(r.ttft), 3) for r in self.requests],
            "each_tpot_ms": [
                None if r.tpot is None else round(in_ms(r.tpot), 3) for r in self.requests
            ],
        }


# ---- the driver ------------------------------------------------------------------------------


class ServingClock:
    """Seconds since the first arrival: the wall clock while the engine works, and a jump over
    every idle wait (nobody waits then, so no latency changes). ``timer`` is
    ``time.perf_counter``; a test passes a fake one."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.now = 0.0
        self.busy = 0.0

    def wait_until(self, moment: float) -> None:
        """Idle until ``moment`` (no sleep: the clock moves there)."""
        self.now = max(self.now, moment)

    @contextmanager
    def working(self) -> Iterator[None]:
        """The block's wall-clock seconds move the clock on, and count as busy."""
        start = self.timer()
        yield
        spent = self.timer() - start
        self.now += spent
        self.busy += spent


def serve(
    engine,
    prompts: list[list[int]],
    arrivals: list[float],
    max_new_tokens: int,
    clock: ServingClock,
    device: str = "cpu",
) -> tuple[list[list[int]], list[RequestTimes]]:
    """Serve ``prompts``, request ``i`` arriving at ``arrivals[i]`` (in increasing order):
    each time round, add every request that has arrived, run one round and note, for every
    request it produced a token for, the round's end. Returns each request's tokens and
    times."""
    times = [RequestTimes(arrival) for arrival in arrivals]
    tokens: list[list[int]] = [[] for _ in prompts]
    waiting, index_of = deque(range(len(prompts))), {}
    while waiting or engine.has_work:
        if not engine.has_work:
            clock.wait_until(arrivals[waiting[0]])
        with clock.working():
            while waiting and arrivals[waiting[0]] <= clock.now:
                i = waiting.popleft()
                index_of[engine.add_request(prompts[i], max_new_tokens)] = i
            outputs = engine.step()
            wait_for(device)
        for out in outputs:
            i = index_of[out.request_id]
            if out.new_token_ids:
                times[i].record(clock.now, len(out.token_ids))
            if out.finished:
                tokens[i] = engine.pop_output(out.request_id)
    return tokens, times


# ---- the cells -------------------------------------------------------------------------------


@dataclass
class Cell:
    """One step in one setting (prefix cache on or off, ``max_running``), and its runs."""

    step: str
    prefix_cache: bool
    max_running: int
    one_at_a_time: bool = False
    runs: list[RunFigures] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.step} (one at a time)" if self.one_at_a_time else self.step

    @property
    def best(self) -> RunFigures:
        """The run with the least busy time: the one the machine disturbed least."""
        return min(self.runs, key=lambda run: run.busy_s)

    @property
    def spread(self) -> float:
        """Busy time of the slowest run / of the fastest: 1.0 on a quiet machine."""
        return max(run.busy_s for run in self.runs) / self.best.busy_s

    def to_json(self) -> dict[str, object]:
        best = self.runs.index(self.best)
        return {
            "step": self.step,
            "name": self.name,
            "prefix_cache": self.prefix_cache,
            "max_running": self.max_running,
            "best_run": best,
            "spread": self.spread,
            "runs": [run.to_json() for run in self.runs],
        }


def plan(steps: list[str], workload: ServingWorkload) -> list[Cell]:
    """Every step with the prefix cache on and off, then the last step one request at a time
    (cache on): continuous batching's baseline."""
    cells = [Cell(step, cache, workload.max_running) for step in steps for cache in (True, False)]
    if workload.max_running > 1:
        cells.append(Cell(steps[-1], True, 1, one_at_a_time=True))
    return cells


class ServingRunner:
    """One step's model (a checkpoint's ``weights`` when given); a fresh engine every run."""

    def __init__(
        self, step_name: str, cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | None
    ) -> None:
        self.step = load_step(step_name)
        self.model = self.step.TinyTransformerPaged(cfg)
        if weights is not None:
            self.model.load_weights(weights)

    def run(
        self,
        cell: Cell,
        prompts: list[list[int]],
        arrivals: list[float],
        max_new_tokens: int,
        timer: Callable[[], float] = time.perf_counter,
    ) -> RunFigures:
        """Serve ``prompts``, arriving at ``arrivals``, once through a fresh engine (a cold
        cache), on a clock read from ``timer``."""
        engine = self.step.PagedPrefixCacheEngine(
            self.model, max_running=cell.max_running, enable_prefix_cache=cell.prefix_cache
        )
        clock = ServingClock(timer)
        with torch.inference_mode():
            outputs, times = serve(
                engine, prompts, arrivals, max_new_tokens, clock, self.model.cfg.device
            )
        s = engine.stats
        stats = {
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "rounds": s.rounds,
            "seqs_scheduled": s.seqs_scheduled,
            "preemptions": s.preemptions,
        }
        return RunFigures(times, clock.busy, stats, outputs)


def run_serving(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    workload: ServingWorkload,
    steps: list[str],
    repeats: int,
    progress: Progress,
) -> list[Cell]:
    """Every cell ``repeats`` times round, one step's model (and KV pool) at a time. The first
    cell is served once untimed first: the first torch work of a process pays one-time costs
    (thread pools, the allocator growing) that no later run pays."""
    prompts, arrivals = workload.prompts(cfg.vocab_size), workload.arrival_times()
    serve_once = (prompts, arrivals, workload.max_new_tokens)
    cells = plan(steps, workload)
    with progress.task(f"{cells[0].name}: warm-up run (untimed)"):
        ServingRunner(cells[0].step, cfg, weights).run(cells[0], *serve_once)
    for repeat in range(repeats):
        for step in steps:
            with progress.task(f"{step}: building the model"):
                runner = ServingRunner(step, cfg, weights)
            for cell in (c for c in cells if c.step == step):
                cache = "on" if cell.prefix_cache else "off"
                label = f"{cell.name}, prefix cache {cache}: run {repeat + 1}/{repeats}"
                with progress.task(label):
                    cell.runs.append(runner.run(cell, *serve_once))
            del runner  # its KV pool: one at a time
    return cells


def reference_outputs(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    prompts: list[list[int]],
    new: int,
) -> list[list[int]]:
    """The dense, cache-free model's tokens for every prompt (the oracle)."""
    model = ReferenceModel(cfg)
    if weights is not None:
        model.load_weights(weights)
    return reference_generate(model, prompts, new)


def check(cells: list[Cell], new_tokens: int, expected: list[list[int]] | None) -> list[str]:
    """What is wrong, run by run: a request timed with fewer than its ``new_tokens`` tokens,
    or tokens that differ from the dense reference's or from the first run's. Empty: all
    agree."""
    problems, first = [], cells[0].runs[0].outputs
    for cell in cells:
        for i, run in enumerate(cell.runs):
            where = f"{cell.name}, prefix cache {'on' if cell.prefix_cache else 'off'}, run {i + 1}"
            if any(r.tokens != new_tokens or r.first_token is None for r in run.requests):
                problems.append(f"{where}: a request was not timed with all its tokens")
            if expected is not None and run.outputs != expected:
                problems.append(f"{where}: tokens differ from the dense reference")
            if run.outputs != first:
                problems.append(f"{where}: tokens differ from {cells[0].name}'s first run")
    return problems


# ---- the report ------------------------------------------------------------------------------

COLUMNS = (
    "prefix cache",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "tokens/s",
    "engine busy",
    "prefix reuse",
)


def ms(seconds: float | None) -> str:
    """Milliseconds, one decimal; ``-`` for a figure that does not exist (no TPOT when every
    answer is one token)."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def table(cells: list[Cell]) -> str:
    """The Markdown table: a row per cell, the figures of its best run; ``!`` after the busy
    share when its runs' busy times were more than ``SPREAD_FLAG`` apart."""
    name_w = max(24, *(len(c.name) for c in cells))
    widths = [len(title) for title in COLUMNS]

    def line(name: str, values: list[str]) -> str:
        return (
            f"| {name:<{name_w}} | "
            + " | ".join(f"{v:>{w}}" for v, w in zip(values, widths))
            + " |"
        )

    lines = [
        line("step", list(COLUMNS)),
        f"|{'-' * (name_w + 2)}|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|",
    ]
    for cell in cells:
        run = cell.best
        flag = "!" if cell.spread > SPREAD_FLAG else " "
        values = [
            "on" if cell.prefix_cache else "off",
            ms(run.ttft(50)),
            ms(run.ttft(99)),
            ms(run.tpot(50)),
            ms(run.tpot(99)),
            f"{run.tokens_per_s:.1f}",
            f"{run.busy:.0%}{flag}",
            f"{run.prefix_reuse:.0%}",
        ]
        lines.append(line(cell.name, values))
    return "\n".join(lines)


def notes(cells: list[Cell], repeats: int) -> str:
    """What the columns mean, and which cells' runs were too far apart to trust."""
    lines = [
        f"each row: the run with the least busy time of {plural(repeats, 'run')}. TTFT: arrival "
        "to first token; TPOT: (last token - first) / (tokens - 1); p50 / p99 over the "
        "requests (linear interpolation).",
        "tokens/s: output tokens / (first arrival to last token); busy: the share of that "
        "time the engine was working; prefix reuse: prompt tokens the prefix cache served.",
    ]
    flagged = [c.name for c in cells if c.spread > SPREAD_FLAG]
    if flagged:
        lines.append(
            f"! busy times more than {SPREAD_FLAG}x apart (slowest / fastest run): "
            f"{', '.join(dict.fromkeys(flagged))}. The machine was busy; "
            + RERUN_HINT[torch.get_num_threads() > 1]
        )
    return "\n".join(lines)


def in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def json_rate(rate: float) -> float | str:
    """A request rate for JSON, which has no infinity: ``"inf"`` (all at once) as text."""
    return "inf" if math.isinf(rate) else rate


def dumps(data: object) -> str:
    """``data`` as indented JSON, but each list of plain numbers on one line: a run's
    per-request figures take a line each, not one line per request."""
    text = json.dumps(data, indent=2)
    numbers = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*)\s*\]")
    return numbers.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def save(
    out: str,
    cfg: ModelConfig,
    workload: ServingWorkload,
    model_name: str,
    repeats: int,
    cells: list[Cell],
    tokens_identical: bool,
) -> Path:
    """``serving.json``: the settings, the arrival times, and every run of every cell with
    every request's TTFT and TPOT (the percentiles can be recomputed from them)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        **saved_run_head(
            cfg,
            {**asdict(workload), "request_rate": json_rate(workload.request_rate)},
            model_name=model_name,
            repeats=repeats,
        ),
        "statistic": "each cell's run with the least busy time (best_run)",
        "spread_flag": SPREAD_FLAG,
        "tokens_identical": tokens_identical,
        "arrivals": workload.arrival_times(),
        "cells": [cell.to_json() for cell in cells],
    }
    path = folder / "serving.json"
    path.write_text(dumps(data))
    return path


def run_serving_bench(
    args,
    workload: ServingWorkload,
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    progress: Progress,
) -> int:
    """``python -m bench --workload serving``: every cell, the table, ``serving.json``; 0 when
    every cell's tokens equal the dense reference's (or each other's, with --no-reference)."""
    print(
        f"serving: {workload.describe()}\nmodel {args.model} ({cfg.num_layers} layer(s), d_model "
        f"{cfg.d_model}), block_size {cfg.block_size}, {cfg.total_blocks} blocks, "
        f"{str(cfg.dtype).removeprefix('torch.')}, {cfg.device}, "
        f"{plural(torch.get_num_threads(), 'thread')}; each cell {plural(args.repeats, 'run')}, "
        "each through a fresh engine (a cold cache)"
    )
    cells = run_serving(cfg, weights, workload, args.steps, args.repeats, progress)
    expected = None
    if not args.no_reference:
        with progress.task("dense reference"):
            prompts = workload.prompts(cfg.vocab_size)
            expected = reference_outputs(cfg, weights, prompts, workload.max_new_tokens)
    print(table(cells))
    print(notes(cells, args.repeats))
    problems = check(cells, workload.max_new_tokens, expected)
    against = "each other" if expected is None else "the dense reference and each other"
    print("\n".join(problems) if problems else f"  every request's tokens equal {against}")
    path = save(args.out, cfg, workload, str(args.model), args.repeats, cells, not problems)
    print(f"results: {path}")
    return 1 if problems else 0
