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

from .harness import RunResult, Workload


def header(cfg: ModelConfig, workload: Workload, repeats: int) -> str:
    return (
        f"{workload.num_requests} requests: a {workload.prefix_len}-token shared prefix + "
        f"{workload.tail_len} own tokens each, {workload.max_new_tokens} new tokens, "
        f"max_running={workload.max_running}\nmodel: d_model={cfg.d_model}, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads, vocab {cfg.vocab_size}, "
        f"block_size={cfg.block_size}, {cfg.total_blocks} blocks, {cfg.device}, "
        f"{str(cfg.dtype).removeprefix('torch.')}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n{repeats} runs each (fresh engine, cold cache):"
    )


def _hit(result: RunResult) -> str:
    if not result.requests:
        return "-"
    tokens = result.cached_tokens / result.prompt_tokens
    return f"{result.requests_hit}/{result.requests} req, {tokens:.0%} tok"


def table(rows: list, extra: list) -> str:
    base = rows[0].median
    lines = [
        "",
        f"| {'step':<20} | {'what it fixed':<56} | median s | tokens/s | vs step14 | vs prev "
        f"| prefix-cache hits |",
        f"|{'-' * 22}|{'-' * 58}|---------:|---------:|----------:|--------:|---|",
    ]
    prev = None
    for row in rows + extra:
        vs_prev = f"{prev / row.median:.2f}x" if prev and row in rows else ""
        lines.append(
            f"| {row.name:<20} | {row.fixes:<56} | {row.median:8.3f} | "
            f"{row.tokens_per_second:8.1f} | {base / row.median:8.2f}x | {vs_prev:>7} "
            f"| {_hit(row.result)} |"
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
    if expected is not None and first != expected:
        return TokenCheck(False, "❌ tokens differ from the dense reference model")
    against = " and the dense reference model" if expected is not None else ""
    return TokenCheck(True, f"✅ every row produced the same tokens{against}")


def save(
    out: str,
    cfg: ModelConfig,
    workload: Workload,
    args,
    rows: list,
    extra: list,
    tokens_identical: bool,
) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
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
        "rows": [
            {
                "name": r.name,
                "fixes": r.fixes,
                "seconds": r.seconds,
                "median_s": r.median,
                "tokens_per_s": r.tokens_per_second,
                "speedup_vs_step14": rows[0].median / r.median,
                "requests": r.result.requests,
                "requests_hit": r.result.requests_hit,
                "prompt_tokens": r.result.prompt_tokens,
                "cached_tokens": r.result.cached_tokens,
            }
            for r in rows + extra
        ],
    }
    (folder / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"results: {folder / 'results.json'}")
    chart(folder / "speedups.png", rows + extra, rows[0].median)


def chart(path: Path, rows: list, base: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart: skipped (pip install -e '.[plot]' to get speedups.png)")
        return
    names = [r.name for r in rows]
    speedups = [base / r.median for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.barh(names[::-1], speedups[::-1], color="#4c72b0")
    ax.bar_label(bars, labels=[f"{s:.1f}x" for s in speedups[::-1]], padding=3)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("speedup over step14 (end to end, higher is better)")
    ax.set_title("What each step buys")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"chart: {path}")
