"""step14_10's idea, beyond the chapter: a second tier behind the prefix cache (the OS's swap).

Every full block the prefix cache takes is also written through to the tier, once, keyed by its
chain hash; a lookup whose chain of pool hits ends goes on in the tier, and each block found
there is loaded into a fresh pool block, cached, and adopted instead of computed. The
specification: the tokens are the dense reference's (float64: the loaded bytes are the
computed ones); what the pool evicted comes back as loads, not computation; each hash is
stored once; a block loaded from the tier is never stored again; an entry that is corrupt,
another model's or another block size's is never used; a tier that fails costs only
computation; the loads never evict the pool hits they continue; the pool's books stay sane.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from types import ModuleType

import pytest
import torch

from common.hashing import hash_prefix_blocks
from common.kv_events import BlockRemoved, BlockStored, replay
from common.kv_offload import KVOffload
from common.kv_tiers import DiskTier, HostTier, KVTier, RedisTier
from common.observer import RoundObserver
from common.sampling_params import SamplingParams
from front.steps import load_step
from tests.helpers import reference_tokens, tiny_config, tokens

STEP = "step14_10"
CFG = tiny_config()
BS = CFG.block_size


def make(cfg=CFG, tier: KVTier | None = None, max_running: int = 2, **engine_args: object):
    """A step14_10 engine with a host tier (or ``tier``) of its own."""
    step = load_step(STEP)
    engine = step.PagedPrefixCacheEngine(
        step.TinyTransformerPaged(cfg),
        max_running=max_running,
        kv_offloading_backend=tier if tier is not None else HostTier(1 << 30),
        **engine_args,
    )
    return engine


def offload(engine) -> KVOffload:
    return engine.kv_cache_manager.offload


def tenants(n: int, prefix_blocks: int, tail: int = 3) -> list[list[int]]:
    """``n`` prompts of unrelated prefixes of ``prefix_blocks`` full blocks and a short tail."""
    return [tokens(100 + i, prefix_blocks * BS) + tokens(200 + i, tail) for i in range(n)]


class Loads(RoundObserver):
    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.stored: list[tuple[str, int]] = []

    def loaded(self, seq, block_ids: list[int], evicted: list[int]) -> None:
        self.blocks.extend(block_ids)

    def tier_stored(self, medium, block_hash, parent_hash, token_ids) -> None:
        self.stored.append((medium, block_hash))


# ---- the idea: what the pool evicted comes back as a load --------------------------------------


def test_an_evicted_prefix_is_loaded_back_not_computed() -> None:
    """Four tenants' 4-block prefixes through a pool of 12 blocks, twice, one request at a
    time: the pool holds at most two tenants' prefixes, so step14_9 computes most prefixes
    again on the second pass; with the tier, the second pass computes only each prompt's tail,
    and the tokens are the reference's."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    expected = reference_tokens(cfg, prompts + prompts, 3)
    step9 = load_step("step14_9")
    without = step9.PagedPrefixCacheEngine(step9.TinyTransformerPaged(cfg), max_running=2)
    assert without.generate_serial(prompts + prompts, 3) == expected
    engine = make(cfg)
    first = engine.generate_serial(prompts, 3)
    computed_first = engine.stats.computed_prefill_tokens
    second = engine.generate_serial(prompts, 3)
    assert first + second == expected
    stats = engine.stats
    assert stats.evictions > 0, "the pool must be too small for the workload"
    computed_second = stats.computed_prefill_tokens - computed_first
    assert computed_second == sum(len(p) - 4 * BS for p in prompts)  # only each prompt's tail
    assert without.stats.computed_prefill_tokens - computed_first > 4 * computed_second
    assert stats.kv_offload_loads >= 2 * 4  # the pool kept two tenants' prefixes at most
    assert stats.external_prefix_cache_hits == stats.kv_offload_loads * BS
    assert engine.ref_count_problems() == []


def test_each_block_is_stored_once_and_a_loaded_one_never_again() -> None:
    """Write-through at most once per hash: every full block the cache takes goes to the tier
    once; blocks that came from the tier are not written back."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    engine = make(cfg)
    watcher = Loads()
    engine.observer.add(watcher)
    engine.generate_serial(prompts, 3)
    offload(engine).flush()
    stores = engine.stats.kv_offload_stores
    assert stores == len(watcher.stored) == len({h for _, h in watcher.stored})
    assert {m for m, _ in watcher.stored} == {"CPU"}  # vLLM's medium for host memory
    engine.generate_serial(prompts, 3)
    offload(engine).flush()
    assert watcher.blocks, "the second pass must load"
    assert engine.stats.kv_offload_stores == stores  # nothing new: loaded blocks stay stored
    assert engine.stats.kv_offload_bytes_stored == stores * block_bytes(cfg)


def block_bytes(cfg) -> int:
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    return 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.d_head * itemsize


def test_batched_requests_get_the_reference_tokens_under_pressure() -> None:
    """Many requests at once over a tight pool: loads, evictions and preemptions interleave;
    the tokens are still the reference's and the pool's books are sane (no loaded block is
    leaked, none evicted from under the chain it continues)."""
    cfg = tiny_config(total_blocks=14)
    prompts = [p + tokens(300 + i, 2) for i, p in enumerate(tenants(5, 3) * 2)]
    engine = make(cfg, max_running=3)
    engine.generate(prompts, 4)
    again = engine.generate(prompts, 4)
    assert again == reference_tokens(cfg, prompts, 4)
    assert engine.stats.kv_offload_loads > 0
    assert engine.ref_count_problems() == []


def test_loads_never_evict_the_pool_hits_they_continue() -> None:
    """A prompt whose first two blocks are still in the pool and whose next three are in the
    tier only, looked up while another request holds half of an 8-block pool: of the four
    blocks an allocation could get, two are those hits, so two blocks are loaded (evicting
    others), never the hits; the last is loaded once the pool has room. Loading three at once
    would evict a hit it continues, and the chain would be loaded again and again."""
    cfg = tiny_config(total_blocks=8)
    prompt, other = tokens(1, 5 * BS + 1), tokens(4, 3 * BS + 1)
    engine = make(cfg)
    for p in (prompt, tokens(2, 3 * BS + 1), tokens(3, 2 * BS + 1), [*prompt[: 2 * BS], 7]):
        engine.generate_serial([p], 1)  # the prompt's blocks 3-5 evicted, 1-2 used last
    engine.add_request(other, 3)
    engine.step()  # it holds 4 blocks now; the other 4 are evictable, two of them our hits
    request = engine.add_request(prompt, 1)
    engine.step()
    assert engine.stats.kv_offload_loads == 2
    while engine.has_work:
        engine.step()
    assert [engine.pop_output(request)] == reference_tokens(cfg, [prompt], 1)
    assert engine.stats.kv_offload_loads == 3
    assert engine.ref_count_problems() == []


# ---- what the tier holds is proven before it is used -------------------------------------------


class Corrupting(HostTier):
    """A host tier whose stored entries have one byte flipped near the end (in the K/V)."""

    def get(self, key: str) -> bytes | None:
        raw = super().get(key)
        return None if raw is None else raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:]


def test_a_corrupt_entry_is_computed_instead(caplog: pytest.LogCaptureFixture) -> None:
    """A flipped byte fails the entry's CRC: the block is computed, the tokens are right, the
    failure is counted, and the log says so once however many entries are refused."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    tier = Corrupting(1 << 30)
    writer = make(cfg, tier)
    writer.generate_serial(prompts, 3)
    offload(writer).flush()
    reader = make(cfg, tier)  # a new engine: nothing pending, every entry read from the tier
    with caplog.at_level(logging.WARNING, logger="common.kv_offload"):
        assert reader.generate_serial(prompts, 3) == reference_tokens(cfg, prompts, 3)
    assert reader.stats.kv_offload_loads == 0
    assert reader.stats.kv_offload_failures == 4  # one refused entry per prompt, then computed
    assert len([r for r in caplog.records if "refused" in r.message]) == 1


def test_another_models_entry_is_never_used() -> None:
    """Two models (other weights; another block size) sharing one tier: each finds only its
    own blocks, even under its own key (an entry names its model, which is checked)."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(2, 4)
    tier = HostTier(1 << 30)
    ours = make(cfg, tier)
    ours.generate_serial(prompts, 3)
    offload(ours).flush()
    for other_cfg in (cfg.replace(seed=cfg.seed + 1), cfg.replace(block_size=BS * 2)):
        other = make(other_cfg, tier)
        assert other.generate_serial(prompts, 3) == reference_tokens(other_cfg, prompts, 3)
        assert other.stats.kv_offload_loads == 0
    # A forged copy: our entries moved under the other model's keys are refused by their header.
    other = make(cfg.replace(seed=cfg.seed + 1), tier)
    for key in list(tier._entries):
        block_hash = int(key.rsplit("-", 1)[1], 16)
        tier.put(offload(other).key(block_hash), tier.get(key))
    assert other.generate_serial(prompts, 3) == reference_tokens(other.model.cfg, prompts, 3)
    assert other.stats.kv_offload_loads == 0
    assert other.stats.kv_offload_failures == len(prompts)


def test_a_colliding_entry_is_never_used() -> None:
    """An entry under our block's key whose tokens are another block's (a hash collision, or a
    forged entry: its K/V is that other block's) is refused as the pool refuses such a hit: by
    comparing the tokens, not trusting the hash."""
    cfg = tiny_config()
    a, b = tenants(2, 2)
    tier = HostTier(1 << 30)
    writer = make(cfg, tier)
    writer.generate_serial([a, b], 3)
    offload(writer).flush()
    ours, theirs = (hash_prefix_blocks(p, BS)[0] for p in (a, b))
    forged = json_header(tier.get(offload(writer).key(theirs)), block_hash=ours)
    tier.put(offload(writer).key(ours), forged)
    reader = make(cfg, tier)
    assert reader.generate([a], 3) == reference_tokens(cfg, [a], 3)
    assert reader.stats.kv_offload_loads == 0


def json_header(raw: bytes, **changes: object) -> bytes:
    """``raw``, an entry, with fields of its JSON header changed (its K/V and CRC untouched)."""
    (size,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4 : 4 + size]) | changes
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + raw[4 + size :]


def test_a_block_refused_by_the_cache_is_not_written_through() -> None:
    """A request that reads no cache (it asks for its prompt logprobs) computes its own copy
    of a cached prefix: the cache refuses those blocks (the first block under a hash wins),
    and so does the tier."""
    cfg = tiny_config()
    prompt = tenants(1, 3)[0]
    engine = make(cfg)
    watcher = Loads()
    engine.observer.add(watcher)
    engine.generate([prompt], 2)
    offload(engine).flush()
    stored = list(watcher.stored)
    assert len(stored) == 4  # three prompt blocks, and the one its answer filled
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)  # (vLLM: then it reads no cache)
    engine.generate([prompt], sampling_params=params)
    offload(engine).flush()
    assert watcher.stored == stored and engine.stats.kv_offload_stores == 4


class Gated(HostTier):
    """A host tier whose writes wait at a gate: blocks stay on their way until it opens."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gate = threading.Event()

    def put(self, key: str, value: bytes) -> bool:
        self.gate.wait(timeout=30)
        return super().put(key, value)


def test_a_block_on_its_way_to_the_tier_is_found() -> None:
    """With every write held back, the tier itself holds nothing; the second pass still loads
    every evicted block, from the writer's queue: what one request stored the next one finds,
    whatever the writer's pace."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    tier = Gated(1 << 30)
    engine = make(cfg, tier)
    try:
        engine.generate_serial(prompts, 3)
        computed = engine.stats.computed_prefill_tokens
        assert engine.generate_serial(prompts, 3) == reference_tokens(cfg, prompts, 3)
        assert tier.nbytes == 0, "nothing may have reached the tier yet"
        assert engine.stats.computed_prefill_tokens - computed == 4 * 3
    finally:
        tier.gate.set()
    offload(engine).flush()
    assert tier.nbytes > 0


def test_kv_events_say_which_medium_holds_a_block() -> None:
    """With KV events on, a block written through is a ``BlockStored`` of the tier's medium
    (vLLM's "CPU" for host memory) after the pool's own ("GPU", vLLM's name for the pool on
    every build); a block loaded back is stored in the pool again."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    engine = make(cfg, enable_kv_cache_events=True)
    engine.generate_serial(prompts, 3)
    events = engine.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    pool = [e.block_hashes[0] for e in stored if e.medium == "GPU"]
    tier = [e.block_hashes[0] for e in stored if e.medium == "CPU"]
    assert pool and sorted(pool) == sorted(tier)  # every cached block, once in each medium
    assert set(replay(events, medium="CPU")) == set(tier)  # what a router rebuilds of the tier
    engine.generate_serial(prompts, 3)
    again = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    loaded = {e.block_hashes[0] for e in again if e.medium == "GPU"} & set(tier)
    assert len(loaded) >= 8  # back in the pool (at least the two tenants it had evicted)
    # blocks computed again (each prompt's last, which its answer filled) may be announced
    # again by the tier: nothing it did not hold already
    assert {e.block_hashes[0] for e in again if e.medium == "CPU"} <= set(tier)


def tier_events(events: list, medium: str) -> tuple[set[int], list[int]]:
    """The hashes stored in ``medium``, and those removed from it, in the events' order."""
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == medium]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == medium]
    return {h for e in stored for h in e.block_hashes}, [h for e in removed for h in e.block_hashes]


@pytest.mark.parametrize("kind", ["host", "disk", "written after the rounds"])
def test_kv_events_follow_the_tier_as_it_evicts(kind: str, tmp_path) -> None:
    """A tier too small for the workload evicts; each block it drops is a ``BlockRemoved`` of
    its medium, so the stream's replay of that medium is exactly what the tier holds (what a
    router's index of the tier must be), and the pool's replay is untouched by it. Also when
    every write lands after the last round (a slow tier): the flush reports them."""
    probe = make()  # how many bytes a block takes in a tier
    probe.generate_serial(tenants(1, 1), 1)
    offload(probe).flush()
    capacity = 5 * offload(probe).tier.nbytes // offload(probe).stores  # about five blocks
    tiers = {"host": HostTier, "written after the rounds": Gated}
    tier = tiers[kind](capacity) if kind in tiers else DiskTier(tmp_path / "tier", capacity)
    engine = make(tiny_config(total_blocks=12), tier, enable_kv_cache_events=True)
    engine.generate_serial(tenants(4, 4), 3)
    if isinstance(tier, Gated):
        tier.gate.set()
    offload(engine).flush()
    events = engine.take_events()
    stored, removed = tier_events(events, tier.medium)
    held = {h for h in stored if tier.contains(offload(engine).key(h))}
    assert 0 < len(held) < len(stored) and len(removed) == tier.evictions
    assert set(replay(events, medium=tier.medium)) == held
    pool = engine.kv_cache_manager.prefix_cache
    assert len(replay(events)) == len(pool)  # the pool's own stream: its cached blocks


def test_a_block_the_tier_never_took_is_announced_removed() -> None:
    """A write the tier refused (it failed): the block announced in the tier is removed from
    it in the stream, and a replay of the tier holds nothing."""
    engine = make(tiny_config(total_blocks=12), Failing(1 << 30), enable_kv_cache_events=True)
    engine.generate_serial(tenants(2, 2), 2)
    offload(engine).flush()
    events = engine.take_events()
    stored, removed = tier_events(events, "CPU")
    assert stored and sorted(removed) == sorted(stored)
    assert replay(events, medium="CPU") == {}


# ---- a restart, and a failing tier --------------------------------------------------------------


def test_after_a_restart_the_disk_tier_serves_the_prefix(tmp_path) -> None:
    """A disk tier outlives its engine: a new engine (a new process's, a new model object)
    on the same folder computes only the tail of a prompt the old one served."""
    cfg = tiny_config()
    prompt = tenants(1, 5)[0]
    first = make(cfg, DiskTier(tmp_path, 1 << 30))
    expected = first.generate([prompt], 3)
    offload(first).close()
    again = make(cfg, DiskTier(tmp_path, 1 << 30))
    assert again.generate([prompt], 3) == expected
    assert again.stats.cached_tokens == 5 * BS  # every full block, from the disk
    assert again.stats.kv_offload_loads == 5


class Failing(HostTier):
    """A tier that has gone away: every call fails (counted), as a dead server's would."""

    def get(self, key: str) -> bytes | None:
        self.failures += 1
        return None

    def contains(self, key: str) -> bool:
        self.failures += 1
        return False

    def put(self, key: str, value: bytes) -> bool:
        self.failures += 1
        return False


def test_a_failing_tier_costs_only_computation() -> None:
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    engine = make(cfg, Failing(1 << 30))
    out = engine.generate_serial(prompts + prompts, 3)
    assert out == reference_tokens(cfg, prompts + prompts, 3)
    offload(engine).flush()
    assert engine.stats.kv_offload_loads == 0 and engine.stats.kv_offload_stores == 0
    assert engine.stats.kv_offload_failures > 0
    assert engine.ref_count_problems() == []


# ---- Redis: a tier shared by a fleet ------------------------------------------------------------


def test_replicas_sharing_redis_load_what_another_computed(redis_url: str) -> None:
    """Two engines (two replicas) behind one Redis: what one computed, the other loads; each
    replica computes only the tails of prompts the other served first."""
    cfg = tiny_config()
    prompts = tenants(3, 4)
    one, two = make(cfg, RedisTier(redis_url)), make(cfg, RedisTier(redis_url))
    assert one.generate(prompts, 3) == reference_tokens(cfg, prompts, 3)
    offload(one).flush()  # (a fleet's replicas see a block once its write reaches the server)
    assert two.generate(prompts, 3) == reference_tokens(cfg, prompts, 3)
    assert two.stats.kv_offload_loads == 3 * 4
    assert two.stats.computed_prefill_tokens == 3 * 3  # each prompt's tail alone
    offload(one).close(), offload(two).close()


def test_a_redis_killed_mid_run_costs_only_computation(
    redis_server, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis dies between two rounds of requests: every request is still answered with the
    reference's tokens, the engine computes what it would have loaded, and the log says so
    once; when the server is back, the tier is used again."""
    cfg = tiny_config(total_blocks=12)
    prompts = tenants(4, 4)
    engine = make(cfg, RedisTier(redis_url, backoff_s=0.2))
    expected = reference_tokens(cfg, prompts, 3)
    assert engine.generate_serial(prompts, 3) == expected
    offload(engine).flush()
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="common.kv_tiers"):
        assert engine.generate_serial(prompts, 3) == expected
        offload(engine).flush()
    outage = [r for r in caplog.records if r.name == "common.kv_tiers"]
    assert len(outage) == 1 and "redis" in outage[0].message
    assert engine.stats.kv_offload_failures > 0
    assert engine.ref_count_problems() == []
    redis_server.start()
    time.sleep(0.3)  # past the back-off
    loads = engine.stats.kv_offload_loads
    assert engine.generate_serial(prompts, 3) == expected  # stores again...
    offload(engine).flush()
    assert engine.generate_serial(prompts, 3) == expected  # ...and loads them
    assert engine.stats.kv_offload_loads > loads


# ---- cost: a lookup visits the request's blocks, never the tier's ------------------------------


class Counting(HostTier):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gets = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return super().get(key)


@pytest.mark.parametrize("filler", [0, 200])
def test_a_lookup_asks_the_tier_for_its_own_blocks_only(filler: int) -> None:
    """However many blocks the tier holds, a lookup asks it for the request's blocks past the
    pool's chain, up to the first miss: one get each, the same count with 0 or 200 others."""
    cfg = tiny_config(total_blocks=12)
    tier = Counting(1 << 30)
    for i in range(filler):
        tier.put(f"other-{i}", bytes(64))
    prompts = tenants(4, 4)
    engine = make(cfg, tier)
    engine.generate_serial(prompts, 3)
    offload(engine).flush()
    gets, loads = tier.gets, engine.stats.kv_offload_loads
    engine.generate_serial(prompts, 3)
    # every block asked for was found (the second pass ends each lookup at the prompt's tail)
    assert tier.gets - gets == engine.stats.kv_offload_loads - loads == 4 * 4


def test_the_tier_needs_the_prefix_cache_and_a_step_that_has_it(step: ModuleType) -> None:
    """Only step14_10 takes the tier's options; with the prefix cache off there is no tier."""
    model = step.TinyTransformerPaged(CFG)
    if step.__name__ != STEP:
        with pytest.raises(TypeError):
            step.PagedPrefixCacheEngine(model, kv_offloading_backend="host")
        return
    engine = step.PagedPrefixCacheEngine(model, enable_prefix_cache=False, kv_offloading_size=1)
    assert engine.kv_cache_manager.offload is None
    with pytest.raises(ValueError, match=r"kv_offloading|backend"):
        step.PagedPrefixCacheEngine(model, kv_offloading_backend="tape:/dev/st0")


# ---- the random scenarios, with a tier ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(0, 320, 2))
def test_random_scenarios_with_a_tier_get_the_reference_tokens(seed: int) -> None:
    """The cross-step random scenarios (tight pools, preemptions, aborts, eos, hot rounds), run
    by step14_10 with a host tier: three rounds, the second on the same engine (hits in the
    pool and loads behind them, in tight pools), the third on a fresh one behind the same tier
    (everything it finds, it loads): the tokens are the reference's, the books sane."""
    from tests.engine.test_random_scenarios import (
        eos_token_id,
        expected_tokens,
        matches,
        run_round,
        scenario,
    )

    case = scenario(seed)
    tier = HostTier(1 << 30)
    expected = [list(o) for o in expected_tokens(seed)]
    args = (case.cfg, tier, case.max_running)
    first = make(*args, enable_prefix_cache=case.enable_prefix_cache)
    fresh = make(*args, enable_prefix_cache=case.enable_prefix_cache)
    for engine in (first, first, fresh):  # cold; hot in the pool and the tier; the tier's only
        assert matches(run_round(engine, case, eos_token_id(seed)), expected, case)
        assert engine.ref_count_problems() == []
        if engine.kv_cache_manager.offload is not None:
            offload(engine).flush()
