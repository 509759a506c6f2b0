"""The showcase's output: header, table, token check, JSON, bar chart, and the optional
Hugging Face row."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.config import ModelConfig
from common.front.cli import plural
from common.inputs import blocks_for_request
from common.memory import gib

from .costs import MATMUL_N, MIB, dense_kv_bytes, paged_kv_bytes
from .harness import RunResult, Workload
from .rows import SPREAD_FLAG, Row

# What to do about a flagged row, with one torch thread and with several.
RERUN_HINT = {
    False: "rerun it when the machine is quieter (--steps names a few rows).",
    True: "rerun with --threads 1 (several threads wait for each other on a busy machine).",
}


# A reference check slower than this gets a hint that --no-reference skips it.
SLOW_REFERENCE_S = 10.0


def header(
    cfg: ModelConfig, workload: Workload, repeats: int, model: str, machine_gflops: float
) -> str:
    """What runs, on what: the workload, the model, torch's thread count (said once) and this
    machine's matmul rate, the yardstick of the GFLOP/s column."""
    threads = plural(torch.get_num_threads(), "thread")
    return (
        f"{workload.describe()}\nmodel {model}: d_model={cfg.d_model}, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads, vocab {cfg.vocab_size}, "
        f"block_size={cfg.block_size}, {cfg.total_blocks} blocks "
        f"({gib(paged_kv_bytes(cfg, cfg.total_blocks))} of KV), {cfg.device}, "
        f"{dtype_name(cfg)}; torch {torch.__version__}, {threads}\n"
        f"this machine: {machine_gflops:.1f} GFLOP/s on a {MATMUL_N}x{MATMUL_N} float32 matmul "
        "at that thread count: what arithmetic alone could reach\n"
        f"{plural(repeats, 'run')} per row, each through a fresh engine (a cold cache unless "
        "the row says warm):"
    )


def dtype_name(cfg: ModelConfig) -> str:
    return str(cfg.dtype).removeprefix("torch.")


def _reuse(result: RunResult) -> str:
    """Prompt tokens the prefix cache served (not computed); "-" for a row without one (HF)."""
    if not result.requests:
        return "-"
    return f"{result.cached_tokens / result.prompt_tokens:.0%}"


def _computed(result: RunResult) -> str:
    """Tokens the model computed: prompt tokens (what the cache did not save) + decode tokens."""
    return f"{result.computed_prefill_tokens} + {result.computed_decode_tokens}"


def _per_round(result: RunResult) -> str:
    """Requests a round ran, on average; "-" for a row without an engine (HF)."""
    return f"{result.seqs_per_round:.2f}" if result.rounds else "-"


def _preemptions(result: RunResult) -> str:
    """Requests preempted for memory (each counted each time); "-" without an engine (HF)."""
    return str(result.preemptions) if result.rounds else "-"


def _seconds(row: Row) -> str:
    """The fastest run, and ``!`` when the runs were too far apart to trust."""
    return f"{row.best:.3f}{'!' if row.flagged else ' '}"


# (title, width, right-aligned?) of every column after the first two.
COLUMNS = [
    ("min s", 8, True),
    ("tokens/s", 8, True),
    ("VS", 9, True),
    ("vs prev", 7, True),
    ("prefix reuse", 12, True),
    ("computed tokens", 15, True),
    ("peak KV MiB", 11, True),
    ("requests/round", 14, True),
    ("preemptions", 11, True),
    ("GFLOP", 7, True),
    ("GFLOP/s", 7, True),
]


def table(rows: list[Row], extra: list[Row]) -> str:
    """The Markdown table: ``rows`` are steps (speedups against the first one and the one
    before), ``extra`` are variants (warm prefix, no cache, HF) compared with the first row only.
    Every speed comes from each row's fastest run."""
    base, vs_base = rows[0].best, f"vs {rows[0].name}"
    titles = [(vs_base if title == "VS" else title) for title, _, _ in COLUMNS]
    widths = [max(len(title), width) for title, (_, width, _) in zip(titles, COLUMNS)]
    name_w = max(22, *(len(r.name) for r in rows + extra))
    fix_w = max(13, *(len(r.fixes) for r in rows + extra))

    def line(name: str, fixes: str, cells: list[str]) -> str:
        body = " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
        return f"| {name:<{name_w}} | {fixes:<{fix_w}} | {body} |"

    lines = [
        "",
        line("step", "what it fixed", titles),
        "|"
        + "|".join("-" * (w + 2) for w in (name_w, fix_w))
        + "|"
        + "|".join("-" * (w + 1) + ":" for w in widths)
        + "|",
    ]
    prev = None
    for row in rows + extra:
        is_step = row in rows
        vs_prev = f"{prev / row.best:.2f}x" if prev and is_step else ""
        r = row.result
        cells = [
            _seconds(row),
            f"{row.tokens_per_second:.1f}",
            f"{base / row.best:.2f}x",
            vs_prev,
            _reuse(r),
            _computed(r),
            f"{r.kv_peak_bytes / MIB:.2f}",
            _per_round(r),
            _preemptions(r),
            f"{r.flops / 1e9:.2f}",
            f"{row.gflops_per_second:.1f}",
        ]
        lines.append(line(row.name, row.fixes, cells))
        prev = row.best if is_step else prev
    return "\n".join(lines) + "\n"


def notes(
    rows: list[Row], cfg: ModelConfig, workload: Workload, repeats: int, machine_gflops: float
) -> str:
    """What the columns mean, with this run's own figures: the statistic, the flag, and the
    formulas behind the KV memory and the FLOPs."""
    block_kib = paged_kv_bytes(cfg, 1) / 1024
    prompt_len = workload.prefix_len + workload.tail_len
    positions = prompt_len + workload.max_new_tokens - 1
    dense_kib = dense_kv_bytes(cfg, 1, 1, 1) / 1024
    lines = [
        f"min s: the fastest of {plural(repeats, 'run')} (every run does the same work, so a "
        "slower one only measures what else the machine was doing).",
        "prefix reuse: prompt tokens served by the prefix cache; computed tokens: prompt + "
        "decode tokens that went through the model.",
        f"peak KV MiB: engine rows hold blocks_peak x {block_kib:g} KiB (2 x {cfg.num_layers} "
        f"layers x {cfg.block_size} tokens x {cfg.num_kv_heads} KV heads x {cfg.d_head} x "
        f"{cfg.dtype.itemsize} bytes)"
        + (
            f"; HF holds a dense cache of {workload.num_requests} x {positions} positions x "
            f"{dense_kib:g} KiB."
            if workload.eos is None  # no HF row when each request has its own eos
            else "."
        ),
        f"GFLOP: model FLOPs of the computed tokens (bench/costs.py); GFLOP/s = GFLOP / min s, "
        f"against this machine's {machine_gflops:.1f} on a plain matmul: far below it, a row is "
        "bound by overhead, not arithmetic.",
        *memory_notes(rows[0], cfg, workload),
    ]
    flagged, threads = [r.name for r in rows if r.flagged], torch.get_num_threads()
    if flagged:
        lines.append(
            f"! runs more than {SPREAD_FLAG}x apart (slowest / fastest): {', '.join(flagged)}. "
            f"The machine was busy; its min s may still be too high: {RERUN_HINT[threads > 1]}"
        )
    return "\n".join(lines) + "\n"


def memory_notes(row: Row, cfg: ModelConfig, workload: Workload) -> list[str]:
    """What requests/round and preemptions mean, with ``row``'s own figures, and how many
    requests worst-case reservation would have run at once: arithmetic, not a run. Reserving
    ``prompt + max_new_tokens`` per request (``blocks_for_request``), the pool holds
    ``total_blocks // smallest reservation`` requests at most (and never more than
    ``max_running``)."""
    r, bs, pool = row.result, cfg.block_size, cfg.total_blocks
    lines = [
        "requests/round: requests a round ran, on average (EngineStats.seqs_per_round"
        + (f"; {row.name}: {r.seqs_scheduled} over {r.rounds} rounds" if r.rounds else "")
        + "); preemptions: running requests sent back to the queue for lack of blocks, "
        "recomputed later (EngineStats.preemptions).",
    ]
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
        lines.append(
            f"worst-case reservation would run all {workload.max_running} at a time too "
            f"(max_running): {each}, room for {fits}."
        )
    else:
        lines.append(f"worst-case reservation would run at most {fits} at a time: {each}.")
    return lines


def span(values: list[int]) -> str:
    """``5`` or ``3 to 6``."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low} to {high}"


@dataclass
class TokenCheck:
    ok: bool
    message: str


def check_tokens(rows: list, expected: list[list[int]] | None) -> TokenCheck:
    """Every row must produce the same tokens (and the reference's, when it was run)."""
    first = rows[0].result.outputs
    differ = [r.name for r in rows if r.result.outputs != first]
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


def saved_run_head(
    cfg: ModelConfig, workload: dict, omit: tuple[str, ...] = (), **settings: object
) -> dict[str, object]:
    """The first keys of every saved run: when, on what, and with which workload and model
    (less the model fields in ``omit``, which vary by cell); ``settings`` adds the rest of what
    the run was told."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "settings": {
            "workload": workload,
            "model": {k: str(v) for k, v in asdict(cfg).items() if k not in omit},
            **settings,
        },
    }


def machine() -> dict[str, object]:
    """What a saved run was measured on: the platform, the versions, torch's thread count."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def save(
    out: str,
    cfg: ModelConfig,
    workload: Workload,
    args,
    rows: list[Row],
    extra: list[Row],
    tokens_identical: bool,
    machine_gflops: float,
) -> None:
    """``results.json`` (every figure, the settings and the machine) and the chart."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    base = rows[0]
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {
            **machine(),
            "matmul_gflops": machine_gflops,
            "matmul": f"{MATMUL_N}x{MATMUL_N} float32",
        },
        "settings": {
            "workload": asdict(workload),
            "repeats": args.repeats,
            "model": {k: str(v) for k, v in asdict(cfg).items()},
            "model_name": str(getattr(args, "model", "")),
        },
        "statistic": "min",  # each row's seconds: its fastest run
        "spread_flag": SPREAD_FLAG,
        "kv_bytes_per_block": paged_kv_bytes(cfg, 1),
        "tokens_identical": tokens_identical,
        "baseline": base.name,
        "rows": [row_json(r, base) for r in rows + extra],
    }
    (folder / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"results: {folder / 'results.json'}")
    chart(folder / "speedups.png", rows + extra, base)


def row_json(row: Row, base: Row) -> dict[str, object]:
    """One row of ``results.json``: every run's time and every figure of the table."""
    r = row.result
    return {
        "name": row.name,
        "fixes": row.fixes,
        "seconds": row.seconds,
        "min_s": row.best,
        "median_s": row.median,
        "spread": row.spread,
        "flagged": row.flagged,
        "tokens_per_s": row.tokens_per_second,
        "speedup_vs_baseline": base.best / row.best,
        "requests": r.requests,
        "requests_hit": r.requests_hit,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "computed_prefill_tokens": r.computed_prefill_tokens,
        "computed_decode_tokens": r.computed_decode_tokens,
        "blocks_peak": r.blocks_peak,
        "kv_peak_bytes": r.kv_peak_bytes,
        "kv_peak_mib": r.kv_peak_bytes / MIB,
        "rounds": r.rounds,
        "seqs_scheduled": r.seqs_scheduled,
        "seqs_per_round": r.seqs_per_round,
        "preemptions": r.preemptions,
        "flops": r.flops,
        "gflops_per_s": row.gflops_per_second,
    }


def chart(path: Path, rows: list[Row], base: Row) -> None:
    """Two panels, when matplotlib is here: each row's speedup over ``base`` (the first step
    run), and the peak KV memory it held."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart: skipped (pip install -e '.[plot]' to get speedups.png)")
        return
    names = [r.name for r in rows][::-1]  # barh draws bottom-up: the first row on top
    speedups = [base.best / r.best for r in rows][::-1]
    mib = [r.result.kv_peak_bytes / MIB for r in rows][::-1]
    fig, (speed_ax, kv_ax) = plt.subplots(
        1, 2, figsize=(12, 4.8), sharey=True, gridspec_kw={"width_ratios": [3, 2]}
    )
    bars = speed_ax.barh(names, speedups, color="#4c72b0")
    speed_ax.bar_label(bars, labels=[f"{s:.1f}x" for s in speedups], padding=3)
    speed_ax.axvline(1.0, color="grey", linewidth=0.8)
    speed_ax.set_xlabel(f"speedup over {base.name} (fastest run; higher is better)")
    speed_ax.set_title("What each step buys")
    bars = kv_ax.barh(names, mib, color="#dd8452")
    kv_ax.bar_label(bars, labels=[f"{m:.1f}" if m >= 1 else f"{m:.2f}" for m in mib], padding=3)
    kv_ax.set_xlabel("peak KV memory, MiB (lower is better)")
    kv_ax.set_title("KV memory held")
    for ax in (speed_ax, kv_ax):
        ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"chart: {path}")
