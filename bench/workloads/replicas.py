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

Every answer is checked against the same step's engine serving the same conversations alone
(greedy, token for token); that engine, with a pool that never evicts, also gives the ideal.
The policies run in passes (each once per pass, --repeats passes), every run from cold caches
(``/reset_prefix_cache`` on every replica) and a fresh router.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config import PRESETS, preset
from front import toy_checkpoint
from front.cli import plural

from .. import charts
from ..cells import markdown
from ..conversations import USERS_PER_TENANT, Chat, TenantWorkload, Turn, drive, prompts_of
from ..fleet import POLICIES, Replica, Router, counter, router_path, start_replicas
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
    block_size=16,
    total_blocks=None,
    model="demo",
)
NOT_READ = "makes its own conversations"
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
    )


def check(options: BenchOptions) -> None:
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

    @property
    def computed(self) -> float:
        return sum(self.prompt_tokens) - sum(self.cache_hits)

    @property
    def reuse(self) -> float:
        return sum(self.cache_hits) / max(sum(self.prompt_tokens), 1)

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
            "per_replica": {
                "prompt_tokens": self.prompt_tokens,
                "prefix_cache_hits": self.cache_hits,
                "requests": self.requests,
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
        runs.append(PolicyRun(run["policy"], turns, *figures, router=run["router_metrics"]))
    return runs


def figures(replica: Replica) -> tuple[float, float, float]:
    text = replica.metrics()
    requests = counter(text, "vllm:request_success")
    return counter(text, "vllm:prompt_tokens"), counter(text, "vllm:prefix_cache_hits"), requests


def run_policy(
    policy: str, replicas: list[Replica], chats: list[Chat], options: BenchOptions, logs: Path
) -> PolicyRun:
    """Cold caches, a fresh router with ``policy``, every conversation through it."""
    for replica in replicas:
        replica.reset_prefix_cache()
    before = [figures(r) for r in replicas]
    log = logs / f"router-{policy}.log"
    router = Router(policy, replicas, options.block_size, SERVED_NAME, log)
    try:
        router.started()
        turns = asyncio.run(drive(router.url, SERVED_NAME, chats, options.new_tokens))
        own = router.own_metrics()
    finally:
        router.stop()
    after = [figures(r) for r in replicas]
    gained = [[a - b for a, b in zip(x, y)] for x, y in zip(after, before)]
    return PolicyRun(policy, turns, *(list(column) for column in zip(*gained)), router=own)


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
        failed = [t for t in run.turns if t.error is not None]
        if failed:
            found.append(f"{run.policy}: {len(failed)} failed, e.g. {failed[0].error}")
        if len(run.turns) != requests:
            found.append(f"{run.policy}: {len(run.turns)} of {requests} requests sent")
        answered = [t for t in run.turns if t.error is None]
        wrong = [t for t in answered if t.answer != expected.answers[t.chat, t.turn]]
        if wrong:
            found.append(f"{run.policy}: {len(wrong)} answers differ from one engine's")
    return found


# ---- the report ------------------------------------------------------------------------------

TITLES = [
    "policy",
    "requests per replica (busiest first)",
    "prefix reuse",
    "computed prompt tokens",
]
TITLES += ["vs ideal", "TTFT p50 ms", "TTFT p99 ms", "tokens/s"]


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(runs: list[PolicyRun], policies: tuple[str, ...], ideal: int) -> str:
    """A row per policy: the median over its runs; ``vs ideal`` with the runs' range."""
    rows = []
    for policy in policies:
        mine = [r for r in runs if r.policy == policy]
        ratios = [r.computed / ideal for r in mine]
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(mine) > 1 else ""
        per_replica = zip(*(sorted(r.requests, reverse=True) for r in mine))  # busiest first
        rows.append(
            [
                policy,
                " / ".join(f"{median(list(n)):.0f}" for n in per_replica),
                f"{median([r.reuse for r in mine]):.0%}",
                f"{median([r.computed for r in mine]):,.0f}",
                f"{median(ratios):.2f}x{spread}",
                f"{median([r.ttft(50) for r in mine]) * 1000:.0f}",
                f"{median([r.ttft(99) for r in mine]) * 1000:.0f}",
                f"{median([r.tokens_per_s for r in mine]):.1f}",
            ]
        )
    return markdown(TITLES, rows)


def save(options, cfg, workload, pool, runs, expected: Reference, ok: bool) -> str:
    data = {
        **saved_run_head(cfg, {"kind": NAME, **asdict(workload)}, options),
        "replicas": options.replicas,
        "users_per_tenant": USERS_PER_TENANT,
        "pool_blocks": {"tenants_prefixes_half": pool[0], "running_room": pool[1]},
        "ideal": {"prompt_tokens": expected.prompt_tokens, "computed": expected.computed},
        "answers_equal_one_engine": ok,
        "runs": [run.to_json() for run in runs],
    }
    return write_json(options.out, "replicas.json", data)


def chart(path: Path, runs: list[PolicyRun], policies: tuple[str, ...], ideal: int) -> None:
    plt = charts.pyplot(path.name)
    if plt is None:
        return
    fig, (work_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    ratios = [[r.computed / ideal for r in runs if r.policy == p] for p in policies]
    mids = [median(x) for x in ratios]
    below = [m - min(x) for m, x in zip(mids, ratios)]
    above = [max(x) - m for m, x in zip(mids, ratios)]
    bars = work_ax.bar(policies, mids, yerr=[below, above], capsize=4, color="#4c72b0")
    work_ax.bar_label(bars, labels=[f"{m:.2f}x" for m in mids], padding=3)
    work_ax.axhline(1.0, color="grey", linewidth=0.8)
    work_ax.set_ylabel("prompt tokens computed / ideal (lower is better)")
    work_ax.set_title("What the fleet computed")
    for p_, color in ((50, "#55a868"), (99, "#dd8452")):
        values = [median([r.ttft(p_) * 1000 for r in runs if r.policy == p]) for p in policies]
        ttft_ax.plot(policies, values, marker="o", color=color, label=f"p{p_}")
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
    workload, step = workload_of(options), options.steps[-1]
    router_path()  # installed, or one line now
    bs = options.block_size
    pool = pool_blocks(workload, bs, options.max_running)
    total = options.total_blocks or sum(pool)
    longest = math.ceil(workload.longest / bs) * bs
    cfg = preset(options.model, block_size=bs, dtype=options.dtype, device=options.device)
    chats = workload.chats(cfg.vocab_size)
    print(
        f"replicas: {workload.describe()}\n{options.replicas} replicas of {step}.serve, "
        f"model {options.model} ({plural(cfg.num_layers, 'layer')}, d_model {cfg.d_model}), "
        f"{options.dtype}, one thread each, max_running {options.max_running}; each pool "
        f"{total} blocks of {bs} = {pool[0]} (half of the tenants' system prompts) + {pool[1]} "
        f"(room for {options.max_running} conversations' own blocks); vllm-router, policies "
        f"{', '.join(options.policies)}; {options.repeats} pass(es), each from cold caches"
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
        with progress.task(f"starting {options.replicas} replicas"):
            replicas = start_replicas(options.replicas, step, checkpoint, flags, out)
        try:
            for repeat in range(options.repeats):
                for policy in options.policies:
                    with progress.task(f"{policy}: pass {repeat + 1}"):
                        runs.append(run_policy(policy, replicas, chats, options, out))
        finally:
            for replica in replicas:
                replica.stop()
    with progress.task(f"one {step} engine, the same conversations (the answers, the ideal)"):
        big = cfg.replace(total_blocks=workload.requests * (longest // bs + 1))
        expected = reference(step, big, chats, options.new_tokens)
    print(table(runs, options.policies, expected.computed))
    print(
        f"ideal: {expected.computed:,} of {expected.prompt_tokens:,} prompt tokens computed (one "
        f"{step} engine, a pool that never evicts). Each row: the median of its runs; vs ideal: "
        "the fleet's computed prompt tokens (every replica's /metrics: prompt tokens - prefix "
        "cache hits) over the ideal, the runs' range in brackets; TTFT from the client."
    )
    found = problems(runs, expected, workload.requests)
    print("\n".join(found) or f"  every answer equals one {step} engine's (greedy)")
    chart(out / "replicas.png", runs, options.policies, expected.computed)
    print(f"results: {save(options, cfg, workload, pool, runs, expected, not found)}")
    print(f"router logs: {out}/router-<policy>.log (its decisions, --log-level debug)")
    return 1 if found else 0
