"""The charts, when matplotlib is installed (``pip install -e '.[plot]'``): the speedups and the
KV memory of every row (``speedups.png``), and the scale sweeps (``scale.png``)."""

from __future__ import annotations

from pathlib import Path

from .batch import Row


def pyplot(name: str):
    """matplotlib's pyplot, drawing to files only; None (and a line saying why) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"chart: skipped (pip install -e '.[plot]' to get {name})")
        return None
    return plt


def speedups(path: Path, rows: list[Row]) -> None:
    """Two panels: each row's speedup over the first, and the peak KV memory it held."""
    plt = pyplot(path.name)
    if plt is None:
        return
    base = rows[0].best.seconds
    names = [r.name for r in rows][::-1]  # barh draws bottom-up: the first row on top
    ratios = [base / r.best.seconds for r in rows][::-1]
    mib = [r.best.kv_peak_bytes / 2**20 for r in rows][::-1]
    fig, (speed_ax, kv_ax) = plt.subplots(
        1, 2, figsize=(12, 0.35 * len(rows) + 1.6), sharey=True, width_ratios=[3, 2]
    )
    bars = speed_ax.barh(names, ratios, color="#4c72b0")
    speed_ax.bar_label(bars, labels=[f"{s:.1f}x" for s in ratios], padding=3)
    speed_ax.axvline(1.0, color="grey", linewidth=0.8)
    speed_ax.set_xlabel(f"speedup over {rows[0].name} (fastest run; higher is better)")
    speed_ax.set_title("What each step buys")
    bars = kv_ax.barh(names, mib, color="#dd8452")
    kv_ax.bar_label(bars, labels=[f"{m:.1f}" if m >= 1 else f"{m:.2f}" for m in mib], padding=3)
    kv_ax.set_xlabel("peak KV memory, MiB (lower is better)")
    kv_ax.set_title("KV memory held")
    for ax in (speed_ax, kv_ax):
        ax.margins(x=0.15)
    save(plt, fig, path)


def sweeps(path: Path, lines: dict[str, dict[str, dict[int, tuple[float, float]]]]) -> None:
    """Time per request against each sweep's size, a line per step, the total above and the
    engine's own share below: flat is O(1). ``lines``: sweep -> step -> size -> (total,
    engine) milliseconds."""
    plt = pyplot(path.name)
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(lines), figsize=(6 * len(lines), 7), squeeze=False)
    for col, (sweep, steps) in enumerate(lines.items()):
        sizes = sorted({size for by_size in steps.values() for size in by_size})
        for row, label in enumerate(["ms per request, total", "ms per request, the engine's"]):
            ax = axes[row][col]
            for step, by_size in steps.items():
                ax.plot(sizes, [by_size[s][row] for s in sizes], marker="o", label=step)
            ax.set_xscale("symlog", linthresh=max(1, min(s for s in sizes if s) // 2))
            ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_ylabel(label)
            ax.set_xlabel(sweep)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time per request as the work and the cache grow (flat: O(1) per block)")
    save(plt, fig, path)


def save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")
