"""--workload restart: a step's server restarted on its disk tier (step14_10 on). Per run: the
server (the last of --steps, one torch thread) starts on a fresh, empty disk tier
(--kv-offloading-backend disk:DIR), answers one prompt (--prefix-len tokens, then --tail-len of
its own), stops (SIGINT, as Ctrl-C), starts again on the same folder and answers the same
prompt. Per run: the blocks the folder held after the stop, and the prompt tokens each answer
got from a cache (the usage's cached_tokens) and from the tier (the server's
vllm:external_prefix_cache_hits), with the time to first token of each. Results: restart.json.

A restart empties the KV pool: without a second tier every prefix is computed again. A disk
tier outlives the process, so the first request after the restart loads the prefix instead.
Both answers must be equal (greedy).
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from common.config import PRESETS, preset
from common.numbers import cdiv
from front.steps import not_taken_by

from ..cells import markdown
from ..conversations import Chat, TenantWorkload, drive
from ..fleet import Server, counter
from ..options import BenchOptions
from ..progress import Progress
from ..saved import saved_run_head, write_json
from .replicas import SERVED_NAME, write_checkpoint

NAME = "restart"
SUMMARY = "a step's server restarted on a disk tier: what the first request after it loads"
DEFAULTS = dict(
    prefix_len=256, tail_len=16, new_tokens=16, block_size=16, total_blocks=None, model="demo"
)
NOT_READ = "sends one prompt, before and after a restart"
OWN_TIERS = True  # --kv-offloading-backend: read here, not as one engine's tier
HELP = __doc__.split("\n\n")[0]


def check(options: BenchOptions) -> None:
    if options.model not in PRESETS:
        raise ValueError(
            "--workload restart takes a preset (--model demo): it writes that preset as a "
            "checkpoint with a word-level tokenizer, so that text and tokens map one to one"
        )
    if options.kv_offloading_backend is not None:
        raise ValueError(
            "--kv-offloading-backend: --workload restart gives the server a fresh disk tier "
            "of its own for each run (--kv-offloading-size still bounds it)"
        )
    if options.prefix_len + options.tail_len == 0:
        raise ValueError("a prompt needs at least one token: --prefix-len or --tail-len")
    step = options.steps[-1]
    why = not_taken_by(step, replace(options.engine_options(), kv_offloading_backend="disk:x"))
    if why is not None:
        raise ValueError(f"--workload restart runs the last of --steps on a disk tier: {why}")


@dataclass
class Request:
    """One request as the client and the server's /metrics saw it."""

    ttft_s: float
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: the pool's and the tier's
    tier_hits: float  # vllm:external_prefix_cache_hits: prompt tokens loaded from the tier
    answer: list[int]


@dataclass
class RestartRun:
    prompt_tokens: int
    before: Request  # the first server, its tier empty
    entries: int  # files in the tier's folder once the first server stopped
    after: Request  # the restarted server, its pool empty, its tier the folder

    @property
    def answers_equal(self) -> bool:
        return self.before.answer == self.after.answer


def ask(server: Server, chat: Chat, new_tokens: int) -> Request:
    """The chat's one turn, streamed; what the server says it cached."""
    (turn,) = asyncio.run(drive(server.url, SERVED_NAME, [chat], new_tokens))
    if turn.error is not None:
        raise RuntimeError(f"the request failed: {turn.error}")
    details = turn.usage.get("prompt_tokens_details") or {}
    tier = counter(server.metrics(), "vllm:external_prefix_cache_hits")
    return Request(turn.ttft, details.get("cached_tokens") or 0, tier, turn.answer)


def one_run(
    step: str, checkpoint: Path, flags: list[str], chat: Chat, options: BenchOptions, tier: Path
) -> RestartRun:
    """A server on an empty disk tier in ``tier``, the prompt, a stop (SIGINT), a restart on the
    same folder, the same prompt."""
    flags = [*flags, "--kv-offloading-backend", f"disk:{tier}"]
    requests, files = [], []
    for when in ("before", "after"):
        server = Server(step, checkpoint, flags, Path(options.out) / f"restart-server-{when}.log")
        try:
            requests.append(ask(server.started(), chat, options.new_tokens))
        finally:
            server.stop(signal.SIGINT)
        files.append(len(list(tier.glob("*.kv"))))
    prompt = len(chat.system) + len(chat.messages[0])
    return RestartRun(prompt, requests[0], files[0], requests[1])


def runs_of(saved: dict) -> list[RestartRun]:
    """The runs of a saved ``restart.json`` (to print its table again)."""
    return [
        RestartRun(
            run["prompt_tokens"], Request(**run["before"]), run["entries"], Request(**run["after"])
        )
        for run in saved["runs"]
    ]


TITLES = ["run", "prompt tokens", "blocks on disk after the stop", "cached before"]
TITLES += ["cached after the restart", "from the tier", "TTFT before ms", "TTFT after ms"]


def table(runs: list[RestartRun]) -> str:
    rows = [
        [
            str(i + 1),
            str(r.prompt_tokens),
            str(r.entries),
            str(r.before.cached_tokens),
            str(r.after.cached_tokens),
            f"{r.after.tier_hits:.0f}",
            f"{r.before.ttft_s * 1000:.1f}",
            f"{r.after.ttft_s * 1000:.1f}",
        ]
        for i, r in enumerate(runs)
    ]
    return markdown(TITLES, rows)


def run(options: BenchOptions, progress: Progress) -> int:
    step, bs = options.steps[-1], options.block_size
    longest = cdiv(options.prefix_len + options.tail_len + options.new_tokens, bs) * bs
    total = options.total_blocks or longest // bs  # room for the request
    cfg = preset(options.model, block_size=bs, dtype=options.dtype, device=options.device)
    cfg = cfg.replace(total_blocks=total, max_model_len=longest)  # the server's, as saved
    workload = TenantWorkload(1, 1, options.prefix_len, options.tail_len, options.new_tokens)
    first = workload.chats(cfg.vocab_size)[0]  # its system prompt and first message
    chat = Chat(0, 0, 0.0, first.system, first.messages[:1])
    flags = ["--served-model-name", SERVED_NAME, "--max-model-len", str(longest)]
    flags += ["--block-size", str(bs), "--dtype", options.dtype, "--device", options.device]
    flags += ["--threads", "1"]
    flags += ["--total-blocks", str(total)]
    if options.kv_offloading_size is not None:
        flags += ["--kv-offloading-size", str(options.kv_offloading_size)]
    print(
        f"restart: one prompt of {options.prefix_len} + {options.tail_len} tokens, "
        f"{options.new_tokens} new tokens, to {step}.serve (model {options.model}, "
        f"{options.dtype}, blocks of {bs}, one thread) on a fresh disk tier; the server "
        f"stopped (SIGINT) and started again on the same folder, the same prompt again; "
        f"{options.repeats} run(s)"
    )
    Path(options.out).mkdir(parents=True, exist_ok=True)
    runs: list[RestartRun] = []
    with tempfile.TemporaryDirectory() as folder:
        with progress.task(f"writing the {options.model} checkpoint"):
            checkpoint = write_checkpoint(Path(folder) / options.model, options.model)
        for k in range(options.repeats):
            with progress.task(f"run {k + 1}: start, ask, stop, start, ask"):
                tier = Path(folder) / f"tier-{k}"
                runs.append(one_run(step, checkpoint, flags, chat, options, tier))
    print(table(runs))
    prefix = options.prefix_len
    shares = [min(r.after.tier_hits, prefix) / prefix if prefix else 1.0 for r in runs]
    print(
        f"the repeated prefix ({prefix} tokens) loaded from the tier after the restart: "
        f"{statistics.median(shares):.0%} (median; {min(shares):.0%}-{max(shares):.0%}). A "
        "prompt whose every block is cached computes its last block again: its last token's "
        "logits give the first new token."
    )
    wrong = [i + 1 for i, r in enumerate(runs) if not r.answers_equal]
    print(
        f"  runs {wrong}: the answer after the restart differs"
        if wrong
        else "  every answer after the restart equals the one before (greedy)"
    )
    data = {
        **saved_run_head(cfg, {"kind": NAME, **asdict(workload)}, options),
        "step": step,
        "runs": [asdict(r) | {"answers_equal": r.answers_equal} for r in runs],
    }
    print(f"results: {write_json(options.out, 'restart.json', data)}")
    return 1 if wrong else 0
