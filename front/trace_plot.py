"""The trace shown: ``show_trace`` prints it (``--trace``) and draws it (``--trace-png FILE``),
a picture of the block pool, blocks x rounds, each cell coloured by what held the block at the
end of that round.

It draws the records of ``front.trace.RoundTracer``. A cell is white when the block is free,
dotted grey when only the prefix cache holds it (ref_count 1: evictable), filled with a
request's colour and its id when one request holds it, and hatched with ``xN`` when N requests
share it. A black corner says the cache holds it too. A cross marks a block the cache evicted in
that round; ``P`` and the request's id above a column mark a preemption. Every state differs in
pattern or text, not in hue alone, so the picture reads in greyscale too.

Drawing needs matplotlib (``pip install -e '.[plot]'``), imported only when a picture is asked
for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cli import TraceOptions
from .trace import RoundTrace, format_trace, trace_header

# One colour per request (by id, cycling), light enough for black text, of varied lightness.
REQUEST_COLOURS = [
    "#8dd3c7",
    "#fdb462",
    "#bebada",
    "#fb8072",
    "#e5c494",
    "#b3de69",
    "#fccde5",
    "#ffffb3",
    "#bc80bd",
    "#ccebc5",
]
SHARED_COLOUR = "#6baed6"
CACHED_ONLY_COLOUR = "0.82"


def show_trace(options: TraceOptions, what: str, rounds: list[RoundTrace], title: str) -> None:
    """``--trace``: the rounds as text, after a header; ``--trace-png``: the picture."""
    if options.show:
        print(f"\n{trace_header(what, rounds)}\n\n{format_trace(rounds)}")
    if options.png is not None:
        print(f"\nThe pool, blocks x rounds: {draw_pool(rounds, options.png, title)}")


def used_blocks(rounds: list[RoundTrace]) -> list[int]:
    """Every block that was ever out of the free pool, or moved, in these rounds."""
    used = {b for r in rounds for b in r.pool.ref_counts} | {b for r in rounds for b in r.touched}
    return sorted(used)


def column_label(r: RoundTrace) -> str:
    return "·" if r.between else str(r.number)


def draw_pool(rounds: list[RoundTrace], path: str | Path, title: str) -> Path:
    """Draw ``rounds`` (a ``RoundTracer``'s records) as a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block_ids = used_blocks(rounds)
    n_cols, n_rows = len(rounds), len(block_ids)
    width, height = max(7.0, 1.6 + 0.22 * n_cols), 1.8 + 0.24 * n_rows
    fig, ax = plt.subplots(figsize=(width, height), dpi=120)
    plt.rcParams["hatch.linewidth"] = 0.6
    font = 6 if n_cols <= 120 else 0  # past that the cells are too small for text
    for x, r in enumerate(rounds):
        draw_column(ax, x, r, block_ids, font)
    draw_axes(ax, rounds, block_ids, title)
    draw_legend(ax, fig, rounds)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png", bbox_inches="tight")
    plt.close(fig)
    return path


def draw_column(ax: Any, x: int, r: RoundTrace, block_ids: list[int], font: int) -> None:
    """Round ``r`` at column ``x``: a cell per block, its evictions, a preemption above."""
    holders, allocated = r.pool.holders, {b for w in r.work for b in w.allocated}
    for y, block in enumerate(block_ids):
        draw_cell(ax, x, y, holders.get(block, ()), block in r.pool.cached, font)
        if block in allocated:  # taken from the free pool this round: a bold edge
            ax.add_patch(box((x + 0.06, y + 0.06), 0.88, fill=False, edgecolor="black", lw=1.3))
    row = {block: y for y, block in enumerate(block_ids)}
    for block in r.evicted:
        ax.plot(x + 0.22, row[block] + 0.28, marker="x", color="black", markersize=4, mew=1.3)
    if r.preempted:
        label, style = "P" + ",".join(map(str, r.preempted)), {"rotation": 90, "fontweight": "bold"}
        ax.text(x + 0.5, -0.3, label, ha="center", va="bottom", fontsize=6, **style)


def draw_cell(ax: Any, x: int, y: int, holders: tuple[int, ...], cached: bool, font: int) -> None:
    """One block at the end of one round (the module's second paragraph)."""
    import matplotlib.pyplot as plt

    face, hatch, text = "white", None, ""
    if len(holders) > 1:
        face, hatch, text = SHARED_COLOUR, "////", f"×{len(holders)}"
    elif holders:
        face, text = REQUEST_COLOURS[holders[0] % len(REQUEST_COLOURS)], str(holders[0])
    elif cached:
        face, hatch = CACHED_ONLY_COLOUR, "...."
    ax.add_patch(box((x, y), 1, facecolor=face, hatch=hatch, edgecolor="0.55", linewidth=0.3))
    if cached and holders:
        ax.add_patch(plt.Polygon([(x + 0.62, y), (x + 1, y), (x + 1, y + 0.38)], color="black"))
    if text and font:
        plate = {"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none"} if hatch else None
        ax.text(x + 0.45, y + 0.55, text, ha="center", va="center", fontsize=font, bbox=plate)


def box(corner: tuple[float, float], side: float, **style: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(corner, side, side, **style)


def draw_axes(ax: Any, rounds: list[RoundTrace], block_ids: list[int], title: str) -> None:
    """Round numbers along the bottom, block ids down the side, the title."""
    n_cols, n_rows = len(rounds), len(block_ids)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, -0.3 - (1.6 if any(r.preempted for r in rounds) else 0))
    step = max(1, n_cols // 40)
    ax.set_xticks([x + 0.5 for x in range(0, n_cols, step)])
    ax.set_xticklabels([column_label(rounds[x]) for x in range(0, n_cols, step)], fontsize=6)
    ax.set_yticks([i + 0.5 for i in range(n_rows)])
    ax.set_yticklabels([str(b) for b in block_ids], fontsize=6)
    ax.set_xlabel("round (each cell: the block at the end of the round)", fontsize=8)
    total = rounds[0].pool.total_blocks if rounds else 0
    ax.set_ylabel(f"block id ({n_rows} of {total} ever used; the others stayed free)", fontsize=8)
    ax.set_title(title, fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def draw_legend(ax: Any, fig: Any, rounds: list[RoundTrace]) -> None:
    """What each kind of cell means (evictions and preemptions only when there are some)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    legend = [
        Patch(facecolor="white", edgecolor="0.55", label="free"),
        Patch(facecolor=CACHED_ONLY_COLOUR, hatch="....", edgecolor="0.55", label="cached only"),
        Patch(facecolor=REQUEST_COLOURS[0], edgecolor="0.55", label="held by request 0 (its id)"),
        Patch(
            facecolor=SHARED_COLOUR, hatch="////", edgecolor="0.55", label="shared by N requests"
        ),
        Patch(facecolor="black", label="black corner: in the cache too"),
        Patch(facecolor="white", edgecolor="black", lw=1.3, label="bold edge: allocated"),
    ]
    if any(r.evicted for r in rounds):
        legend.append(
            Line2D([], [], marker="x", color="black", linestyle="none", mew=1.3, label="evicted")
        )
    if any(r.preempted for r in rounds):
        legend.append(Line2D([], [], linestyle="none", label="Pk above: request k preempted"))
    below_the_label = offset_copy(ax.transAxes, fig=fig, y=-32, units="points")
    place = {"loc": "upper center", "bbox_to_anchor": (0.5, 0), "bbox_transform": below_the_label}
    ax.legend(handles=legend, ncol=4, fontsize=7, frameon=False, **place)
