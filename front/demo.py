"""The chapter's demo, for any step: ``python -m <step>.run`` without ``--model``. It lives
here, not in the steps, because it is the same for all of them: only the step's classes
differ. ``DESCRIPTION`` (its ``--help``) says what it does; the trace it prints and draws is
``trace.py``'s and ``trace_plot.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from common.config import PRESETS, ModelConfig
from common.device import synchronize
from common.errors import RequestError
from common.inputs import blocks_for_request, check_fits_pool
from common.memory import check_memory
from common.reference import ReferenceModel, reference_generate
from common.stats import EngineStats

from .build import ModelSource, set_threads
from .cli import (
    HelpFormatter,
    TraceOptions,
    add_engine_flags,
    add_trace_flags,
    plural,
    positive_int,
    trace_options,
)
from .options import EngineOptions
from .steps import load_step, step_engine_args
from .trace import RoundTrace, RoundTracer
from .trace_plot import show_trace
from .workload import demo_prompts

DESCRIPTION = """\
The demo of the chapter "Paged Prefix Cache": paged KV blocks with a block-granular prefix
cache, chunked prefill and continuous batching in one engine.

Ten requests share a 3-block prefix. Served one at a time, the first misses and caches the
prefix and the other nine hit it (cold round, 9/10); served again, all ten hit (hot round,
10/10); a round with the prefix cache off shows what the cache saves. Then the batched engine
serves them together, in a roomy pool and in a small one. Every round must produce the same
tokens as the dense reference model.

--trace prints a round block by block: each request's work (the cached blocks it adopted, the
chunk or token it computed, the blocks it allocated, cached and freed, a preemption) and the
pool after the round, with the ref_count of every block that moved. --trace-png FILE draws the
same round as a picture, blocks x rounds.

With --model DIR (a local Hugging Face Llama checkpoint) the same command serves real text
instead: --model DIR --help lists its flags. --model DIR --chat is a conversation with it.
"""

TRACE_ROUNDS = {
    "batched": "the batched round, cold cache",
    "small-pool": "the batched round in a small pool",
}

Generate = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True)
class DemoOptions:
    """The demo's flags, read once: the engine's, the answers' length, what to trace."""

    engine: EngineOptions
    max_new_tokens: int = 16
    trace: TraceOptions = field(default_factory=TraceOptions)
    trace_round: str = "batched"  # a key of TRACE_ROUNDS

    def config(self) -> ModelConfig:
        """The demo model: the "demo" preset, on the engine options' device, dtype and pool."""
        return ModelSource.open("demo", self.engine).cfg


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The demo's flags: the engine's, ``--max-new-tokens`` and the trace's."""
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_engine_flags(parser, max_running=4)
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="tokens generated per request",
    )
    add_trace_flags(parser)
    parser.add_argument(
        "--trace-round",
        choices=list(TRACE_ROUNDS),
        default=None,
        help="the round that --trace and --trace-png show: batched (a roomy pool: the "
        "leapfrog through the shared prefix) or small-pool (too small for every request at once: "
        "they are preempted and evict, or from step14_9 on, wait their turn)",
    )
    return parser


def read_options(parser: argparse.ArgumentParser, argv: list[str]) -> DemoOptions:
    """The flags, checked and read before any model is built (the pool against the longest
    request too)."""
    args = parser.parse_args(argv)
    trace = trace_options(parser, args)
    if args.trace_round is not None and not trace.wanted:
        parser.error("--trace-round chooses what --trace or --trace-png shows: give one of them")
    if args.dtype == "auto":
        parser.error(
            "--dtype auto needs --model DIR: it means the dtype the checkpoint is stored in"
        )
    options = DemoOptions(
        EngineOptions.from_args(args), args.max_new_tokens, trace, args.trace_round or "batched"
    )
    try:
        check_fits_pool(
            longest_prompt(options.engine.block_size), options.max_new_tokens, options.config()
        )
    except RequestError as exc:
        parser.error(f"the longest demo request does not fit: {exc}")
    return options


def longest_prompt(block_size: int) -> int:
    return max(len(p) for p in demo_prompts(PRESETS["demo"].vocab_size, block_size))


def blocks_for_longest_request(block_size: int, max_new_tokens: int) -> int:
    """The smallest pool that can serve the demo: a request holds its blocks for its whole life
    (every token whose KV is written; the last generated token never is)."""
    return blocks_for_request(longest_prompt(block_size), max_new_tokens, block_size)


def mark(ok: bool) -> str:
    return "✅" if ok else "❌"


# Token-for-token equality is a promise in these dtypes (the weights are drawn so that top-1 and
# top-2 logits are far apart compared with float32 rounding).
EXACT_DTYPES = (torch.float32, torch.float64)
WARNING = "⚠️"

REDUCED_PRECISION_NOTE = """\
In {dtype}, the same sums done in another order (a whole prompt or block by block, one sequence
or a batch) round differently and can flip a near-tie between two tokens, after which the outputs
diverge: the token checks marked ⚠️ count matches instead of requiring them. Exact parity is what
float32 and float64 check."""


def token_check(
    text: str, got: list[list[int]], want: list[list[int]], exact: bool
) -> tuple[bool, str]:
    """``(passed, line)``: ``got`` must equal ``want`` request by request; in a reduced precision
    (``exact=False``) a mismatch is reported as a count and does not fail the demo."""
    same = sum(a == b for a, b in zip(got, want, strict=True))
    ok = same == len(want)
    if ok or exact:
        return ok, f"{text} {mark(ok)}"
    return True, f"{text}: {same}/{len(want)} requests {WARNING}"


@dataclass
class Round:
    """One round of the demo: its outputs, the engine's figures, the pool's problems at rest."""

    outputs: list[list[int]]
    stats: EngineStats
    problems: list[str] = field(default_factory=list)


def timed_round(label: str, engine: Any, run: Generate, prompts: list[list[int]], n: int) -> Round:
    """Serve ``prompts`` once through ``run`` (a method of ``engine``) and print one line."""
    engine.reset_stats()
    start = time.perf_counter()
    outputs = run(prompts, n)
    synchronize(engine.model.cfg.device)  # a GPU's work is asynchronous: wait for it first
    ms = (time.perf_counter() - start) * 1000
    s = engine.stats
    hits = f"{s.hit_rate:.0%} ({s.requests_hit}/{s.requests})"
    tokens = f"{s.token_hit_rate:.0%} ({s.cached_tokens}/{s.prompt_tokens})"
    print(
        f"{label:<30} {ms:8.1f} ms   hit rate {hits:<13} tokens {tokens:<14} computed "
        f"{s.computed_prefill_tokens} prefill + {s.computed_decode_tokens} decode tokens"
    )
    return Round(outputs, s)


def what_the_numbers_mean(cold: EngineStats, hot: EngineStats, off: EngineStats) -> str:
    """Why a hot round is barely faster than a cold one here: the cache saves prefill only, and
    in this small demo most model calls are decode steps, the same in every round."""
    text = (
        f"What the numbers mean: the prefix cache saves prefill only. The model computed "
        f"{off.computed_prefill_tokens} prompt tokens with the cache off, "
        f"{cold.computed_prefill_tokens} cold and {hot.computed_prefill_tokens} hot."
    )
    if off.computed_decode_tokens:
        text += (
            f" Decode is the same {off.computed_decode_tokens} tokens in every round, one model "
            f"call per token (prefill computes a block or more per call), so it bounds how much "
            f"faster a hot round can be; the saving grows with the shared prefix "
            f"(python -m bench)."
        )
    return textwrap.fill(text, width=100)


def what_preemption_cost(roomy: EngineStats, small: EngineStats) -> str:
    """What the small pool's preemptions cost in model work, against the same batched round
    with room to spare: recompute is cheap when the cache gives the full blocks back."""
    extra = small.computed_tokens - roomy.computed_tokens
    if not small.preemptions:
        return (
            "\nIn the small pool no request had to be preempted: new requests waited until their "
            "first chunk fit."
        )
    text = (
        f"In the small pool, {plural(small.preemptions, 'preemption')} cost "
        f"{plural(extra, 'more computed token')} than with room to spare "
        f"({small.computed_tokens} vs {roomy.computed_tokens}): a preempted request gives its "
        f"blocks back but its full blocks stay cached, and {small.resumed_cached_tokens} tokens "
        f"came back from the cache when the preempted requests resumed."
    )
    return "\n" + textwrap.fill(text, width=100)


def engine_class(step: ModuleType, options: DemoOptions) -> Callable[..., Any]:
    """The step's engine, with the engine flags that only later steps take (step14_9's
    ``--max-num-batched-tokens``) when given."""
    return functools.partial(
        step.PagedPrefixCacheEngine, **step_engine_args(step.__name__, options.engine)
    )


def warm_up(step: ModuleType, model: torch.nn.Module, prompt: list[int]) -> None:
    """One short request through a throwaway engine, so that one-time costs (first kernel
    calls, allocator growth) are not charged to whichever round happens to run first."""
    step.PagedPrefixCacheEngine(model, enable_prefix_cache=False).generate([prompt], 2)


def run(step_name: str, options: DemoOptions) -> int:
    """The demo: its rounds, its checks (the exit status), and the trace when asked."""
    set_threads(options.engine.threads)
    step, cfg = load_step(step_name), options.config()
    check_memory(cfg)  # before the banner: a pool the machine cannot hold is the only line
    prompts = demo_prompts(cfg.vocab_size, cfg.block_size)
    print(banner(step_name, cfg, len(prompts), options.max_new_tokens))
    rounds = run_rounds(step, cfg, prompts, options)
    print()
    print(what_the_numbers_mean(rounds.cold.stats, rounds.hot.stats, rounds.off.stats))
    print(what_preemption_cost(rounds.batched.stats, rounds.small_pool.stats))
    status = print_checks(cfg, rounds)
    if options.trace.wanted:
        what = TRACE_ROUNDS[options.trace_round]
        title = f"{step_name}: {what}, max_running={options.engine.max_running}"
        show_trace(options.trace, what, traced_round(step, cfg, options), title)
    return status


def banner(step_name: str, cfg: ModelConfig, num_prompts: int, n_new: int) -> str:
    threads = torch.get_num_threads()
    return (
        f"{step_name}: {num_prompts} requests sharing a {3 * cfg.block_size}-token prefix, "
        f"{plural(n_new, 'new token')} each ({cfg.device}, {cfg.dtype_name}, "
        f"block_size={cfg.block_size}, {cfg.total_blocks} blocks; torch {torch.__version__}, "
        f"{plural(threads, 'thread')})\n"
    )


@dataclass
class DemoRounds:
    """The demo's rounds, in the order they run; ``hot.problems`` is the check at rest."""

    cold: Round
    hot: Round
    off: Round
    batched: Round
    small_pool: Round
    reference: list[list[int]]  # the dense reference model's tokens


def run_rounds(
    step: ModuleType, cfg: ModelConfig, prompts: list[list[int]], options: DemoOptions
) -> DemoRounds:
    """The chapter's rounds, each printed as it ends, then the dense reference's tokens."""
    n_new, engine_cls = options.max_new_tokens, engine_class(step, options)
    max_running = options.engine.max_running
    with torch.inference_mode():
        model = step.TinyTransformerPaged(cfg)
        warm_up(step, model, prompts[0][-cfg.block_size :])
        engine = engine_cls(model, max_running=max_running)
        serial = engine.generate_serial
        cold = timed_round("Round 1 (cold cache), serial", engine, serial, prompts, n_new)
        hot = timed_round("Round 2 (hot cache), serial", engine, serial, prompts, n_new)
        hot.problems = engine.ref_count_problems()
        off_engine = engine_cls(model, max_running=max_running, enable_prefix_cache=False)
        off_run = off_engine.generate_serial
        off = timed_round("Round 3 (cache off), serial", off_engine, off_run, prompts, n_new)
        batched = engine_cls(model, max_running=max_running)
        label = f"Batched (max_running={max_running}), cold"
        batched_round = timed_round(label, batched, batched.generate, prompts, n_new)
        small_pool = small_pool_round(step, model, prompts, options)
        reference = reference_generate(ReferenceModel(cfg), prompts, n_new)
    return DemoRounds(cold, hot, off, batched_round, small_pool, reference)


def small_pool_blocks(block_size: int, max_new_tokens: int) -> int:
    """A pool that holds the longest demo request about one and a half times: the batched
    engine then runs out of blocks mid-round and must preempt."""
    need = blocks_for_longest_request(block_size, max_new_tokens)
    return (3 * need + 1) // 2


def small_pool_config(cfg: ModelConfig, max_new_tokens: int) -> ModelConfig:
    return cfg.replace(total_blocks=small_pool_blocks(cfg.block_size, max_new_tokens))


def small_pool_round(
    step: ModuleType, model: torch.nn.Module, prompts: list[list[int]], options: DemoOptions
) -> Round:
    """The batched round in a pool too small for the running set: preemption, recompute."""
    cfg = small_pool_config(model.cfg, options.max_new_tokens)
    small = step.TinyTransformerPaged(cfg)
    small.load_state_dict(model.state_dict())  # the same weights, a smaller KV pool
    engine = engine_class(step, options)(small, max_running=options.engine.max_running)
    label = f"Batched, {cfg.total_blocks}-block pool"
    small = timed_round(label, engine, engine.generate, prompts, options.max_new_tokens)
    s = small.stats
    print(
        f"{'':<30}   {plural(s.preemptions, 'preemption')}, "
        f"{s.resumed_cached_tokens} tokens back from the cache on resume, "
        f"{s.seqs_per_round:.1f} requests per round"
    )
    small.problems = engine.ref_count_problems()
    return small


def small_pool_check(small: Round, reference: list[list[int]], exact: bool) -> tuple[bool, str]:
    """Preemption loses nothing: the same tokens, and every block back at rest."""
    n = plural(small.stats.preemptions, "preemption")
    ok, line = token_check(
        f"Small pool: outputs identical to the reference ({n})", small.outputs, reference, exact
    )
    if small.problems:
        return False, f"{line}; ref counts broken: {small.problems[0]} {mark(False)}"
    return ok, line


def print_checks(cfg: ModelConfig, rounds: DemoRounds) -> int:
    """The demo's promises, one line each; returns the exit status (1 if any ❌)."""
    cold, hot, off = rounds.cold.outputs, rounds.hot.outputs, rounds.off.outputs
    problems, s = rounds.hot.problems, rounds.hot.stats
    exact = cfg.dtype in EXACT_DTYPES
    checks = [
        token_check(
            "Cold, hot and cache-off outputs identical (the cache only saves work)",
            hot + off,
            cold + cold,
            exact,
        ),
        (
            not problems,
            f"Every block's ref_count sane (free {s.blocks_free} + cached "
            f"{s.blocks_cached} = total {cfg.total_blocks}) {mark(not problems)}",
        ),
        token_check(
            "Batched outputs identical to the serial ones", rounds.batched.outputs, cold, exact
        ),
        token_check(
            "Outputs identical to the dense reference model", cold, rounds.reference, exact
        ),
        small_pool_check(rounds.small_pool, rounds.reference, exact),
    ]
    print()
    for _, line in checks:
        print(line)
    for line in problems[:10]:
        print("   ", line)
    if any(line.endswith(WARNING) for _, line in checks):
        print(REDUCED_PRECISION_NOTE.format(dtype=cfg.dtype_name))
    return 0 if all(ok for ok, _ in checks) else 1


# ---- --trace and --trace-png ------------------------------------------------------------------


def traced_round(step: ModuleType, cfg: ModelConfig, options: DemoOptions) -> list[RoundTrace]:
    """The round ``--trace-round`` names, once more, traced (so tracing costs the timed ones
    nothing)."""
    if options.trace_round == "small-pool":
        cfg = small_pool_config(cfg, options.max_new_tokens)
    prompts = demo_prompts(cfg.vocab_size, cfg.block_size)
    with torch.inference_mode():
        engine = engine_class(step, options)(
            step.TinyTransformerPaged(cfg), max_running=options.engine.max_running
        )
        tracer = RoundTracer(engine)
        engine.generate(prompts, options.max_new_tokens)
    return tracer.rounds
