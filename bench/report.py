"""The showcase's output: header, table, token check, JSON, bar chart, and the optional
Hugging Face row."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.config import ModelConfig

from .harness import RunResult, Workload

if TYPE_CHECKING:
    from .showcase import Row


# A reference check slower than this gets a hint that --no-reference skips it.
SLOW_REFERENCE_S = 10.0


def plural(count: int, word: str) -> str:
    """``plural(1, "thread")`` -> "1 thread", ``plural(2, "thread")`` -> "2 threads"."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def header(cfg: ModelConfig, workload: Workload, repeats: int) -> str:
    """What runs, on what: the workload, the model, and torch's thread count (said once)."""
    return (
        f"{workload.num_requests} requests: a {workload.prefix_len}-token shared prefix + "
        f"{workload.tail_len} own tokens each, {workload.max_new_tokens} new tokens, "
        f"max_running={workload.max_running}\nmodel: d_model={cfg.d_model}, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads, vocab {cfg.vocab_size}, "
        f"block_size={cfg.block_size}, {cfg.total_blocks} blocks, {cfg.device}, "
        f"{str(cfg.dtype).removeprefix('torch.')}; torch {torch.__version__}, "
        f"{plural(torch.get_num_threads(), 'thread')}\n"
        f"{plural(repeats, 'run')} per row (each a fresh engine, so a cold cache):"
    )


def _hit(result: RunResult) -> str:
    """Prefix-cache hits of one run; "-" for a row that has no prefix cache (HF)."""
    if not result.requests:
        return "-"
    tokens = result.cached_tokens / result.prompt_tokens
    return f"{result.requests_hit}/{result.requests} req, {tokens:.0%} tok"


def _computed_prefill(result: RunResult) -> str:
    """Prompt tokens the model really computed (the rest came from the cache); "-" for HF."""
    return str(result.computed_prefill_tokens) if result.requests else "-"


def table(rows: list[Row], extra: list[Row]) -> str:
    """The Markdown table: ``rows`` are steps (speedups against the first one and the one
    before), ``extra`` are variants (no cache, HF) compared with the first row only."""
    base, vs_base = rows[0].median, f"vs {rows[0].name}"
    width = max(len(vs_base), 9)
    lines = [
        "",
        f"| {'step':<20} | {'what it fixed':<56} | median s | tokens/s | {vs_base:>{width}} "
        f"| vs prev | prefill computed | prefix-cache hits |",
        f"|{'-' * 22}|{'-' * 58}|---------:|---------:|{'-' * (width + 1)}:|--------:"
        f"|-----------------:|---|",
    ]
    prev = None
    for row in rows + extra:
        vs_prev = f"{prev / row.median:.2f}x" if prev and row in rows else ""
        lines.append(
            f"| {row.name:<20} | {row.fixes:<56} | {row.median:8.3f} | "
            f"{row.tokens_per_second:8.1f} | {base / row.median:{width - 1}.2f}x | {vs_prev:>7} "
            f"| {_computed_prefill(row.result):>16} | {_hit(row.result)} |"
        )
        prev = row.median if row in rows else prev
    return "\n".join(lines) + "\n"


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


def save(
    out: str,
    cfg: ModelConfig,
    workload: Workload,
    args,
    rows: list,
    extra: list,
    tokens_identical: bool,
) -> None:
    """``results.json`` (every figure, the settings and the machine) and the chart."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    base = rows[0]
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "settings": {
            "workload": asdict(workload),
            "repeats": args.repeats,
            "model": {k: str(v) for k, v in asdict(cfg).items()},
        },
        "tokens_identical": tokens_identical,
        "baseline": base.name,
        "rows": [
            {
                "name": r.name,
                "fixes": r.fixes,
                "seconds": r.seconds,
                "median_s": r.median,
                "tokens_per_s": r.tokens_per_second,
                "speedup_vs_baseline": base.median / r.median,
                "requests": r.result.requests,
                "requests_hit": r.result.requests_hit,
                "prompt_tokens": r.result.prompt_tokens,
                "cached_tokens": r.result.cached_tokens,
                "computed_prefill_tokens": r.result.computed_prefill_tokens,
                "computed_decode_tokens": r.result.computed_decode_tokens,
            }
            for r in rows + extra
        ],
    }
    (folder / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"results: {folder / 'results.json'}")
    chart(folder / "speedups.png", rows + extra, base)


def chart(path: Path, rows: list[Row], base: Row) -> None:
    """A bar per row: its speedup over ``base`` (the first step run), when matplotlib is here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart: skipped (pip install -e '.[plot]' to get speedups.png)")
        return
    names = [r.name for r in rows]
    speedups = [base.median / r.median for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.barh(names[::-1], speedups[::-1], color="#4c72b0")
    ax.bar_label(bars, labels=[f"{s:.1f}x" for s in speedups[::-1]], padding=3)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel(f"speedup over {base.name} (end to end, higher is better)")
    ax.set_title("What each step buys")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"chart: {path}")
