"""--workload replicas: the prefix cache across a fleet. --replicas servers of one step (the
last of --steps), one torch thread each, behind vllm-router, once per routing policy
(--policies), each served the same seeded multi-tenant, multi-turn workload arriving over time;
each replica's pool holds about half of the tenants' system prompts. Per policy: the prompt
tokens the fleet's caches served (every replica's /metrics), the prompt tokens it computed
against the ideal (one engine, a pool that never evicts: every prefix computed once), time to
first token, throughput, and how the requests spread over the replicas. Results: replicas.json
and replicas.png.

One engine holds a tenant's system prompt once for all its users, and a conversation's history
once for all its turns. Several engines behind a balancer that ignores prefixes (round robin)
send each tenant and each turn wherever the next slot is: every replica computes every prefix,
and each replica's pool caches a share of the same prefixes. A router that knows where each
prefix lives sends a request there: ``cache_aware`` guesses it from the requests it routed
(a tree of their token ids), ``kv_aware`` knows it from the replicas' KV cache events
(docs/scale-out.md).

With ``--kv-offloading-backend`` (step14_10 on), a comma-separated list of second tiers, each
run side by side with every policy: ``none`` (the pool alone), ``host`` (each replica's own
host memory), ``disk`` (each replica's own fresh folder) or ``redis`` (a ``redis-server`` this
bench starts, shared by every replica); ``--kv-offloading-size`` bounds each (the Redis
server's ``maxmemory``). A prompt token a replica loaded from its tier counts as served, not
computed (``vllm:external_prefix_cache_hits``).

Every answer is checked against the same step's engine serving the same conversations alone
(greedy, token for token); that engine, with a pool that never evicts, also gives the ideal.
The (tier, policy) pairs run in passes (each once per pass, --repeats passes), every run on
freshly started replicas (cold pools, cold tiers: a host tier lives in its server's process, a
disk tier in a fresh folder, and a fresh ``redis-server`` starts empty) and a fresh router.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config import PRESETS, preset
from common.kv_tiers import DEFAULT_SIZE_GIB, GIB, check_tier_spec
from front import toy_checkpoint
from front.cli import plural

from .. import charts
from ..cells import markdown
from ..conversations import USERS_PER_TENANT, Chat, TenantWorkload, Turn, drive, prompts_of
from ..fleet import (
    POLICIES,
    RedisServer,
    Replica,
    Router,
    counter,
    redis_server_path,
    router_path,
    start_replicas,
)
from ..latency import percentile
from ..models import load_step_model
from ..options import BenchOptions
from ..progress import Progress
from ..saved import saved_run_head, write_json

NAME = "replicas"
SUMMARY = "replicas of a step's server behind vllm-router, per routing policy (prefix reuse)"
DEFAULTS = dict(
    prefix_len=256,
    tail_len=16,
    new_tokens=16,
    max_running=4,
    request_rate=2.0,
    replicas=2,
    policies=POLICIES,
    tenants=8,
    turns=5,
    turn_delay=0.0,
    block_size=16,
    total_blocks=None,
    model="demo",
)
NOT_READ = "makes its own conversations"
OWN_TIERS = True  # --kv-offloading-backend: read here, not as one engine's tier
HELP = __doc__.split("\n\n")[0]
SERVED_NAME = "toy"


def workload_of(options: BenchOptions) -> TenantWorkload:
    return TenantWorkload(
        options.tenants,
        options.turns,
        options.prefix_len,
        options.tail_len,
        options.new_tokens,
        options.request_rate,
        turn_delay=options.turn_delay,
    )


NO_TIER = "none"
TIERS = (NO_TIER, "host", "native", "disk", "redis")  # the words --kv-offloading-backend takes


def tiers_of(options: BenchOptions) -> tuple[str, ...]:
    """The second tiers to run side by side (``--kv-offloading-backend``, comma-separated); a
    size alone means a host tier, as for the engine; neither, none."""
    text = options.kv_offloading_backend
    if text is None:
        return (NO_TIER,) if options.kv_offloading_size is None else ("host",)
    return tuple(word.strip() for word in text.split(",") if word.strip())


def check_tiers(options: BenchOptions) -> None:
    """Each tier a word of ``TIERS``, once: the bench makes every tier itself, so that each run
    starts from an empty one."""
    tiers = tiers_of(options)
    for word in tiers:
        if word.startswith(("redis://", "rediss://")):
            raise ValueError(
                "--kv-offloading-backend: say redis, not a URL: --workload replicas starts a "
                "redis-server of its own for each run, so that every run starts from an empty "
                "tier (it never empties a server it did not start)"
            )
        if word.startswith("disk:"):
            raise ValueError(
                "--kv-offloading-backend: say disk, not disk:DIR: --workload replicas gives "
                "each replica a fresh folder of its own for each run (an empty tier)"
            )
        if word not in TIERS:
            raise ValueError(
                f"--kv-offloading-backend: no tier {word!r}; --workload replicas takes a "
                f"comma-separated list of {', '.join(TIERS)}"
            )
    if not tiers or len(set(tiers)) != len(tiers):
        raise ValueError("--kv-offloading-backend: name each tier once, e.g. none,host")
    if "redis" in tiers:
        check_tier_spec("redis://127.0.0.1:6379", None)  # the replicas need the client package


def check(options: BenchOptions) -> None:
    check_tiers(options)
    if options.model not in PRESETS:
        raise ValueError(
            "--workload replicas takes a preset (--model demo): it writes that preset as a "
            "checkpoint with a word-level tokenizer, so that text and tokens map one to one"
        )
    if math.isinf(options.request_rate):
        raise ValueError("--request-rate: the conversations start over time, give a rate")


def pool_blocks(workload: TenantWorkload, block_size: int, max_running: int) -> tuple[int, int]:
    """Each replica's pool: (half of the tenants' system prompts, room for ``max_running``
    conversations' own blocks beside them)."""
    prefixes = math.ceil(workload.tenants / 2) * (workload.prefix_len // block_size)
    own = math.ceil((workload.longest - workload.prefix_len) / block_size) + 1
    return prefixes, max_running * own


# ---- one run: a policy, the fleet, the workload ------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    turns: list[Turn]
    prompt_tokens: list[float]  # per replica, from its /metrics
    cache_hits: list[float]
    requests: list[float]
    router: dict[str, float] = field(default_factory=dict)
    tier: str = NO_TIER
    tier_hits: list[float] = field(default_factory=list)  # loaded from the second tier
    tier_failures: list[float] = field(default_factory=list)

    @property
    def computed(self) -> float:
        return sum(self.prompt_tokens) - sum(self.cache_hits) - sum(self.tier_hits)

    @property
    def reuse(self) -> float:
        """The share of prompt tokens served, by the pools and the tier together."""
        return (sum(self.cache_hits) + sum(self.tier_hits)) / max(sum(self.prompt_tokens), 1)

    @property
    def from_tier(self) -> float:
        return sum(self.tier_hits) / max(sum(self.prompt_tokens), 1)

    def ttft(self, p: float) -> float:
        return percentile([t.ttft for t in self.turns if t.first_text is not None], p)

    @property
    def tokens_per_s(self) -> float:
        done = [t for t in self.turns if t.last_text is not None]
        span = max(t.last_text for t in done) - min(t.sent for t in self.turns)
        return sum(len(t.answer) for t in done) / span

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "tier": self.tier,
            "per_replica": {
                "prompt_tokens": self.prompt_tokens,
                "prefix_cache_hits": self.cache_hits,
                "requests": self.requests,
                "external_prefix_cache_hits": self.tier_hits,
                "kv_offload_failures": self.tier_failures,
            },
            "router_metrics": self.router,
            "turns": [t.to_json() for t in self.turns],
        }


def runs_of(saved: dict) -> list[PolicyRun]:
    """The runs of a saved ``replicas.json``, as they were measured (to print its table again)."""
    runs = []
    for run in saved["runs"]:
        turns = [Turn.from_json(t) for t in run["turns"]]
        counts = run["per_replica"]
        figures = (counts["prompt_tokens"], counts["prefix_cache_hits"], counts["requests"])
        tier = run.get("tier", NO_TIER)  # a run saved before the tiers had none
        zeros = [0.0] * len(counts["requests"])
        tier_figures = {
            "tier_hits": counts.get("external_prefix_cache_hits", zeros),
            "tier_failures": counts.get("kv_offload_failures", zeros),
        }
        runs.append(
            PolicyRun(
                run["policy"],
                turns,
                *figures,
                router=run["router_metrics"],
                tier=tier,
                **tier_figures,
            )
        )
    return runs


FIGURES = (  # a replica's /metrics counters, in PolicyRun's order
    "vllm:prompt_tokens",
    "vllm:prefix_cache_hits",  # the pool's own
    "vllm:request_success",
    "vllm:external_prefix_cache_hits",  # loaded from the second tier
    "vllm:kv_offload_failures",
)


def figures(replica: Replica) -> list[float]:
    text = replica.metrics()
    return [counter(text, name) for name in FIGURES]


@dataclass
class Fleet:
    """What a run needs: the checkpoint, the step, the flags every replica gets, where the logs
    go, and a scratch folder for the tiers' files."""

    step: str
    checkpoint: Path
    flags: list[str]
    logs: Path
    scratch: Path
    size_gib: float | None

    def tier_flags(self, tier: str, redis: RedisServer | None, count: int) -> list[list[str]]:
        """Each replica's own flags for ``tier``: a host tier each, a fresh folder each, or the
        one Redis server."""
        size = [] if self.size_gib is None else ["--kv-offloading-size", str(self.size_gib)]
        if tier == NO_TIER:
            return [[] for _ in range(count)]
        if tier == "redis":
            assert redis is not None
            return [["--kv-offloading-backend", redis.url] for _ in range(count)]
        if tier == "disk":
            folder = Path(tempfile.mkdtemp(prefix="disk-tier-", dir=self.scratch))
            return [
                ["--kv-offloading-backend", f"disk:{folder / f'replica-{i}'}", *size]
                for i in range(count)
            ]
        return [["--kv-offloading-backend", tier, *size] for _ in range(count)]

    def redis(self, tier: str) -> RedisServer | None:
        """A fresh, empty ``redis-server`` for a run on the Redis tier (None for the others)."""
        if tier != "redis":
            return None
        size = DEFAULT_SIZE_GIB if self.size_gib is None else self.size_gib
        folder = Path(tempfile.mkdtemp(prefix="redis-", dir=self.scratch))
        return RedisServer(folder, int(size * GIB), self.logs / "redis.log").started()


def run_policy(
    policy: str, tier: str, fleet: Fleet, count: int, chats: list[Chat], options: BenchOptions
) -> PolicyRun:
    """``count`` fresh replicas (cold pools) on a fresh ``tier``, a fresh router with
    ``policy``, every conversation through it."""
    tag = "" if tier == NO_TIER else f"-{tier}"
    redis = fleet.redis(tier)
    try:
        own = fleet.tier_flags(tier, redis, count)
        replicas = start_replicas(
            count, fleet.step, fleet.checkpoint, fleet.flags, fleet.logs, own, tag
        )
        try:
            log = fleet.logs / f"router-{policy}{tag}.log"
            router = Router(policy, replicas, options.block_size, SERVED_NAME, log)
            try:
                router.started()
                turns = asyncio.run(drive(router.url, SERVED_NAME, chats, options.new_tokens))
                decisions = router.own_metrics()
            finally:
                router.stop()
            counts = [list(column) for column in zip(*(figures(r) for r in replicas))]
        finally:
            for replica in replicas:
                replica.stop()
    finally:
        if redis is not None:
            redis.stop()
    prompt, hits, requests, tier_hits, failures = counts
    return PolicyRun(
        policy,
        turns,
        prompt,
        hits,
        requests,
        router=decisions,
        tier=tier,
        tier_hits=tier_hits,
        tier_failures=failures,
    )


# ---- the single engine: the answers and the ideal ----------------------------------------------


@dataclass(frozen=True)
class Reference:
    answers: dict[tuple[int, int], list[int]]  # (chat, turn) -> the answer
    prompt_tokens: int
    computed: int  # the ideal: every prefix computed once


def reference(step: str, cfg, chats: list[Chat], new_tokens: int) -> Reference:
    """The conversations served by one engine of ``step`` with a pool that never evicts, one
    request at a time: what every answer must be, and the least computing possible."""
    engine = load_step_model(step, cfg).engine(max_running=1)
    answers: dict[tuple[int, int], list[int]] = {}
    for chat in chats:
        said: list[list[int]] = []
        for turn in range(len(chat.messages)):
            prompt = prompts_of(chat, said)[turn]
            said.append(engine.generate([prompt], max_new_tokens=new_tokens)[0])
            answers[chat.index, turn] = said[-1]
    stats = engine.stats
    return Reference(answers, stats.prompt_tokens, stats.prompt_tokens - stats.cached_tokens)


def problems(runs: list[PolicyRun], expected: Reference, requests: int) -> list[str]:
    found = []
    for run in runs:
        name = label(run.policy, run.tier)
        failed = [t for t in run.turns if t.error is not None]
        if failed:
            found.append(f"{name}: {len(failed)} failed, e.g. {failed[0].error}")
        if len(run.turns) != requests:
            found.append(f"{name}: {len(run.turns)} of {requests} requests sent")
        answered = [t for t in run.turns if t.error is None]
        wrong = [t for t in answered if t.answer != expected.answers[t.chat, t.turn]]
        if wrong:
            found.append(f"{name}: {len(wrong)} answers differ from one engine's")
    return found


# ---- the report ------------------------------------------------------------------------------

TITLES = [
    "policy",
    "requests per replica (busiest first)",
    "prefix reuse",
    "computed prompt tokens",
]
TITLES += ["vs ideal", "TTFT p50 ms", "TTFT p99 ms", "tokens/s"]
TIER_TITLES = ["tier", "from the tier"]  # after the policy, after the reuse: with tiers only


def label(policy: str, tier: str) -> str:
    return policy if tier == NO_TIER else f"{policy}, {tier} tier"


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(
    runs: list[PolicyRun],
    policies: tuple[str, ...],
    ideal: int,
    tiers: tuple[str, ...] = (NO_TIER,),
) -> str:
    """A row per (tier, policy): the median over its runs; ``vs ideal`` with the runs' range.
    With a second tier, two more columns: the tier, and the prompt tokens loaded from it."""
    with_tiers = tiers != (NO_TIER,)
    rows = []
    for tier in tiers:
        for policy in policies:
            mine = [r for r in runs if (r.policy, r.tier) == (policy, tier)]
            ratios = [r.computed / ideal for r in mine]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(mine) > 1 else ""
            per_replica = zip(*(sorted(r.requests, reverse=True) for r in mine))  # busiest first
            row = [
                policy,
                " / ".join(f"{median(list(n)):.0f}" for n in per_replica),
                f"{median([r.reuse for r in mine]):.0%}",
                f"{median([r.computed for r in mine]):,.0f}",
                f"{median(ratios):.2f}x{spread}",
                f"{median([r.ttft(50) for r in mine]) * 1000:.0f}",
                f"{median([r.ttft(99) for r in mine]) * 1000:.0f}",
                f"{median([r.tokens_per_s for r in mine]):.1f}",
            ]
            if with_tiers:
                row.insert(1, tier)
                row.insert(4, f"{median([r.from_tier for r in mine]):.0%}")
            rows.append(row)
    titles = list(TITLES)
    if with_tiers:
        titles.insert(1, TIER_TITLES[0])
        titles.insert(4, TIER_TITLES[1])
    return markdown(titles, rows, left=2 if with_tiers else 1)


def save(options, cfg, workload, pool, runs, expected: Reference, ok: bool) -> str:
    data = {
        **saved_run_head(cfg, {"kind": NAME, **asdict(workload)}, options),
        "replicas": options.replicas,
        "users_per_tenant": USERS_PER_TENANT,
        "pool_blocks": {"tenants_prefixes_half": pool[0], "running_room": pool[1]},
        "tiers": list(tiers_of(options)),
        "tier_size_gib": options.kv_offloading_size,
        "ideal": {"prompt_tokens": expected.prompt_tokens, "computed": expected.computed},
        "answers_equal_one_engine": ok,
        "runs": [run.to_json() for run in runs],
    }
    return write_json(options.out, "replicas.json", data)


def chart(
    path: Path,
    runs: list[PolicyRun],
    policies: tuple[str, ...],
    ideal: int,
    tiers: tuple[str, ...] = (NO_TIER,),
) -> None:
    plt = charts.pyplot(path.name)
    if plt is None:
        return
    variants = [(p, t) for t in tiers for p in policies]
    names = [label(p, t) for p, t in variants]
    fig, (work_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    ratios = [[r.computed / ideal for r in runs if (r.policy, r.tier) == v] for v in variants]
    mids = [median(x) for x in ratios]
    below = [m - min(x) for m, x in zip(mids, ratios)]
    above = [max(x) - m for m, x in zip(mids, ratios)]
    bars = work_ax.bar(names, mids, yerr=[below, above], capsize=4, color="#4c72b0")
    work_ax.bar_label(bars, labels=[f"{m:.2f}x" for m in mids], padding=3)
    work_ax.axhline(1.0, color="grey", linewidth=0.8)
    work_ax.set_ylabel("prompt tokens computed / ideal (lower is better)")
    work_ax.set_title("What the fleet computed")
    for p_, color in ((50, "#55a868"), (99, "#dd8452")):
        values = [
            median([r.ttft(p_) * 1000 for r in runs if (r.policy, r.tier) == v]) for v in variants
        ]
        ttft_ax.plot(names, values, marker="o", color=color, label=f"p{p_}")
    if len(names) > 3:
        for ax in (work_ax, ttft_ax):
            ax.tick_params(axis="x", labelrotation=20)
    ttft_ax.set_ylabel("time to first token, ms")
    ttft_ax.set_ylim(bottom=0)
    ttft_ax.legend()
    ttft_ax.set_title("What a user waits for")
    charts.save(plt, fig, path)


# ---- the whole run ---------------------------------------------------------------------------


def write_checkpoint(folder: Path, model: str) -> Path:
    """The preset as a checkpoint the servers load (its seeded weights, a word-level tokenizer):
    ``python -m front.toy_checkpoint``'s."""
    toy_checkpoint.save(folder, model)
    return folder


def run(options: BenchOptions, progress: Progress) -> int:
    workload, step, tiers = workload_of(options), options.steps[-1], tiers_of(options)
    router_path()  # installed, or one line now
    if "redis" in tiers:
        redis_server_path()
    bs = options.block_size
    pool = pool_blocks(workload, bs, options.max_running)
    total = options.total_blocks or sum(pool)
    longest = math.ceil(workload.longest / bs) * bs
    cfg = preset(options.model, block_size=bs, dtype=options.dtype, device=options.device)
    chats = workload.chats(cfg.vocab_size)
    shown_tiers = "" if tiers == (NO_TIER,) else f"; second tiers {', '.join(tiers)}"
    print(
        f"replicas: {workload.describe()}\n{options.replicas} replicas of {step}.serve, "
        f"model {options.model} ({plural(cfg.num_layers, 'layer')}, d_model {cfg.d_model}), "
        f"{options.dtype}, one thread each, max_running {options.max_running}; each pool "
        f"{total} blocks of {bs} = {pool[0]} (half of the tenants' system prompts) + {pool[1]} "
        f"(room for {options.max_running} conversations' own blocks){shown_tiers}; vllm-router, "
        f"policies {', '.join(options.policies)}; {options.repeats} pass(es), each from fresh "
        "replicas (cold caches)"
    )
    flags = ["--served-model-name", SERVED_NAME, "--total-blocks", str(total)]
    flags += ["--max-model-len", str(longest), "--max-running", str(options.max_running)]
    flags += ["--block-size", str(bs), "--dtype", options.dtype, "--device", options.device]
    flags += ["--threads", "1"]
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[PolicyRun] = []
    with tempfile.TemporaryDirectory() as folder:
        with progress.task(f"writing the {options.model} checkpoint"):
            checkpoint = write_checkpoint(Path(folder) / options.model, options.model)
        fleet = Fleet(step, checkpoint, flags, out, Path(folder), options.kv_offloading_size)
        for repeat in range(options.repeats):
            for tier in tiers:
                for policy in options.policies:
                    with progress.task(f"{label(policy, tier)}: pass {repeat + 1}"):
                        runs.append(
                            run_policy(policy, tier, fleet, options.replicas, chats, options)
                        )
    with progress.task(f"one {step} engine, the same conversations (the answers, the ideal)"):
        big = cfg.replace(total_blocks=workload.requests * (longest // bs + 1))
        expected = reference(step, big, chats, options.new_tokens)
    print(table(runs, options.policies, expected.computed, tiers))
    print(
        f"ideal: {expected.computed:,} of {expected.prompt_tokens:,} prompt tokens computed (one "
        f"{step} engine, a pool that never evicts). Each row: the median of its runs; vs ideal: "
        "the fleet's computed prompt tokens (every replica's /metrics: prompt tokens - prefix "
        "cache hits"
        + (" - tokens loaded from the second tier" if tiers != (NO_TIER,) else "")
        + ") over the ideal, the runs' range in brackets; TTFT from the client."
    )
    failures = sum(sum(r.tier_failures) for r in runs)
    if failures:
        print(f"  the second tiers failed {failures:.0f} times (vllm:kv_offload_failures)")
    found = problems(runs, expected, workload.requests)
    print("\n".join(found) or f"  every answer equals one {step} engine's (greedy)")
    chart(out / "replicas.png", runs, options.policies, expected.computed, tiers)
    print(f"results: {save(options, cfg, workload, pool, runs, expected, not found)}")
    print(f"router logs: {out}/router-<policy>.log (its decisions, --log-level debug)")
    return 1 if found else 0
