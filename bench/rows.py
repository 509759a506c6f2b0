"""What the shared-prefix and pressure workloads share around their rows: the model, the
prompts and the header (``BatchRun``), every row timed alike, then the reference check, the
table, the notes under it, ``results.json`` and the chart (``BatchRun.finish``)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.config import ModelConfig
from common.inputs import blocks_for_request
from common.memory import gib, kv_bytes_per_block, kv_pool_bytes
from front.cli import plural
from front.steps import FIXES

from . import charts
from .batch import BatchRunner, Row, RunResult, Timing, measure
from .cells import SPREAD_FLAG, flagged_note, markdown
from .costs import MATMUL_N, MIB, Floor, dense_kv_bytes, floor_work, matmul_gflops, model_flops
from .models import load_step_model, load_workload_model
from .options import BenchOptions
from .progress import Progress
from .reference import Reference
from .saved import saved_run_head, write_json

SLOW_REFERENCE_S = 10.0  # a reference check slower than this gets a hint to skip it


def header(cfg: ModelConfig, describe: str, options: BenchOptions, machine_gflops: float) -> str:
    """What runs, on what, and this machine's matmul rate (the GFLOP/s column's yardstick)."""
    threads = plural(torch.get_num_threads(), "thread")
    return (
        f"{describe}\nmodel {options.model}: d_model={cfg.d_model}, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads, vocab {cfg.vocab_size}, block_size={cfg.block_size}, "
        f"{cfg.total_blocks} blocks ({gib(kv_pool_bytes(cfg))} of KV), {cfg.device}, "
        f"{cfg.dtype_name}; torch {torch.__version__}, {threads}\n"
        f"this machine: {machine_gflops:.1f} GFLOP/s on a {MATMUL_N}x{MATMUL_N} float32 matmul "
        "at that thread count: what arithmetic alone could reach\n"
        f"{plural(options.repeats, 'run')} per row, in passes over the rows, each through a "
        "fresh engine (a cold cache unless the row says warm):"
    )


def new_tokens(row: Row) -> int:
    return sum(len(ids) for ids in row.best.outputs)


def figures(row: Row, base: Row, prev: Row | None, floor: Floor) -> dict[str, str]:
    """One row of the table, by column title ("-": what a peer, without an engine, lacks)."""
    r, best, engine = row.best, row.best.seconds, row.best.rounds > 0
    return {
        "min s": f"{best:.3f}{'!' if row.flagged else ' '}",
        "tokens/s": f"{new_tokens(row) / best:.1f}",
        f"vs {base.name}": f"{base.best.seconds / best:.2f}x",
        "vs prev": f"{prev.best.seconds / best:.2f}x" if prev else "",
        "vs floor": f"{floor.multiple(best):.1f}x",
        "prefix reuse": f"{r.cached_tokens / r.prompt_tokens:.0%}" if r.requests else "-",
        "computed tokens": f"{r.computed_prefill_tokens} + {r.computed_decode_tokens}",
        "peak KV MiB": f"{r.kv_peak_bytes / MIB:.2f}",
        "requests/round": f"{r.seqs_per_round:.2f}" if engine else "-",
        "preemptions": str(r.preemptions) if engine else "-",
        "GFLOP": f"{r.flops / 1e9:.2f}",
        "GFLOP/s": f"{r.flops / best / 1e9:.1f}",
    }


def table(rows: list[Row], extra: list[Row], floor: Floor) -> str:
    """The table: ``rows`` (steps, each against the first and the one before), then ``extra``."""
    lines = [
        [row.name, row.setting, *figures(row, rows[0], prev, floor).values()]
        for row, prev in zip(rows + extra, [None, *rows[:-1]] + [None] * len(extra))
    ]
    titles = ["step", "what it fixed", *figures(rows[0], rows[0], None, floor)]
    return "\n" + markdown(titles, lines, left=2) + "\n"


def notes(rows: list[Row], cfg: ModelConfig, workload, options: BenchOptions, floor: Floor) -> str:
    """What the columns mean, with this run's own figures."""
    positions = max(workload.prompt_lengths()) + workload.max_new_tokens - 1
    dense = (
        f"; the peers (HF, CTranslate2) hold a dense cache of {workload.num_requests} x "
        f"{positions} positions x {dense_kv_bytes(cfg, 1, 1, 1) / 1024:g} KiB."
    )
    lines = [
        f"min s: the fastest of {plural(options.repeats, 'run')} (every run does the same "
        "work, so a slower one only measures what else the machine was doing).",
        f"vs floor: min s over the FLOP floor, {floor.flops / 1e9:.2f} GFLOP (every distinct "
        f"prompt prefix once, then each answer's tokens) at this machine's "
        f"{floor.machine_gflops:.1f} GFLOP/s: {floor.seconds * 1000:.1f} ms.",
        "prefix reuse: prompt tokens served by the prefix cache; computed tokens: prompt + "
        "decode tokens that went through the model.",
        f"peak KV MiB: engine rows hold blocks_peak x {kv_bytes_per_block(cfg) / 1024:g} KiB "
        f"(2 x {cfg.num_layers} layers x {cfg.block_size} tokens x {cfg.num_kv_heads} KV heads "
        f"x {cfg.d_head} x {cfg.dtype.itemsize} bytes)"
        + (dense if any(not row.best.rounds for row in rows) else "."),
        "GFLOP: model FLOPs of the computed tokens (bench/costs.py); GFLOP/s = GFLOP / min s, "
        f"against this machine's {floor.machine_gflops:.1f} on a plain matmul: far below it, a "
        "row is bound by overhead, not arithmetic.",
        *memory_notes(rows[0], cfg, workload),
        *flagged_note(rows, "runs"),
    ]
    return "\n".join(lines) + "\n"


def memory_notes(row: Row, cfg: ModelConfig, workload) -> list[str]:
    """What requests/round and preemptions mean, with ``row``'s own figures, and how many
    requests worst-case reservation (prompt + max_new_tokens each) would run at once:
    arithmetic, not a run."""
    r, bs, pool = row.best, cfg.block_size, cfg.total_blocks
    lengths = workload.prompt_lengths()
    reserved = [blocks_for_request(n, workload.max_new_tokens, bs) for n in lengths]
    used = [blocks_for_request(n, len(out), bs) for n, out in zip(lengths, r.outputs) if out]
    fits = pool // min(reserved)
    each = (
        f"each request reserves {span(reserved)} blocks (prompt + max_new_tokens) of the "
        f"{pool}-block pool"
    )
    if len(used) == len(lengths):
        each += f"; prompt + answer fill {span(used)}"
    if fits >= workload.max_running:
        would = f"run all {workload.max_running} at a time too (max_running): {each}, room for"
        would += f" {fits}."
    else:
        would = f"run at most {fits} at a time: {each}."
    return [
        "requests/round: requests a round ran, on average (EngineStats.seqs_per_round"
        + (f"; {row.name}: {r.seqs_scheduled} over {r.rounds} rounds" if r.rounds else "")
        + "); preemptions: running requests sent back to the queue for lack of blocks, "
        "recomputed later (EngineStats.preemptions).",
        f"worst-case reservation would {would}",
    ]


def span(values: list[int]) -> str:
    """``5`` or ``3 to 6``."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low} to {high}"


@dataclass
class TokenCheck:
    ok: bool
    message: str


def check_tokens(rows: list[Row], expected: list[list[int]] | None) -> TokenCheck:
    """Every row must produce the same tokens (and the reference's, when it was run)."""
    first = rows[0].best.outputs
    differ = [r.name for r in rows if any(run.outputs != first for run in r.runs)]
    if differ:
        return TokenCheck(False, f"❌ tokens differ from {rows[0].name}: {', '.join(differ)}")
    if expected is None:
        return TokenCheck(True, "✅ every row produced the same tokens (reference check skipped)")
    if first != expected:
        return TokenCheck(False, "❌ tokens differ from the dense reference model")
    return TokenCheck(True, "✅ every row produced the same tokens as the dense reference model")


def phases(seconds: dict[str, float]) -> str:
    """One line: how long each phase took, and how to skip the reference check when it is the
    slow one (it recomputes every sequence from scratch for each new token)."""
    line = "time: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
    if seconds.get("reference check", 0.0) > SLOW_REFERENCE_S:
        line += " (--no-reference skips the reference check)"
    return line


def save(
    options: BenchOptions,
    cfg: ModelConfig,
    workload,
    cells: tuple[list[Row], list[Row]],
    tokens_identical: bool,
    floor: Floor,
) -> str:
    """``results.json``: every run's time and every figure, the settings and the machine."""
    rows, extra = cells
    base = rows[0]
    data = {
        **saved_run_head(cfg, {"kind": options.workload, **asdict(workload)}, options),
        "statistic": "min",  # each row's seconds: its fastest run
        "spread_flag": SPREAD_FLAG,
        "kv_bytes_per_block": kv_bytes_per_block(cfg),
        "floor": {"flops": floor.flops, "seconds": floor.seconds},
        "tokens_identical": tokens_identical,
        "baseline": base.name,
        "rows": [row_json(r, base, floor) for r in rows + extra],
    }
    data["machine"].update(matmul_gflops=floor.machine_gflops, matmul=f"{MATMUL_N}x{MATMUL_N}")
    return write_json(options.out, "results.json", data)


def row_json(row: Row, base: Row, floor: Floor) -> dict[str, object]:
    """One row of ``results.json``: every run's time and every figure of the table."""
    r: RunResult = row.best
    figures = {k: v for k, v in asdict(r).items() if k not in ("outputs", "seconds")}
    return {
        "name": row.name,
        "fixes": row.setting,
        "seconds": row.seconds,
        "min_s": r.seconds,
        "median_s": statistics.median(row.seconds),
        "spread": row.spread,
        "flagged": row.flagged,
        "tokens_per_s": new_tokens(row) / r.seconds,
        "speedup_vs_baseline": base.best.seconds / r.seconds,
        "floor_multiple": floor.multiple(r.seconds),
        **figures,
        "kv_peak_mib": r.kv_peak_bytes / MIB,
        "seqs_per_round": r.seqs_per_round,
        "gflops_per_s": r.flops / r.seconds / 1e9,
    }


class BatchRun:
    """A workload of rows: its model, prompts and the machine's matmul rate, and its header."""

    def __init__(self, options: BenchOptions, workload, progress: Progress) -> None:
        self.options, self.progress, self.seconds = options, progress, {}
        self.timings: list[Timing] = []
        self.nested = 0.0  # seconds of phases within the one that runs
        self.cfg, self.weights = load_workload_model(options, workload, progress)
        self.prompts = workload.prompts(self.cfg.vocab_size)
        self.machine_gflops = matmul_gflops(self.cfg.device)
        self.reference = Reference(self.cfg, self.weights)
        print(header(self.cfg, workload.describe(), options, self.machine_gflops))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the run (the last line says how long each took): a phase met again
        adds up, and one within another counts for itself only."""
        start, outer, self.nested = time.perf_counter(), self.nested, 0.0
        yield
        spent = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + spent - self.nested
        self.nested = outer + spent

    def timed(self, name: str, fixes: str, run, warmup: bool = False, live=None) -> Row:
        """A row, its runs still to come: ``measure_rows`` runs every row, interleaved."""
        self.timings.append(Timing(Row(name, fixes), run, warmup, live))
        return self.timings[-1].row

    def measure_rows(self) -> None:
        """Every row's ``--repeats`` runs, pass after pass (``batch.measure``)."""
        with self.phase("runs"):
            measure(self.timings, self.options.repeats, self.progress)
        self.timings = []

    def step_rows(self, workload) -> tuple[list[Row], BatchRunner]:
        """A row per step (every step's model is kept until the rows are measured); and the
        last step's runner, for its variants."""
        rows: list[Row] = []
        for name in self.options.steps:
            with self.progress.task(f"{name}: building the model"):
                model = load_step_model(name, self.cfg, self.weights, self.options)
                runner = BatchRunner(model)
            run = functools.partial(runner.run, self.prompts, workload)
            live = runner.computed_so_far
            rows.append(self.timed(name, FIXES[name][1], run, warmup=not rows, live=live))
        return rows, runner

    def finish(self, workload, rows: list[Row], extra: list[Row]) -> int:
        """The reference check, the table and notes, ``results.json``, the chart; 0 when all
        tokens agree."""
        expected = None
        if not self.options.no_reference:
            with self.phase("reference check"), self.progress.task("dense reference"):
                new, eos = workload.max_new_tokens, workload.eos
                expected = self.reference.tokens(self.prompts, new, eos)
        work = floor_work(self.prompts, rows[0].best.outputs)
        floor = Floor(model_flops(self.cfg, work), self.machine_gflops)
        same = check_tokens(rows + extra, expected)
        print(table(rows, extra, floor))
        print(notes(rows + extra, self.cfg, workload, self.options, floor))
        print(f"{same.message}\n{phases(self.seconds)}")
        print(f"results: {save(self.options, self.cfg, workload, (rows, extra), same.ok, floor)}")
        charts.speedups(Path(self.options.out) / "speedups.png", rows + extra)
        return 0 if same.ok else 1
