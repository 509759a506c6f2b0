"""Random scenarios: hundreds of seeded workloads, every step against the dense reference.

Each seed draws a whole scenario — prompts with shared prefixes, block size, a pool from barely
enough to roomy, max_running, max_new_tokens, cache on or off, batched or serial, sometimes a
second (hot) round on the same engine, sometimes an eos that some requests really produce — so
that combinations nobody thought to write by hand (one-token prompts, full-prompt hits,
evictions mid-run, exact block multiples, early stops) are covered.
The reference for a seed is computed once and shared by every step, and so are step14's
``EngineStats``: every later step must report exactly the same figures (batching changes speed,
never sharing). Those figures are also checked against an independent model of the design's
block bookkeeping (``BlockBookkeeping``: admission, adoption, lazy allocation, caching, LRU
leaf-only eviction, no model and no KV), so every round's hits, evictions and block counts are
pinned exactly, hot rounds after evictions included. From step14_9 on, a prefill chunk is as
long as the round's token budget allows (the scenario draws one): the model then runs with that
budget, and pins step14_9's figures as exactly.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from types import ModuleType

import pytest

from common.config import ModelConfig
from common.hashing import hash_prefix_blocks
from common.numbers import cdiv
from common.stats import EngineStats
from front.steps import load_step
from tests.helpers import (
    EngineFactory,
    blocks_needed,
    budget_args,
    has_fix,
    random_shared_prefix_prompts,
    reference_tokens,
    tiny_config,
)

# EngineStats' figures of step14_10's second tier (its own test runs these scenarios with one).
TIER_FIGURES = [f.name for f in fields(EngineStats) if f.name.startswith(("external_", "kv_"))]

# 320 distinct scenarios, every one run through every step (about a minute for all eight).
SEEDS = 320


@dataclass(frozen=True)
class Scenario:
    prompts: tuple[tuple[int, ...], ...]
    block_size: int
    total_blocks: int
    max_running: int
    max_new_tokens: int
    enable_prefix_cache: bool
    serial: bool
    hot_round: bool
    # (prompt, output position) of a token the reference generates, used as the eos id, so
    # that requests really do stop early; None: no eos.
    eos_pick: tuple[int, int] | None = None
    # (prompt, rounds): that request is aborted once the engine has run that many rounds, if it
    # is still queued or running then (batched scenarios only); None: no abort.
    abort_pick: tuple[int, int] | None = None
    # step14_9's max_num_batched_tokens, above the least it may be (a block beside every
    # other running request's decode token) by this much
    budget_above_least: int = 512

    @property
    def cfg(self) -> ModelConfig:
        return tiny_config(block_size=self.block_size, total_blocks=self.total_blocks)

    @property
    def budget(self) -> int:
        """step14_9's max_num_batched_tokens: tokens a round computes at most."""
        return self.block_size + self.max_running - 1 + self.budget_above_least

    @property
    def prompt_lists(self) -> list[list[int]]:
        return [list(p) for p in self.prompts]


def draw_pool(rng: random.Random, needs: list[int]) -> int:
    """From the smallest legal pool (the largest request alone) to one where all fit at once."""
    smallest, roomy = max(needs), sum(needs) + 2
    return rng.choice([smallest, rng.randint(smallest, roomy), roomy])


@cache
def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    vocab = tiny_config().vocab_size
    prompts = random_shared_prefix_prompts(rng, vocab, max_prompts=6, max_prefix=20, max_tail=8)
    block_size, max_new = rng.randint(1, 8), rng.randint(1, 8)
    needs = [blocks_needed(len(p), max_new, block_size) for p in prompts]
    return Scenario(
        prompts=tuple(tuple(p) for p in prompts),
        block_size=block_size,
        total_blocks=draw_pool(rng, needs),
        max_running=rng.randint(1, 6),
        max_new_tokens=max_new,
        enable_prefix_cache=rng.random() < 0.8,
        serial=rng.random() < 0.25,
        hot_round=rng.random() < 0.4,
        eos_pick=(rng.randrange(len(prompts)), rng.randrange(max_new))
        if rng.random() < 0.3
        else None,
        abort_pick=(rng.randrange(len(prompts)), rng.randrange(8)) if rng.random() < 0.3 else None,
        budget_above_least=rng.choice([0, 1, block_size, 2 * block_size + 1, 512]),
    )


@cache
def free_run_tokens(seed: int) -> tuple[tuple[int, ...], ...]:
    """The oracle's tokens for a seed without an eos, computed once however many steps run it."""
    case = scenario(seed)
    outputs = reference_tokens(case.cfg, case.prompt_lists, case.max_new_tokens)
    return tuple(tuple(o) for o in outputs)


def eos_token_id(seed: int) -> int | None:
    pick = scenario(seed).eos_pick
    return None if pick is None else free_run_tokens(seed)[pick[0]][pick[1]]


@cache
def expected_tokens(seed: int) -> tuple[tuple[int, ...], ...]:
    """The oracle's tokens with the scenario's eos: greedy decoding is deterministic, so each
    output is the free run cut just after its first eos."""
    eos = eos_token_id(seed)
    return tuple(out[: out.index(eos) + 1] if eos in out else out for out in free_run_tokens(seed))


def run_round(engine, case: Scenario, eos: int | None) -> list[list[int]]:
    """Serve the scenario's prompts once; an aborted request's output is what abort returned."""
    if case.serial or case.abort_pick is None:
        run = engine.generate_serial if case.serial else engine.generate
        return run(case.prompt_lists, case.max_new_tokens, eos)
    ids = [engine.add_request(p, case.max_new_tokens, eos) for p in case.prompt_lists]
    victim, after = case.abort_pick
    aborted: dict[int, list[int]] = {}
    for rounds in itertools.count():
        if rounds == after and any(s.seq_id == ids[victim] for s in queued(engine)):
            aborted[ids[victim]] = engine.abort(ids[victim])
        if not engine.has_work:
            break
        engine.step()
    return [aborted[i] if i in aborted else engine.pop_output(i) for i in ids]


def queued(engine) -> list:
    return [*engine.scheduler.waiting, *engine.scheduler.running]


def matches(outputs: list[list[int]], expected: list[list[int]], case: Scenario) -> bool:
    """The reference's tokens; an aborted request's output is a prefix of its reference."""
    victim = case.abort_pick[0] if case.abort_pick and not case.serial else None
    return all(
        got == want[: len(got)] if i == victim else got == want
        for i, (got, want) in enumerate(zip(outputs, expected, strict=True))
    )


def new_engine(step: ModuleType, case: Scenario):
    return step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(case.cfg),
        max_running=case.max_running,
        enable_prefix_cache=case.enable_prefix_cache,
        **budget_args(step, case.budget),
    )


@cache
def step14_stats(seed: int) -> tuple[dict, ...]:
    """step14's stats after each round of a seed's scenario: what every step must report."""
    case = scenario(seed)
    engine = new_engine(load_step("step14"), case)
    rounds = []
    for _ in range(2 if case.hot_round else 1):
        run_round(engine, case, eos_token_id(seed))
        rounds.append(asdict(engine.stats))
    return tuple(rounds)


# ---- an independent model of the engine's block bookkeeping ---------------------------------


@dataclass
class ModelSeq:
    """One request in the model: what the design says a Sequence carries, and its known
    output (the reference's tokens), so output blocks can be hashed."""

    prompt: list[int]
    output: list[int]
    max_new: int
    generated: int = 0
    table: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    offset: int = 0
    preemptions: int = 0
    state: str = "waiting"  # waiting, prefilling, running, preempted, finished

    def token_ids(self) -> list[int]:
        return self.prompt + self.output[: self.generated]

    def append_token(self) -> None:
        self.generated += 1
        if self.generated >= len(self.output):  # max_new tokens, or the eos that ends it
            self.state = "finished"


class BlockBookkeeping:
    """The design's memory policy, written out again without a model or a KV pool.

    A round: every running request, oldest first, takes its step (a prefill chunk: adopt the
    cached chain that continues the block table, never the last token's block, then one block;
    or with a token ``budget``, step14_9's, what is left of the round's budget once each decoding
    request has its token: the rest of the prompt if it fits, else the whole blocks that do; or
    one decode token), taking blocks on demand and evicting only the shortfall; when the free and
    evictable blocks cannot cover it, the most recently admitted request is preempted (its
    blocks dropped, its tokens kept, back to the front of the queue, to prefill prompt + output
    again), perhaps the one that asked. Then, unless someone was preempted, waiting requests are
    admitted first come first served, up to max_running, while their first chunk fits. A block
    is cached once full (first block under a hash wins, parent must be cached); finished,
    preempted and aborted requests touch their blocks tail first and drop their references;
    eviction takes the least recently used cache-only leaf. Its figures are what every step's
    EngineStats must say: an exact expectation the engine does not produce."""

    def __init__(self, case: Scenario, outputs: list[list[int]], budget: int | None = None) -> None:
        self.case, self.outputs, self.bs, self.budget = case, outputs, case.block_size, budget
        self.cache_on = case.enable_prefix_cache
        self.free, self.peak, self.next_block = case.total_blocks, 0, 0
        self.refs: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, int | None] = OrderedDict()  # cached block -> its parent
        self.hash_of: dict[int, int] = {}
        self.children: Counter[int] = Counter()
        self.waiting: deque[ModelSeq] = deque()
        self.running: list[ModelSeq] = []
        self.counters = Counter()
        self.evictions = 0

    # -- driving it like generate / generate_serial / add_request + step + abort
    def serve(self, indices: list[int], abort: tuple[int, int] | None = None) -> list[int]:
        """Serve the prompts at ``indices`` together; returns each one's output length."""
        seqs = [ModelSeq(self.case.prompt_lists[i], self.outputs[i], 0) for i in indices]
        self.waiting.extend(seqs)
        for rounds in itertools.count():
            if abort is not None and rounds == abort[1]:
                self.abort(seqs[abort[0]])
            if not (self.waiting or self.running):
                break
            self.round()
        return [s.generated for s in seqs]

    def run_round_of_requests(self) -> list[int]:
        n = len(self.case.prompts)
        if self.case.serial:
            return [self.serve([i])[0] for i in range(n)]
        return self.serve(list(range(n)), self.case.abort_pick)

    def stats(self) -> dict[str, int]:
        total = self.case.total_blocks
        return {
            **{k: self.counters[k] for k in COUNTERS},
            "requests_running": len(self.running),
            "requests_waiting": len(self.waiting),
            "evictions": self.evictions,
            "blocks_free": self.free,
            "blocks_cached": len(self.lru),
            "blocks_used": total - self.free - self.evictable(),
            "blocks_peak": self.peak,
            **dict.fromkeys(TIER_FIGURES, 0),  # no second tier in these scenarios
        }

    def evictable(self) -> int:
        return sum(1 for b in self.lru if self.refs[b] == 1)

    # -- one round
    def round(self) -> None:
        ran, preemptions = [], self.counters["preemptions"]
        left = None if self.budget is None else self.budget - self.count("running")
        for seq in list(self.running):
            if seq.state == "preempted":  # an older request needed its blocks this round
                continue
            if seq.state == "prefilling":
                computed = self.prefill_chunk(seq, True, left)
                left = None if left is None else left - computed
            else:
                computed = self.decode_token(seq, may_preempt=True)
            if computed:
                ran.append(seq)
        while (
            self.counters["preemptions"] == preemptions
            and self.waiting
            and len(self.running) < self.case.max_running
            and (computed := self.prefill_chunk(self.waiting[0], False, left))
        ):
            left = None if left is None else left - computed
            ran.append(self.waiting[0])
            self.running.append(self.waiting.popleft())
        self.counters["rounds"] += bool(ran)
        self.counters["seqs_scheduled"] += len(ran)
        for seq in ran:
            if seq.state == "finished":
                self.release(seq)
        self.running = [s for s in self.running if s.state != "finished"]

    def count(self, state: str) -> int:
        return sum(seq.state == state for seq in self.running)

    def prefill_chunk(self, seq: ModelSeq, may_preempt: bool, left: int | None) -> int:
        """Adopt, allocate and count the sequence's next chunk; its length (0: none ran)."""
        tokens = seq.token_ids()  # a resumed request prefills its output again too
        hits = self.lookup(seq, tokens)
        start = seq.offset + len(hits) * self.bs
        rest = len(tokens) - start
        if left is None:
            chunk = min(self.bs, rest)
        else:
            chunk = rest if rest <= left else max(left, 0) // self.bs * self.bs
        first_hit = bool(hits) and not seq.hits
        if chunk == 0 or not self.allocate(seq, start + chunk, hits, may_preempt):
            return 0
        self.counters["computed_prefill_tokens"] += chunk
        if seq.preemptions:
            self.counters["resumed_cached_tokens"] += len(hits) * self.bs
        else:
            if seq.offset == 0:
                self.counters["requests"] += 1
                self.counters["prompt_tokens"] += len(seq.prompt)
            self.counters["requests_hit"] += first_hit
            self.counters["cached_tokens"] += len(hits) * self.bs
        seq.offset, seq.state = start + chunk, "prefilling"
        for end in range(start + 1, seq.offset + 1):
            self.cache_block(seq, end)  # each block the chunk fills
        if seq.offset == len(tokens):
            seq.state = "running"
            seq.append_token()
        return chunk

    def decode_token(self, seq: ModelSeq, may_preempt: bool) -> bool:
        kv_tokens = len(seq.prompt) + seq.generated  # the newest token's KV is written now
        if not self.allocate(seq, kv_tokens, [], may_preempt):
            return False
        self.counters["computed_decode_tokens"] += 1
        self.cache_block(seq, kv_tokens)
        seq.append_token()
        return True

    def lookup(self, seq: ModelSeq, tokens: list[int]) -> list[int]:
        first, last = len(seq.table), (len(tokens) - 1) // self.bs
        if not self.cache_on or first >= last:
            return []
        hashes = hash_prefix_blocks(tokens[: last * self.bs], self.bs)
        parent, hits = (seq.table[-1] if seq.table else None), []
        for block_hash in hashes[first:last]:
            block = self.by_hash.get(block_hash)
            if block is None or self.lru[block] != parent:
                break
            hits.append(block)
            parent = block
        return hits

    def allocate(self, seq: ModelSeq, kv_tokens: int, hits: list[int], may_preempt: bool) -> bool:
        """Adopt ``hits`` and take the blocks still missing; short of blocks, preempt the
        youngest running request until they fit, or until ``seq`` itself was the youngest."""
        while True:
            missing = cdiv(kv_tokens, self.bs) - len(seq.table) - len(hits)
            unevictable_once_adopted = sum(1 for b in hits if self.refs[b] == 1)
            if missing <= 0 or missing + unevictable_once_adopted <= self.free + self.evictable():
                break
            if not may_preempt:
                return False
            victim = self.running.pop()
            self.preempt(victim)
            if victim is seq:
                return False
        for block in hits:
            self.refs[block] += 1
        seq.table += hits
        seq.hits += hits
        if missing > 0:
            if missing > self.free and self.cache_on:
                self.evict(missing - self.free)
            for _ in range(missing):
                self.refs[self.next_block] = 1
                seq.table.append(self.next_block)
                self.next_block += 1
            self.free -= missing
            self.peak = max(self.peak, self.case.total_blocks - self.free)
        return True

    def preempt(self, seq: ModelSeq) -> None:
        self.counters["preemptions"] += 1
        self.release(seq)
        seq.offset, seq.state = 0, "preempted"
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def abort(self, seq: ModelSeq) -> None:
        """What engine.abort does to a request still queued or running (else nothing)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return
        self.release(seq)
        seq.state = "finished"

    def cache_block(self, seq: ModelSeq, kv_tokens: int) -> None:
        if not self.cache_on or kv_tokens % self.bs:
            return
        idx = kv_tokens // self.bs - 1
        block_hash = hash_prefix_blocks(seq.token_ids()[:kv_tokens], self.bs)[-1]
        block, parent = seq.table[idx], (seq.table[idx - 1] if idx else None)
        if block_hash in self.by_hash or block in self.lru:
            return
        if parent is not None and parent not in self.lru:
            return
        self.by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        self.lru[block] = parent
        self.refs[block] += 1
        if parent is not None:
            self.children[parent] += 1

    def evict(self, n: int) -> None:
        for _ in range(n):
            victim = next(b for b in self.lru if self.children[b] == 0 and self.refs[b] == 1)
            parent = self.lru.pop(victim)
            del self.by_hash[self.hash_of.pop(victim)]
            if parent is not None:
                self.children[parent] -= 1
            self.drop(victim)
            self.evictions += 1

    def drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            self.free += 1

    def release(self, seq: ModelSeq) -> None:
        """A finished, preempted or aborted request lets go of every block it held."""
        for block in reversed(seq.table):  # tail first: the tail is evicted first
            if block in self.lru:
                self.lru.move_to_end(block)
        for block in seq.table:  # adopted or allocated: one reference each
            self.drop(block)
        seq.table, seq.hits = [], []


COUNTERS = (
    "requests",
    "requests_hit",
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "computed_decode_tokens",
    "preemptions",
    "resumed_cached_tokens",
    "rounds",
    "seqs_scheduled",
)


@cache
def modelled_stats(seed: int, with_budget: bool = False) -> tuple[dict, ...]:
    """The bookkeeping model's figures after each round of a seed's scenario (``with_budget``:
    step14_9's chunks), and the length of every request's output (an aborted request's is what
    it had generated)."""
    case = scenario(seed)
    budget = case.budget if with_budget else None
    model = BlockBookkeeping(case, [list(o) for o in expected_tokens(seed)], budget)
    rounds = []
    for _ in range(2 if case.hot_round else 1):
        lengths = model.run_round_of_requests()
        rounds.append({**model.stats(), "output_lengths": lengths})
    return tuple(rounds)


def assert_stats_consistent(engine, case: Scenario, rounds: int, outputs: list[list[int]]) -> None:
    """Counters add up, the engine is at rest, and a disabled cache never claims a hit. Without
    preemption or abort, every prompt token is either adopted or computed once, and every
    output token but the last is decoded once."""
    stats, prompts = engine.stats, case.prompt_lists
    assert stats.requests <= rounds * len(prompts)
    assert stats.prompt_tokens <= rounds * sum(len(p) for p in prompts)
    assert 0 <= stats.cached_tokens < max(stats.prompt_tokens, 1)  # the last token is computed
    assert stats.requests_hit <= stats.requests
    assert stats.blocks_used == 0
    assert stats.blocks_free + stats.blocks_cached == case.total_blocks
    assert engine.ref_count_problems() == []
    if not case.enable_prefix_cache:
        assert stats.requests_hit == stats.cached_tokens == stats.blocks_cached == 0
        assert stats.resumed_cached_tokens == 0
    if stats.preemptions == 0:
        assert stats.resumed_cached_tokens == 0
    if stats.preemptions == 0 and (case.abort_pick is None or case.serial):
        assert stats.requests == rounds * len(prompts)
        assert stats.prompt_tokens == rounds * sum(len(p) for p in prompts)
        assert stats.cached_tokens + stats.computed_prefill_tokens == stats.prompt_tokens
        assert stats.computed_decode_tokens == rounds * sum(len(o) - 1 for o in outputs)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_scenario_matches_reference(
    step: ModuleType, make_engine: EngineFactory, seed: int
) -> None:
    """Whatever the memory, batching and cache settings, the tokens are the reference's."""
    case = scenario(seed)
    engine = make_engine(
        case.cfg,
        max_running=case.max_running,
        enable_prefix_cache=case.enable_prefix_cache,
        **budget_args(step, case.budget),
    )
    expected = [list(o) for o in expected_tokens(seed)]
    modelled = modelled_stats(seed, with_budget=has_fix(step, "step14_9"))
    outputs = run_round(engine, case, eos_token_id(seed))
    assert matches(outputs, expected, case)
    assert [len(o) for o in outputs] == modelled[0]["output_lengths"]
    stats = [asdict(engine.stats)]
    if case.hot_round:
        hits_before = engine.stats.requests_hit
        outputs = run_round(engine, case, eos_token_id(seed))
        assert matches(outputs, expected, case)
        assert [len(o) for o in outputs] == modelled[1]["output_lengths"]
        stats.append(asdict(engine.stats))
        assert_hot_round_hits(engine, case, engine.stats.requests_hit - hits_before)
    assert_stats_consistent(engine, case, len(stats), expected)
    figures = [{k: v for k, v in r.items() if k != "output_lengths"} for r in modelled]
    assert stats == figures
    if not has_fix(step, "step14_9"):  # step14_9's chunks: the model with its budget, above
        assert tuple(stats) == step14_stats(seed)


def assert_hot_round_hits(engine, case: Scenario, hot_hits: int) -> None:
    """Without eviction, every prompt longer than a block finds at least its first block in the
    cache on the second round (whoever computed it first in round one stored it). With
    evictions this simple count no longer holds; the bookkeeping model's figures, compared in
    every scenario, pin the hot round's hits exactly then."""
    if not case.enable_prefix_cache:
        assert hot_hits == 0
    elif engine.stats.evictions == 0 and (case.abort_pick is None or case.serial):
        assert hot_hits == sum(len(p) > case.block_size for p in case.prompts)
