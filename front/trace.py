"""Watch the block pool round by round: ``python -m <step>.run --trace`` prints it.

``RoundTracer(engine)`` watches one engine, any step's: it is the engine's observer
(``common/observer.py``), told of every event as it happens (a request admitted, blocks adopted,
allocated, evicted, cached or freed, a preemption), and it closes each round with a picture of
the pool: which request holds each block, which blocks the cache holds, and every block's
``ref_count``. Nothing of the engine is replaced or wrapped, and every step records the same
trace on the same requests: the steps differ in speed, never in what happens to a block.

``format_trace(tracer.rounds)`` reads like the chapter's ref_count walk-through:

    round 1  req 0  new  prefill 0-3  alloc [0]  cache [0]
             req 1  new  adopt [0]  prefill 4-7  alloc [1]  cache [1]
             pool: 126 free, 2 in use (2 cached), 0 cached only; refs 0:3 1:2

``front/trace_plot.py`` draws the same records as a picture (blocks x rounds).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.observer import Observers, RoundObserver
from common.snapshot import PoolSnapshot
from common.status import SequenceStatus

# Why a request's blocks went back (``KVCacheManager.free``) during a round, by its status: the
# engine frees a finished request after its last token, and a preempted one right after
# ``scheduler.preempt()`` marked it. Between rounds, only ``abort`` frees.
ENDINGS = {SequenceStatus.FINISHED: "finished", SequenceStatus.PREEMPTED: "preempted"}


@dataclass
class Work:
    """What one request did in one round, in the order it happened."""

    seq_id: int
    new: bool = False  # admitted this round, for the first time
    resumed: bool = False  # admitted this round after a preemption
    kind: str = ""  # "prefill" or "decode" ("" when nothing was scheduled for it)
    start: int = 0  # the tokens it computed: [start, end); a decode token is at end - 1
    end: int = 0
    last_chunk: bool = False  # a prefill chunk that ends the prefill: the next token comes
    adopted: list[int] = field(default_factory=list)  # cached blocks it took (retain: +1)
    allocated: list[int] = field(default_factory=list)  # fresh blocks from the pool
    evicted: list[int] = field(default_factory=list)  # cache-only blocks evicted to give them
    cached: list[int] = field(default_factory=list)  # blocks it filled that the cache took
    # Full blocks the cache did not take: a copy of a block it holds under the same hash, or
    # a block whose parent (the block before it) is not cached, which no lookup could reach.
    copies: list[int] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    waits: bool = False  # its first chunk did not fit: it stays at the head of the queue
    short: str = ""  # what a running request found no block for (then it preempted)
    ended: str = ""  # "finished", "preempted" or "aborted"
    preempted_for: int | None = None  # the request that needed its blocks
    freed: list[int] = field(default_factory=list)  # its blocks that went back to the pool
    stay_cached: list[int] = field(default_factory=list)  # its blocks the cache keeps

    @property
    def quiet(self) -> bool:
        """A plain decode step: one token into a block it already had, nothing moved."""
        return self == Work(self.seq_id, kind="decode", start=self.start, end=self.end)

    @property
    def still(self) -> bool:
        """Nothing moved: a plain decode step, or a queued request that still does not fit."""
        return self.quiet or self == Work(self.seq_id, waits=True)


@dataclass
class RoundTrace:
    """One round (``engine.step()``), or what happened between two rounds (an abort, a reset
    of the prefix cache): the requests' work, oldest first, and the pool after it."""

    number: int  # the traced engine's round, from 1; between rounds: the round before
    work: list[Work]
    pool: PoolSnapshot  # after it: who holds which block, what the cache holds, ref_counts
    between: bool = False  # an abort or a reset, outside any round
    cleared: list[int] = field(default_factory=list)  # reset_prefix_cache: these went free

    @property
    def evicted(self) -> list[int]:
        return [b for w in self.work for b in w.evicted]

    @property
    def preempted(self) -> list[int]:
        return [w.seq_id for w in self.work if w.ended == "preempted"]

    @property
    def touched(self) -> list[int]:
        """Every block that moved this round, in the order it first did."""
        blocks = [
            b
            for w in self.work
            for group in (w.adopted, w.evicted, w.allocated, w.cached, w.freed, w.stay_cached)
            for b in group
        ]
        return list(dict.fromkeys(blocks + self.cleared))

    @property
    def still(self) -> bool:
        """Only plain decode steps and requests that still wait: not a block moved."""
        return not self.between and bool(self.work) and all(w.still for w in self.work)


class WatchedEngine(Protocol):
    """What the trace uses of a step's engine: the observer hooks, and the pool's snapshot (who
    holds which block, what the cache holds, every ref_count). Nothing of its insides."""

    observer: Observers  # every watcher of the engine: ``add`` and ``remove`` one

    def snapshot(self) -> PoolSnapshot: ...


class RoundTracer(RoundObserver):
    """Records every round of one engine in ``rounds``, as its observer; ``detach()`` stops."""

    def __init__(self, engine: WatchedEngine) -> None:
        self.engine = engine
        self.rounds: list[RoundTrace] = []
        self._number = 0  # rounds so far
        self._in_round = False
        self._work: dict[int, Work] = {}  # this round's, by request id, in order of appearance
        # What each running request computes next, "token" or "chunk", from what it last did:
        # said of a request that finds no block (it may be preempted itself before it is told).
        self._next: dict[int, str] = {}
        engine.observer.add(self)

    def detach(self) -> None:
        self.engine.observer.remove(self)

    # ---- the events -------------------------------------------------------------------------

    def round_started(self) -> None:
        self._number += 1
        self._in_round = True

    def round_ended(self) -> None:
        self._in_round = False
        self._close()

    def admitted(self, seq: Any) -> None:
        work = self._entry(seq)
        work.resumed = seq.num_preemptions > 0
        work.new = not work.resumed

    def waits(self, seq: Any) -> None:
        self._entry(seq).waits = True  # a queued request does not preempt: it waits

    def allocated(self, seq: Any, adopted: list[int], new: list[int], evicted: list[int]) -> None:
        work = self._entry(seq)
        work.adopted += adopted
        work.evicted += evicted
        work.allocated += new

    def scheduled(self, seq: Any, start: int, num_tokens: int) -> None:
        work = self._entry(seq)
        work.start, work.end = start, start + num_tokens
        if seq.status is SequenceStatus.RUNNING:
            work.kind = "decode"
        else:  # prefill is block-aligned: the chunk starts after the blocks it now holds
            work.kind, work.last_chunk = "prefill", work.end >= seq.num_tokens
        self._next[seq.seq_id] = "token" if work.kind == "decode" or work.last_chunk else "chunk"

    def cached(self, seq: Any, block_index: int, taken: bool) -> None:
        block, cache = seq.block_table[block_index], self.engine.snapshot().cached
        if not taken and block in cache:
            return  # it was cached already (registered when it was scheduled)
        work = self._entry(seq)
        if taken:
            work.cached.append(block)
        elif block_index and seq.block_table[block_index - 1] not in cache:
            work.orphans.append(block)
        else:
            work.copies.append(block)

    def preempted(self, seq: Any, for_seq: Any) -> None:
        self._entry(for_seq).short = f"its next {self._next.get(for_seq.seq_id, 'chunk')}"
        self._entry(seq).preempted_for = for_seq.seq_id

    def freed(self, seq: Any) -> None:
        work, pool = self._entry(seq), self.engine.snapshot()
        work.ended = ENDINGS[seq.status] if self._in_round else "aborted"
        work.freed = [b for b in seq.block_table if pool.ref_count(b) == 0]
        work.stay_cached = [b for b in seq.block_table if pool.ref_count(b) > 0]
        self._next.pop(seq.seq_id, None)
        if not self._in_round:
            self._close(between=True)

    def cache_reset(self, block_ids: list[int]) -> None:
        self._close(between=not self._in_round, cleared=tuple(sorted(block_ids)))

    # ---- the records ------------------------------------------------------------------------

    def _entry(self, seq: Any) -> Work:
        if seq.seq_id not in self._work:
            self._work[seq.seq_id] = Work(seq.seq_id)
        return self._work[seq.seq_id]

    def _close(self, between: bool = False, cleared: tuple[int, ...] = ()) -> None:
        work, pool = list(self._work.values()), self.engine.snapshot()
        self.rounds.append(RoundTrace(self._number, work, pool, between, list(cleared)))
        self._work = {}


# ---- the text -----------------------------------------------------------------------------------


def blocks(ids: list[int]) -> str:
    return "[" + " ".join(map(str, ids)) + "]"


def describe_work(w: Work, width: int) -> str:
    """One request's round on one line, in the order things happened."""
    parts = [f"req {w.seq_id:<{width}}"]
    if w.new or w.resumed:
        parts.append("new" if w.new else "resumed")
    if w.adopted:
        parts.append(f"adopt {blocks(w.adopted)}")
    if w.kind == "prefill":
        span = f"{w.start}-{w.end - 1}" if w.end - w.start > 1 else str(w.start)
        parts.append(f"prefill {span}" + (" (last chunk)" if w.last_chunk else ""))
    elif w.kind == "decode":
        parts.append(f"decode @{w.start}")
    if w.short and not w.allocated:
        parts.append(f"no block for {w.short}")
    moved = {
        "evict {}": w.evicted,
        "alloc {}": w.allocated,
        "cache {}": w.cached,
        "full {} not cached (the cache has that prefix)": w.copies,
        "full {} not cached (the block before it is not)": w.orphans,
    }
    parts += [words.format(blocks(ids)) for words, ids in moved.items() if ids]
    if w.waits:
        parts.append("waits (its first chunk does not fit)")
    if w.ended:
        why = w.ended
        if w.ended == "preempted" and w.preempted_for is not None:
            why += " itself" if w.preempted_for == w.seq_id else f" for req {w.preempted_for}"
        gone = f"frees {blocks(w.freed)}" if w.freed else "frees nothing"
        kept = f", {blocks(w.stay_cached)} stay cached" if w.stay_cached else ""
        parts.append(f"{why}: {gone}{kept}")
    return "  ".join(parts)


def describe_still(work: list[Work], width: int, rounds: int = 1) -> str:
    """Requests that moved no block, on one line (``rounds`` in a row)."""
    decoding = " ".join(str(w.seq_id) for w in work if w.quiet)
    parts = []
    if decoding:
        each = " each" if " " in decoding else ""
        parts.append(
            f"req {decoding:<{width}}  decode"
            + (f", a token a round{each}" if rounds > 1 else (f", a token{each}" if each else ""))
        )
    parts += [f"req {w.seq_id:<{width}}  waits" for w in work if w.waits]
    return "; ".join(parts)


def describe_pool(pool: PoolSnapshot, touched: list[int]) -> str:
    """free + in use + cached only (they add up to the pool), and the ref_count of every block
    that moved: the requests holding it, + 1 if the cache holds it."""
    in_use_cached = sum(b in pool.holders for b in pool.cached)
    refs = " ".join(f"{b}:{pool.ref_count(b)}" for b in sorted(touched))
    line = (
        f"pool: {pool.num_free} free, {pool.in_use} in use ({in_use_cached} cached), "
        f"{len(pool.cached_only)} cached only"
    )
    return f"{line}; refs {refs}" if refs else line


def describe_round(r: RoundTrace, width: int) -> list[str]:
    """A line per request that moved blocks, one for the plain decode steps, then the pool."""
    lines, still = [], [w for w in r.work if w.quiet]
    for w in r.work:
        if not w.quiet:
            lines.append(describe_work(w, width))
        elif w is still[0]:
            lines.append(describe_still(still, width))
    if r.cleared:
        lines.append(f"prefix cache reset: {blocks(r.cleared)} back to the free pool")
    return [*lines, describe_pool(r.pool, r.touched)]


def still_runs(rounds: list[RoundTrace]) -> Iterator[list[RoundTrace]]:
    """The rounds one by one, consecutive ones in which nothing moved together."""
    run: list[RoundTrace] = []
    for r in rounds:
        if run and not (r.still and run[0].still and same_work(r, run[0])):
            yield run
            run = []
        run.append(r)
    if run:
        yield run


def same_work(a: RoundTrace, b: RoundTrace) -> bool:
    return [(w.seq_id, w.waits) for w in a.work] == [(w.seq_id, w.waits) for w in b.work]


def label(run: list[RoundTrace]) -> str:
    first, last = run[0], run[-1]
    if first.between:
        return f"after {first.number}" if first.number else "at start"
    return f"round {first.number}" if first is last else f"rounds {first.number}-{last.number}"


def format_trace(rounds: list[RoundTrace]) -> str:
    """The trace as text, round by round (``describe_round``); consecutive rounds in which no
    block moved take one line."""
    width = max((len(str(w.seq_id)) for r in rounds for w in r.work), default=1)
    runs = list(still_runs(rounds))
    column = max((len(label(run)) for run in runs), default=0) + 2
    out = []
    for run in runs:
        if run[0].still:
            what = describe_still(run[0].work, width, len(run))
            out.append(f"{label(run):<{column}}{what}; no block moves")
            continue
        lines = describe_round(run[0], width)
        out.append(f"{label(run):<{column}}{lines[0]}")
        out += [" " * column + line for line in lines[1:]]
    return "\n".join(out)


def trace_header(what: str, rounds: list[RoundTrace]) -> str:
    """What the trace shows and how to read it, wrapped."""
    total, block_size = (
        (rounds[0].pool.total_blocks, rounds[0].pool.block_size) if rounds else (0, 0)
    )
    return textwrap.fill(
        f"Trace of {what}: {len(rounds)} rounds, a pool of {total} blocks of {block_size} "
        f"tokens. Per round, each request's work (adopt: cached blocks it takes, ref_count +1; "
        f"alloc: fresh blocks from the pool, ref_count 1; cache: blocks it filled that the "
        f"cache takes, +1; frees: blocks back in the free pool), then the pool after the round: "
        f"free + in use + cached only = {total}, and the ref_count of every block that moved "
        f"(the requests holding it, + 1 if the cache does).",
        width=100,
    )
