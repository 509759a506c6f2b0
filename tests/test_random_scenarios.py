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
pinned exactly, hot rounds after evictions included.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from functools import cache
from types import ModuleType

import pytest

from common.config import ModelConfig
from common.hashing import hash_prefix_blocks
from common.inputs import cdiv
from common.steps import load_step
from common.workload import random_shared_prefix_prompts
from tests.helpers import (
    EngineFactory,
    blocks_needed,
    reference_tokens,
    tiny_config,
)

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

    @property
    def cfg(self) -> ModelConfig:
        return tiny_config(block_size=self.block_size, total_blocks=self.total_blocks)

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
    run = engine.generate_serial if case.serial else engine.generate
    return run(case.prompt_lists, case.max_new_tokens, eos)


def new_engine(step: ModuleType, case: Scenario):
    return step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(case.cfg),
        max_running=case.max_running,
        enable_prefix_cache=case.enable_prefix_cache,
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
    state: str = "waiting"  # waiting, prefilling, running, finished

    def token_ids(self) -> list[int]:
        return self.prompt + self.output[: self.generated]

    def append_token(self) -> None:
        self.generated += 1
        if self.generated >= len(self.output):  # max_new tokens, or the eos that ends it
            self.state = "finished"


class BlockBookkeeping:
    """The design's memory policy, written out again without a model or a KV pool: admission
    (first come, first served, up to max_running, whole-life need against free + evictable -
    reserved), per round every prefill chunk (adopt the cached chain that continues the block
    table, never the last prompt token's block; allocate lazily, evicting only the shortfall),
    then every decode token; a block is cached once full (first block under a hash wins, parent
    must be cached); finished requests touch their blocks tail first and drop their references;
    eviction takes the least recently used cache-only leaf. Its figures are what every step's
    EngineStats must say, evictions and all: an exact expectation the engine does not produce."""

    def __init__(self, case: Scenario, outputs: list[list[int]]) -> None:
        self.case, self.outputs, self.bs = case, outputs, case.block_size
        self.cache_on = case.enable_prefix_cache
        self.free, self.peak, self.reserved, self.next_block = case.total_blocks, 0, 0, 0
        self.refs: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, int | None] = OrderedDict()  # cached block -> its parent
        self.hash_of: dict[int, int] = {}
        self.children: Counter[int] = Counter()
        self.waiting: deque[ModelSeq] = deque()
        self.running: list[ModelSeq] = []
        self.counters = Counter()
        self.evictions = 0

    # -- driving it like generate / generate_serial
    def serve(self, prompt_indices: list[int]) -> None:
        for i in prompt_indices:
            p = self.case.prompt_lists[i]
            self.waiting.append(ModelSeq(p, self.outputs[i], self.case.max_new_tokens))
        while self.waiting or any(s.state != "finished" for s in self.running):
            self.round()

    def run_round_of_requests(self) -> None:
        n = len(self.case.prompts)
        if self.case.serial:
            for i in range(n):
                self.serve([i])
        else:
            self.serve(list(range(n)))

    def stats(self) -> dict[str, int]:
        evictable = sum(1 for b in self.lru if self.refs[b] == 1)
        total = self.case.total_blocks
        return {
            **{k: self.counters[k] for k in COUNTERS},
            "evictions": self.evictions,
            "blocks_free": self.free,
            "blocks_cached": len(self.lru),
            "blocks_used": total - self.free - evictable,
            "blocks_peak": self.peak,
        }

    # -- one round
    def round(self) -> None:
        self.running = [s for s in self.running if s.state != "finished"]
        while self.waiting and len(self.running) < self.case.max_running:
            seq = self.waiting[0]
            need = blocks_needed(len(seq.prompt), seq.max_new, self.bs)
            evictable = sum(1 for b in self.lru if self.refs[b] == 1)
            if need > self.free + evictable - self.reserved:
                break
            self.reserved += need
            seq.state = "prefilling"
            self.running.append(self.waiting.popleft())
        prefill = [s for s in self.running if s.state == "prefilling"]
        decode = [s for s in self.running if s.state == "running"]
        for seq in prefill:
            self.prefill_chunk(seq)
        for seq in decode:
            self.decode_token(seq)
        for seq in prefill + decode:
            if seq.state == "finished":
                self.finish(seq)

    def prefill_chunk(self, seq: ModelSeq) -> None:
        if seq.offset == 0:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(seq.prompt)
        self.adopt(seq)
        chunk = min(self.bs, len(seq.prompt) - seq.offset)
        self.allocate_slots(seq, seq.offset + chunk)
        self.counters["computed_prefill_tokens"] += chunk
        seq.offset += chunk
        self.cache_block(seq, seq.offset)
        if seq.offset == len(seq.prompt):
            seq.state = "running"
            seq.append_token()

    def decode_token(self, seq: ModelSeq) -> None:
        kv_tokens = len(seq.prompt) + seq.generated  # the newest token's KV is written now
        self.allocate_slots(seq, kv_tokens)
        self.counters["computed_decode_tokens"] += 1
        self.cache_block(seq, kv_tokens)
        seq.append_token()

    def adopt(self, seq: ModelSeq) -> None:
        first, last = len(seq.table), (len(seq.prompt) - 1) // self.bs
        if not self.cache_on or first >= last:
            return
        hashes = hash_prefix_blocks(seq.prompt[: last * self.bs], self.bs)
        parent, hits = (seq.table[-1] if seq.table else None), []
        for block_hash in hashes[first:last]:
            block = self.by_hash.get(block_hash)
            if block is None or self.lru[block] != parent:
                break
            hits.append(block)
            parent = block
        for block in hits:
            self.refs[block] += 1
        if hits and not seq.hits:
            self.counters["requests_hit"] += 1
        seq.table += hits
        seq.hits += hits
        seq.offset += len(hits) * self.bs
        self.reserved -= len(hits)
        self.counters["cached_tokens"] += len(hits) * self.bs

    def allocate_slots(self, seq: ModelSeq, kv_tokens: int) -> None:
        missing = cdiv(kv_tokens, self.bs) - len(seq.table)
        if missing <= 0:
            return
        if missing > self.free and self.cache_on:
            self.evict(missing - self.free)
        assert missing <= self.free, "the model ran out of blocks: admission is wrong"
        for _ in range(missing):
            self.refs[self.next_block] = 1
            seq.table.append(self.next_block)
            self.next_block += 1
        self.free -= missing
        self.reserved -= missing
        self.peak = max(self.peak, self.case.total_blocks - self.free)

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

    def finish(self, seq: ModelSeq) -> None:
        for block in reversed(seq.table):  # tail first: the tail is evicted first
            if block in self.lru:
                self.lru.move_to_end(block)
        for block in seq.table:  # adopted or allocated: one reference each
            self.drop(block)
        need = blocks_needed(len(seq.prompt), seq.max_new, self.bs)
        self.reserved -= need - len(seq.table)
        seq.table = []


COUNTERS = (
    "requests",
    "requests_hit",
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "computed_decode_tokens",
)


@cache
def modelled_stats(seed: int) -> tuple[dict[str, int], ...]:
    """The bookkeeping model's figures after each round of a seed's scenario."""
    case = scenario(seed)
    model = BlockBookkeeping(case, [list(o) for o in expected_tokens(seed)])
    rounds = []
    for _ in range(2 if case.hot_round else 1):
        model.run_round_of_requests()
        rounds.append(model.stats())
    return tuple(rounds)


def assert_stats_consistent(engine, case: Scenario, rounds: int, outputs: list[list[int]]) -> None:
    """Counters add up, the engine is at rest, and a disabled cache never claims a hit."""
    stats, prompts = engine.stats, case.prompt_lists
    assert stats.requests == rounds * len(prompts)
    assert stats.prompt_tokens == rounds * sum(len(p) for p in prompts)
    assert 0 <= stats.cached_tokens < stats.prompt_tokens  # the last token is always computed
    assert stats.cached_tokens + stats.computed_prefill_tokens == stats.prompt_tokens
    assert stats.computed_decode_tokens == rounds * sum(len(o) - 1 for o in outputs)
    assert stats.requests_hit <= stats.requests
    assert stats.blocks_used == 0
    assert stats.blocks_free + stats.blocks_cached == case.total_blocks
    assert engine.ref_count_problems() == []
    if not case.enable_prefix_cache:
        assert stats.requests_hit == stats.cached_tokens == stats.blocks_cached == 0


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_scenario_matches_reference(make_engine: EngineFactory, seed: int) -> None:
    """Whatever the memory, batching and cache settings, the tokens are the reference's."""
    case = scenario(seed)
    engine = make_engine(
        case.cfg, max_running=case.max_running, enable_prefix_cache=case.enable_prefix_cache
    )
    expected = [list(o) for o in expected_tokens(seed)]
    assert run_round(engine, case, eos_token_id(seed)) == expected
    stats = [asdict(engine.stats)]
    if case.hot_round:
        hits_before = engine.stats.requests_hit
        assert run_round(engine, case, eos_token_id(seed)) == expected
        stats.append(asdict(engine.stats))
        assert_hot_round_hits(engine, case, engine.stats.requests_hit - hits_before)
    assert_stats_consistent(engine, case, len(stats), expected)
    modelled = modelled_stats(seed)
    assert [{k: r[k] for k in modelled[0]} for r in stats] == list(modelled)
    assert tuple(stats) == step14_stats(seed)


def assert_hot_round_hits(engine, case: Scenario, hot_hits: int) -> None:
    """Without eviction, every prompt longer than a block finds at least its first block in the
    cache on the second round (whoever computed it first in round one stored it). With
    evictions this simple count no longer holds; the bookkeeping model's figures, compared in
    every scenario, pin the hot round's hits exactly then."""
    if not case.enable_prefix_cache:
        assert hot_hits == 0
    elif engine.stats.evictions == 0:
        assert hot_hits == sum(len(p) > case.block_size for p in case.prompts)
