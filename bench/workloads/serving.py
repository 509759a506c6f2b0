"""--workload serving: what a user waiting for an answer sees. Requests arrive over time (a
seeded Poisson process at --request-rate per second, vLLM's benchmark_serving shape), each a
shared prefix + tokens of its own; every step serves them with the prefix cache on and off,
and the last step once more one request at a time (max_running 1). The table gives each
cell's time to first token (TTFT) and time per output token (TPOT), p50 and p99 over the
requests, from the run with the least busy time. Results go to --out: serving.json.

The other workloads hand the engine every request at once and time the whole batch. A server
is asked one request at a time, while it answers the earlier ones, and a user cares about two
delays (``bench/latency.py``): the time to the first token and the pace after it. One request
at a time is the baseline that shows what continuous batching buys.

The engine is served in process (``engine_serve``) on a clock that is the wall clock with the
idle waits cut out (``ServingClock``): the driver adds every request whose arrival time has
passed, runs one ``engine.step()`` and advances the clock by the seconds that took. When the
engine has nothing to do and the next request has not arrived, the clock jumps to its arrival
instead of sleeping: nobody is waiting then, so the jump changes no latency, and the run costs
its busy time only. A request that arrives while a round runs waits for the round's end, as on
a real server, and that wait is part of its TTFT.

How many requests share a round depends on how fast the rounds are, so a run's rounds (and its
prefix reuse) differ from step to step and from run to run; the tokens do not (each request's
are greedy, checked against the dense reference). A cell shows its run with the least busy
time of ``--repeats``; the repeats go round every cell in turn.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from common.device import synchronize
from front.cli import plural

from ..cells import SPREAD_FLAG, Cell, flagged_note, markdown
from ..endpoint import Endpoint, check_reachable, endpoint_serve, reset_prefix_cache
from ..latency import RequestTimes, RunFigures, Serve, TimedRequest, poisson_arrivals
from ..models import StepModel, load_step_model, load_workload_model
from ..options import BenchOptions
from ..progress import Progress
from ..reference import reference_tokens
from ..saved import saved_run_head, write_json
from . import shared_prefix
from .shared_prefix import SharedPrefix

NAME = "serving"
SUMMARY = "requests arriving over time, time to first token and per output token (latency)"
# the shared-prefix requests, fewer and shorter, arriving at a rate
DEFAULTS = shared_prefix.DEFAULTS | dict(
    requests=32,
    prefix_len=64,
    tail_len=16,
    new_tokens=16,
    max_running=16,
    request_rate=16.0,
    endpoint=None,
)
NOT_READ = "serves its own requests"  # never said: it reads every flag but a sweep's
HELP = __doc__.split("\n\n")[0]


@dataclass(frozen=True)
class ServingWorkload(SharedPrefix):
    """Shared-prefix requests arriving at ``request_rate`` per second (``math.inf``: all at
    once); small enough by default for every cell to run in a minute or two on two cores."""

    num_requests: int = 32
    prefix_len: int = 64
    tail_len: int = 16
    max_new_tokens: int = 16
    max_running: int = 16
    request_rate: float = 16.0

    def arrival_times(self) -> list[float]:
        return poisson_arrivals(self.num_requests, self.request_rate, self.seed)

    def timed_requests(self, vocab_size: int) -> list[TimedRequest]:
        prompts, new = self.prompts(vocab_size), self.max_new_tokens
        return [TimedRequest(p, t, new) for p, t in zip(prompts, self.arrival_times())]

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        return (
            f"{self.num_requests} requests arriving at {rate} (Poisson, seed {self.seed}): a "
            f"{self.prefix_len}-token shared prefix + {self.tail_len} own tokens each, "
            f"{self.max_new_tokens} new tokens, max_running={self.max_running}"
        )


def workload_of(options: BenchOptions) -> ServingWorkload:
    requests = asdict(shared_prefix.workload_of(options))
    return ServingWorkload(**requests, request_rate=options.request_rate)


check = shared_prefix.check  # the same requests, only arriving over time


# ---- the engine, served in process -----------------------------------------------------------


class ServingClock:
    """Seconds since the first arrival, idle waits jumped over (the module's third paragraph).
    ``timer`` is ``time.perf_counter``; a test passes a fake one."""

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


def drive(engine, requests: list[TimedRequest], clock: ServingClock, device: str) -> RunFigures:
    """Serve ``requests`` (in arrival order): each time round, add the arrived requests, run a
    round, and note its end for every request it gave a token."""
    times = [RequestTimes(r.arrival) for r in requests]
    tokens: list[list[int]] = [[] for _ in requests]
    waiting, index_of = deque(range(len(requests))), {}
    while waiting or engine.has_work:
        if not engine.has_work:
            clock.wait_until(requests[waiting[0]].arrival)
        with clock.working():
            while waiting and requests[waiting[0]].arrival <= clock.now:
                i = waiting.popleft()
                index_of[engine.add_request(requests[i].prompt, requests[i].max_tokens)] = i
            outputs = engine.step()
            synchronize(device)
        for out in outputs:
            i = index_of[out.request_id]
            if out.new_token_ids:
                times[i].record(clock.now, len(out.token_ids))
            if out.finished:
                tokens[i] = engine.pop_output(out.request_id)
    s = engine.stats
    stats = ("prompt_tokens", "cached_tokens", "rounds", "seqs_scheduled", "preemptions")
    return RunFigures(times, clock.busy, {k: getattr(s, k) for k in stats}, tokens)


def engine_serve(
    model: StepModel, setting: Setting, timer: Callable[[], float] = time.perf_counter
) -> Serve:
    """Serving in process: each call, a fresh engine (a cold cache) on a ``ServingClock``."""

    def serve(requests: list[TimedRequest]) -> RunFigures:
        engine = model.engine(
            max_running=setting.max_running, enable_prefix_cache=setting.prefix_cache
        )
        with torch.inference_mode():
            return drive(engine, requests, ServingClock(timer), model.cfg.device)

    return serve


# ---- the cells -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """How a cell serves: which step, the prefix cache on or off, how many at once."""

    step: str
    prefix_cache: bool
    max_running: int

    @property
    def cache(self) -> str:
        return "on" if self.prefix_cache else "off"


ServingCell = Cell[Setting | Endpoint, RunFigures]


def plan(steps: tuple[str, ...], workload: ServingWorkload) -> list[ServingCell]:
    """Every step, cache on and off; the last one request at a time (batching's baseline)."""
    n = workload.max_running
    cells = [ServingCell(s, Setting(s, cache, n)) for s in steps for cache in (True, False)]
    if n > 1:
        cells.append(ServingCell(f"{steps[-1]} (one at a time)", Setting(steps[-1], True, 1)))
    return cells


def run_cells(cfg, weights, workload: ServingWorkload, options: BenchOptions, progress: Progress):
    """Every cell ``--repeats`` times round, one step's model (and KV pool) at a time. The
    first cell is served once untimed first: the first torch work of a process pays one-time
    costs (thread pools, the allocator growing) that no later run pays."""
    requests, cells = workload.timed_requests(cfg.vocab_size), plan(options.steps, workload)
    with progress.task(f"{cells[0].name}: warm-up run (untimed)"):
        first = load_step_model(cells[0].setting.step, cfg, weights, options)
        engine_serve(first, cells[0].setting)(requests)
    for repeat in range(options.repeats):
        for step in options.steps:
            with progress.task(f"{step}: building the model"):
                model = load_step_model(step, cfg, weights, options)
            for cell in (c for c in cells if c.setting.step == step):
                label = f"{cell.name}, prefix cache {cell.setting.cache}: run {repeat + 1}"
                with progress.task(label):
                    cell.runs.append(engine_serve(model, cell.setting)(requests))
            del model  # its KV pool: one at a time
    if options.endpoint is not None:
        cells.append(endpoint_cell(Endpoint(options.endpoint), requests, options, progress))
    return cells


def endpoint_cell(
    endpoint: Endpoint, requests: list[TimedRequest], options: BenchOptions, progress: Progress
) -> ServingCell:
    """The server at ``--endpoint``, served the same requests: once untimed (its first work
    pays one-time costs too), then ``--repeats`` times, each from a cold prefix cache."""
    cell, serve = ServingCell(f"{endpoint.url} (HTTP)", endpoint), endpoint_serve(endpoint)
    with progress.task(f"{endpoint.url}: warm-up run (untimed)"):
        serve(requests)
    cold = True
    for repeat in range(options.repeats):
        cold = reset_prefix_cache(endpoint.url) and cold
        with progress.task(f"{endpoint.url}: run {repeat + 1}"):
            cell.runs.append(serve(requests))
    if not cold:
        print(f"  {endpoint.url} has no /reset_prefix_cache: its runs found the prefix cached")
    return cell


def check_cells(cells: list[ServingCell], new_tokens: int, expected) -> list[str]:
    """What is wrong, run by run: a request timed with fewer than ``new_tokens`` tokens, or
    tokens unlike the reference's or the first run's. Empty: all agree."""
    problems, first = [], cells[0].runs[0].outputs
    for cell in cells:
        for i, run in enumerate(cell.runs):
            where = f"{cell.name}, prefix cache {cell.setting.cache}, run {i + 1}"
            if any(r.tokens != new_tokens or r.first_token is None for r in run.requests):
                problems.append(f"{where}: a request was not timed with all its tokens")
            if isinstance(cell.setting, Endpoint):
                continue  # text came back, not token ids: its tokens are counted, not compared
            if expected is not None and run.outputs != expected:
                problems.append(f"{where}: tokens differ from the dense reference")
            if run.outputs != first:
                problems.append(f"{where}: tokens differ from {cells[0].name}'s first run")
    return problems


# ---- the report ------------------------------------------------------------------------------

TITLES = ["step", "prefix cache", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
TITLES += ["tokens/s", "engine busy", "prefix reuse"]


def ms(seconds: float | None) -> str:
    """Milliseconds, one decimal; ``-`` for none (no TPOT when every answer is one token)."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def table(cells: list[ServingCell]) -> str:
    """A row per cell, its best run's figures; ``!``: its busy times were far apart."""
    rows = []
    for cell in cells:
        run = cell.best
        rows.append(
            [
                cell.name,
                cell.setting.cache,
                *(
                    ms(figure)
                    for figure in (run.ttft(50), run.ttft(99), run.tpot(50), run.tpot(99))
                ),
                f"{run.tokens_per_s:.1f}",
                busy_share(cell),
                f"{run.prefix_reuse:.0%}",
            ]
        )
    return markdown(TITLES, rows)


def busy_share(cell: ServingCell) -> str:
    """The engine's busy share, ``!`` when the runs' busy times lie far apart; ``-`` for an
    endpoint (its rounds cannot be seen from the client; ``!`` then compares durations)."""
    flag = "!" if cell.flagged else " "
    if isinstance(cell.setting, Endpoint):
        return f"-{flag}"
    return f"{cell.best.busy:.0%}{flag}"


def notes(cells: list[ServingCell], repeats: int) -> str:
    """What the columns mean, and which cells' runs were too far apart to trust."""
    return "\n".join(
        [
            f"each row: the run with the least busy time of {plural(repeats, 'run')}. TTFT: "
            "arrival to first token; TPOT: (last token - first) / (tokens - 1); p50 / p99 over "
            "the requests (linear interpolation).",
            "tokens/s: output tokens / (first arrival to last token); busy: the share of that "
            "time the engine was working; prefix reuse: prompt tokens the prefix cache served.",
            *flagged_note(cells, "busy times"),
            *endpoint_note(cells),
        ]
    )


def endpoint_note(cells: list[ServingCell]) -> list[str]:
    if not any(isinstance(cell.setting, Endpoint) for cell in cells):
        return []
    return [
        "(HTTP): the same requests sent to a server, timed by the client (sent, first text, "
        "last text; the tokens from its usage); its rows rank runs by their duration."
    ]


def save(options, cfg, workload: ServingWorkload, cells: list[ServingCell], same: bool) -> str:
    """``serving.json``: the settings, the arrivals, every run with every request's TTFT and
    TPOT (the percentiles can be recomputed from them)."""
    rate = "inf" if math.isinf(workload.request_rate) else workload.request_rate  # JSON has no inf
    data = {
        **saved_run_head(cfg, {"kind": NAME, **asdict(workload), "request_rate": rate}, options),
        "statistic": "each cell's run with the least busy time (best_run)",
        "spread_flag": SPREAD_FLAG,
        "tokens_identical": same,
        "arrivals": workload.arrival_times(),
        "cells": [
            {
                **cell_setting(cell.setting),
                "name": cell.name,
                "best_run": cell.runs.index(cell.best),
                "spread": cell.spread,
                "runs": [run.to_json() for run in cell.runs],
            }
            for cell in cells
        ],
    }
    return write_json(options.out, "serving.json", data)


def cell_setting(setting: Setting | Endpoint) -> dict[str, object]:
    if isinstance(setting, Endpoint):
        return {"endpoint": setting.url}
    return {k: getattr(setting, k) for k in ("step", "prefix_cache", "max_running")}


def run(options: BenchOptions, progress: Progress) -> int:
    """Every cell, the table, ``serving.json``; 0 when all tokens agree."""
    workload = workload_of(options)
    if options.endpoint is not None:
        check_reachable(options.endpoint)
    cfg, weights = load_workload_model(options, workload, progress)
    print(
        f"serving: {workload.describe()}\nmodel {options.model} ({plural(cfg.num_layers, 'layer')}"
        f", d_model {cfg.d_model}), block_size {cfg.block_size}, {cfg.total_blocks} blocks, "
        f"{options.dtype}, {cfg.device}, {plural(torch.get_num_threads(), 'thread')}; each cell "
        f"{plural(options.repeats, 'run')}, each through a fresh engine (a cold cache)"
    )
    cells = run_cells(cfg, weights, workload, options, progress)
    expected = reference_tokens(options, progress, cfg, weights, workload)
    print(table(cells))
    print(notes(cells, options.repeats))
    problems = check_cells(cells, workload.max_new_tokens, expected)
    against = "each other" if expected is None else "the dense reference and each other"
    if options.endpoint is not None:
        against += " (over HTTP: every request's count of tokens)"
    print("\n".join(problems) or f"  every request's tokens equal {against}")
    print(f"results: {save(options, cfg, workload, cells, not problems)}")
    return 1 if problems else 0
