"""``python -m bench``: every step on the same workload, side by side (``--help``: what it
does, every flag and its default)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from common.config import PRESETS, ModelConfig
from common.errors import report_user_errors
from common.front.cli import (
    HelpFormatter,
    add_dtype_flag,
    add_memory_check_flag,
    checkpoint_folder,
    device_name,
    dtype_value,
    non_negative_int,
    positive_int,
    writable_folder,
)
from common.front.steps import FIXES, available_steps
from common.front.workload import PRESSURE_EOS_AT
from common.memory import check_memory
from common.reference import ReferenceModel, reference_generate

from . import report
from .costs import matmul_gflops
from .harness import (
    PRESSURE,
    SCALE,
    SHARED_PREFIX,
    WORKLOADS,
    RunResult,
    StepRunner,
    Workload,
    bench_config,
    pressure_workload,
    with_eos,
)
from .hf import hf_runner
from .progress import Progress
from .rows import Row
from .scale import ScaleWorkload, run_scale_bench
from .serving import SERVING, ServingWorkload, run_serving_bench

PROG = "python -m bench"

ALL_STEPS = "all"

# torch CPU threads unless --threads says otherwise. Measured on a shared 2-core VM (README,
# Benchmarks): two threads were 1.5x faster on the batched rows while the machine was quiet, and
# up to 100x slower while another program was running; one thread stays steady.
DEFAULT_THREADS = 1

DESCRIPTION = f"""\
Every step on the same workload, side by side.

--workload shared-prefix (the default):
Serves the same shared-prefix requests through each step --repeats times, each time through a
fresh engine (a cold cache). By default all requests run at once (--max-running 0), as Hugging
Face runs them in one batch. Then the last step again, twice: after one earlier request has
put the shared prefix in the cache (warm prefix: only the later requests are timed), and with
the prefix cache off. Then Hugging Face's generate on the same weights, all prompts in one
batch. Every row must produce the same tokens as the dense reference model.

--workload pressure: memory, not speed. Two dozen short prompts whose answers stop at their
own eos within 13 tokens (picked from the dense reference's answers), asked with
--new-tokens 64, in a pool of 48 blocks of 4 tokens, up to 8 at a time. Only the step rows:
no warm prefix or no cache row (there is no shared prefix), and no Hugging Face row (one
batched generate cannot stop each request at its own eos). The requests/round and
preemptions columns show how many requests memory on demand runs at once, and a line under
the table how many worst-case reservation would (prompt + max new tokens reserved for each).

--workload scale: the engine's own cost, not the model's. Distinct short prompts on a
one-layer model (the toy preset): time per request as the requests grow (--sweep-requests)
and as the cache already holds more blocks (--sweep-cached, served --sweep-requests' first
count of requests). Every block operation is O(1), so every row stays flat; the last column
is the growth from the smallest size to the largest. Results go to --out: scale.json, and
scale.png when matplotlib is installed.

--workload serving: what a user waiting for an answer sees. Requests arrive over time (a
seeded Poisson process at --request-rate per second, vLLM's benchmark_serving shape), each a
shared prefix + tokens of its own; every step serves them with the prefix cache on and off,
and the last step once more one request at a time (max_running 1). The table gives each
cell's time to first token (TTFT) and time per output token (TPOT), p50 and p99 over the
requests, from the run with the least busy time. Results go to --out: serving.json.

The first row and the Hugging Face row get one untimed warm-up run (one-time setup). Each row
shows its fastest run (min s: the work is the same every run, so a slower run only
measures what else the machine was doing), flagged ! when its runs differ by more than
{report.SPREAD_FLAG}x; tokens/s; the prompt tokens the prefix cache saved; the tokens the
model computed; the peak KV memory it held; and the model FLOPs it did and their rate, next to
this machine's own matmul rate. Results go to the --out folder: results.json, and
speedups.png when matplotlib is installed.
"""


def model_name(text: str) -> str:
    """``--model``: a preset name (common/config.py), or a local checkpoint directory."""
    if text in PRESETS:
        return text
    try:
        return checkpoint_folder(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory "
            "(no config.json in it; nothing is downloaded)"
        ) from None


def step_list(text: str) -> list[str]:
    """``--steps``: comma-separated step names, each one that exists in this checkout, once;
    or ``all``, every step here in order."""
    here = available_steps()
    if text == ALL_STEPS:
        return here
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one step, e.g. {here[0]},{here[-1]}")
    for name in names:
        if name not in here:
            raise argparse.ArgumentTypeError(f"no step {name!r}; steps: {','.join(here)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a step is named twice in {text!r}")
    return names


UNUSED = "unused"  # a flag's value for a workload that does not read it: giving it is an error


def unused_because(flag: str, workload: str) -> str:
    """Why ``workload`` does not read ``flag``."""
    if flag.startswith("--sweep-"):
        return "only --workload scale reads it"
    if flag == "--request-rate":
        return "only --workload serving reads it"
    if workload == SCALE and flag in ("--requests", "--total-blocks"):
        return "--workload scale sizes its own runs (--sweep-requests, --sweep-cached)"
    return f"--workload {workload} draws its own prompts (no shared prefix)"


class PerWorkload:
    """A flag's default that depends on ``--workload``; ``--help`` shows each. A value still of
    this type after parsing was not given on the command line."""

    def __init__(
        self,
        shared_prefix: object,
        pressure: object,
        scale: object,
        serving: object,
        none: str = "",
    ) -> None:
        self.values = {
            SHARED_PREFIX: shared_prefix,
            PRESSURE: pressure,
            SCALE: scale,
            SERVING: serving,
        }
        self.none = none  # what None means, for --help

    def __str__(self) -> str:
        return ", ".join(
            f"{self.none if value is None else value} for {kind}"
            for kind, value in self.values.items()
        )


def size_list(text: str) -> tuple[int, ...]:
    """``--sweep-requests`` / ``--sweep-cached``: sizes, comma-separated, in increasing order."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if any(size < 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 0, got {text!r}")
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"give two or more sizes, increasing: got {text!r}")
    return sizes


def request_rate(text: str) -> float:
    """``--request-rate``: requests per second, a number > 0, or ``inf`` (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of requests per second (or inf: all at once)"
        ) from None
    if not rate > 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf: all at once), got {text!r}")
    return rate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, every value checked here: a bad one exits 2 with one ``error:`` line."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=HelpFormatter)
    w, pw, sw, vw = Workload(), pressure_workload(), ScaleWorkload(), ServingWorkload()
    p.add_argument(
        "--workload",
        choices=(*WORKLOADS, SERVING),
        default=SHARED_PREFIX,
        help="shared-prefix: requests behind one long prefix, all at once (speed); pressure: "
        "short answers asked with a long --new-tokens in a small pool (memory); scale: time "
        "per request as the requests and the cache grow (the engine's own cost); serving: "
        "requests arriving over time, time to first token and per output token (latency)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=PerWorkload(w.num_requests, pw.num_requests, UNUSED, vw.num_requests),
        metavar="N",
        help="requests",
    )
    p.add_argument(
        "--prefix-len",
        type=non_negative_int,
        default=PerWorkload(w.prefix_len, UNUSED, UNUSED, vw.prefix_len),
        metavar="N",
        help="tokens of the prefix every request shares",
    )
    p.add_argument(
        "--tail-len",
        type=non_negative_int,
        default=PerWorkload(w.tail_len, UNUSED, UNUSED, vw.tail_len),
        metavar="N",
        help="tokens of each request's own after the prefix",
    )
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=PerWorkload(
            w.max_new_tokens, pw.max_new_tokens, sw.max_new_tokens, vw.max_new_tokens
        ),
        metavar="N",
        help="tokens generated per request (max_new_tokens: with pressure, each request stops "
        "at its eos long before)",
    )
    p.add_argument(
        "--max-running",
        type=non_negative_int,
        default=PerWorkload(0, pw.max_running, sw.max_running, vw.max_running),
        metavar="N",
        help="requests the engine runs at once at most (0: all of them, as HF runs them in "
        "one batch)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=PerWorkload(16, 4, 4, 16),
        metavar="N",
        help="tokens per KV block",
    )
    p.add_argument(
        "--total-blocks",
        type=positive_int,
        default=PerWorkload(None, pw.total_blocks, UNUSED, None, "room for every request at once"),
        metavar="N",
        help="KV blocks in the pool; at least what the largest request holds at the end of its "
        "longest life (prompt + new tokens)",
    )
    p.add_argument(
        "--sweep-requests",
        type=size_list,
        default=PerWorkload(UNUSED, UNUSED, ",".join(map(str, sw.requests)), UNUSED),
        metavar="N,N,...",
        help="scale: requests per run of the requests sweep; the first is also the requests "
        "of every run of the cached sweep",
    )
    p.add_argument(
        "--sweep-cached",
        type=size_list,
        default=PerWorkload(UNUSED, UNUSED, ",".join(map(str, sw.cached)), UNUSED),
        metavar="N,N,...",
        help="scale: blocks already in the cache, one run each, in a pool with room for the "
        "running requests only (every allocation evicts once the free pool is gone)",
    )
    p.add_argument(
        "--request-rate",
        type=request_rate,
        default=PerWorkload(UNUSED, UNUSED, UNUSED, vw.request_rate),
        metavar="R",
        help="serving: requests per second, arriving as a seeded Poisson process (inf: all "
        "at once)",
    )
    p.add_argument(
        "--model",
        type=model_name,
        default=PerWorkload("demo", "demo", "toy", "demo"),
        metavar="PRESET|DIR",
        help=f"the model: a config preset ({', '.join(PRESETS)}) or a local Hugging Face Llama "
        "checkpoint directory (its weights; the prompts stay random token ids)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        metavar="N",
        help="runs per row; the table shows the fastest",
    )
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=DEFAULT_THREADS,
        metavar="N",
        help="torch CPU threads (0: torch's default, one per core); one keeps a busy machine's "
        "timings steady (README, Benchmarks)",
    )
    add_dtype_flag(p)
    p.add_argument(
        "--steps",
        type=step_list,
        default=ALL_STEPS,
        metavar="STEP,...",
        help=f"the steps to run, comma-separated, or {ALL_STEPS}; the first is the "
        "baseline of the vs column",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face row")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the check against the dense reference model (slow on big runs)",
    )
    p.add_argument(
        "--out",
        type=writable_folder,
        default="bench/results",
        metavar="DIR",
        help="folder for results.json and speedups.png (scale.json and scale.png, "
        "serving.json) (checked before any work)",
    )
    add_memory_check_flag(p)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no status line on stderr while a slow row runs (it is shown only on a terminal)",
    )
    args = p.parse_args(argv)
    refuse_unused_flags(p, args)
    for name, value in vars(args).items():
        if is_default(value):
            setattr(args, name, value.values[args.workload])
    if args.dtype == "auto" and args.model in PRESETS:
        p.error("--dtype auto needs --model DIR: it means the dtype the checkpoint is stored in")
    if args.workload == SCALE:
        for name in ("sweep_requests", "sweep_cached"):
            if isinstance(getattr(args, name), str):  # the default, still text
                setattr(args, name, size_list(getattr(args, name)))
        if args.model not in PRESETS:
            p.error("--model: --workload scale runs on a preset (the prompts are random ids)")
        return args
    if args.workload in (SHARED_PREFIX, SERVING) and args.prefix_len + args.tail_len == 0:
        p.error("--prefix-len and --tail-len are both 0: a prompt needs at least one token")
    workload = workload_of(args)
    need = workload.largest_request_blocks(args.block_size)
    if args.total_blocks is not None and args.total_blocks < need:
        p.error(
            f"--total-blocks {args.total_blocks} is too small: the largest request needs {need} "
            f"blocks of {args.block_size} tokens ({max(workload.prompt_lengths())} prompt + "
            f"{workload.max_new_tokens} new tokens); the engine would refuse it"
        )
    return args


def refuse_unused_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags given on the command line that the chosen workload does not read: one ``error:``
    line, rather than a run that silently ignores them."""
    reasons: dict[str, list[str]] = {}
    for name, value in vars(args).items():
        default = p.get_default(name)
        unused = isinstance(default, PerWorkload) and default.values[args.workload] == UNUSED
        if unused and not is_default(value):
            flag = "--" + name.replace("_", "-")
            reasons.setdefault(unused_because(flag, args.workload), []).append(flag)
    for reason, flags in reasons.items():
        p.error(f"{' and '.join(flags)}: {reason}")


def is_default(value: object) -> bool:
    """A flag left at its per-workload default (not given on the command line)."""
    return isinstance(value, PerWorkload)


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the flags describe (its eos ids, for pressure, come later: ``pick_eos``)."""
    if args.workload == SERVING:
        return ServingWorkload(
            num_requests=args.requests,
            prefix_len=args.prefix_len,
            tail_len=args.tail_len,
            max_new_tokens=args.new_tokens,
            max_running=args.max_running or args.requests,
            total_blocks=args.total_blocks,
            request_rate=args.request_rate,
        )
    if args.workload == PRESSURE:
        return pressure_workload(
            num_requests=args.requests,
            max_new_tokens=args.new_tokens,
            max_running=args.max_running or args.requests,
            total_blocks=args.total_blocks,
        )
    return Workload(
        args.requests,
        args.prefix_len,
        args.tail_len,
        args.new_tokens,
        args.max_running or args.requests,
        total_blocks=args.total_blocks,
    )


def model_changes(args: argparse.Namespace) -> dict[str, object]:
    """What the flags change in the model's config (``--dtype auto``: a checkpoint's own)."""
    return {"block_size": args.block_size, "device": args.device, "dtype": dtype_value(args.dtype)}


def load_model(
    args: argparse.Namespace, workload: Workload
) -> tuple[ModelConfig, Mapping[str, torch.Tensor] | None]:
    """``(cfg, weights)``: a preset with seeded weights (``weights`` None), or a checkpoint
    directory read once (every step's model and the HF row then share its tensors)."""
    changes = model_changes(args)
    if args.model in PRESETS:
        return bench_config(workload, args.model, **changes), None
    from common.checkpoint import load_checkpoint  # needs safetensors: pip install -e '.[real]'

    total_blocks = workload.pool_blocks(args.block_size)
    return load_checkpoint(args.model, total_blocks=total_blocks, **changes)


# A prompt token, as a Python int in a list: the list's 8-byte slot and a 28-byte int object.
PROMPT_BYTES_PER_TOKEN = 36


def check_workload_memory(args: argparse.Namespace, workload: Workload) -> None:
    """The weights, one KV pool and the prompts against the memory the machine has, before
    the prompts are drawn or a weight is read: a size it cannot hold is one ``error:`` line."""
    changes = model_changes(args)
    if args.model in PRESETS:
        cfg = bench_config(workload, args.model, **changes)
    else:
        from common.checkpoint import checkpoint_config

        cfg = checkpoint_config(
            args.model, total_blocks=workload.pool_blocks(args.block_size), **changes
        )
    prompts = PROMPT_BYTES_PER_TOKEN * sum(workload.prompt_lengths())
    check_memory(cfg, weights=True, extra={"the prompts": prompts})


def checkpoint_positions(args: argparse.Namespace) -> int | None:
    """The checkpoint's ``max_position_embeddings`` for the HF row (None for a preset)."""
    if args.model in PRESETS:
        return None
    from common.checkpoint import max_position_embeddings

    return max_position_embeddings(args.model)


class Stopwatch:
    """How long each phase of the run took, so that a slow one is visible (and skippable)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def measure(
    name: str,
    fixes: str,
    run: Callable[[], RunResult],
    repeats: int,
    progress: Progress | None = None,
    live: Callable[[], str] | None = None,
    warmup: bool = False,
) -> Row:
    """``repeats`` runs of one row, printed as one line when the row is done. Meanwhile a
    slow row shows on ``progress`` (which run, ``live``'s figure, the time so far).

    ``warmup``: one untimed run first. The first torch work of a process pays one-time costs
    (thread pools, kernel selection, the allocator growing) that no later run pays, so
    without it the first repeat of the first row measured the process, not the row.
    """
    seconds, result = [], None
    with (progress or Progress(enabled=False)).task(name) as task:
        task.live = live
        if warmup:
            task.note = "warm-up run (untimed)"
            run()
        for i in range(repeats):
            done = f" (done: {', '.join(f'{s:.2f}s' for s in seconds)})" if seconds else ""
            task.note = f"run {i + 1}/{repeats}{done}"
            result = run()
            seconds.append(result.seconds)
    row = Row(name, fixes, seconds, result, sum(len(ids) for ids in result.outputs))
    times = "".join(f" {s:6.2f}s" for s in seconds)
    print(f"  {name:<26}{times}" + (f"  ! {row.spread:.2f}x apart" if row.flagged else ""))
    return row


def computed_so_far(runner: StepRunner) -> Callable[[], str]:
    """The running engine's computed tokens so far, for the status line."""

    def figure() -> str:
        work = runner.live
        return f"{work.tokens:,} tokens computed" if work is not None else ""

    return figure


def main(argv: list[str] | None = None) -> int:
    """``python -m bench``: a problem with the checkpoint is one ``error:`` line, status 1."""
    args = parse_args(argv)
    return report_user_errors(PROG, lambda: run_bench(args))


def run_bench(args: argparse.Namespace) -> int:
    """Every row, the table, the notes, results.json; 0 when every row's tokens agree."""
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = Progress(enabled=False if args.quiet else None)
    if args.workload == SCALE:
        return run_scale_bench(args, progress)
    workload = workload_of(args)
    check_workload_memory(args, workload)
    with progress.task(f"loading {args.model}"):
        cfg, weights = load_model(args, workload)
    if workload.kind == SERVING:
        return run_serving_bench(args, workload, cfg, weights, progress)
    prompts = workload.prompts(cfg.vocab_size)
    machine_gflops = matmul_gflops(cfg.device)
    print(report.header(cfg, workload, args.repeats, args.model, machine_gflops))

    def timed(name: str, fixes: str, run: Callable[[], RunResult], live=None, warmup=False) -> Row:
        return measure(name, fixes, run, args.repeats, progress, live, warmup)

    clock = Stopwatch()
    reference = Reference(cfg, weights)
    if workload.kind == PRESSURE:
        with clock.phase("picking eos"), progress.task("dense reference: picking eos ids"):
            workload = pick_eos(workload, prompts, reference)
    rows, extra, runner = [], [], None
    with clock.phase("steps"):
        for name in args.steps:
            with progress.task(f"{name}: building the model"):
                runner = StepRunner(name, cfg, weights)
            run_once = lambda r=runner: r.run(prompts, workload)  # noqa: E731
            live, first = computed_so_far(runner), not rows  # the first row is warmed up
            rows.append(timed(name, FIXES[name][1], run_once, live, warmup=first))
        if workload.kind == SHARED_PREFIX:
            last, earlier = rows[-1].name, workload.earlier_prompt(cfg.vocab_size)
            live = computed_so_far(runner)
            extra = [
                # The last step on a server that has seen the prefix before: one earlier
                # request (untimed, through the same engine) put it in the cache.
                timed(
                    f"{last} (warm prefix)",
                    "the same, after one earlier request cached the prefix",
                    lambda: runner.run(prompts, workload, earlier_prompt=earlier),
                    live,
                ),
                # The last step again, cache off: what the prefix cache itself buys.
                timed(
                    f"{last} (no cache)",
                    "the same, prefix cache disabled",
                    lambda: runner.run(prompts, workload, enable_prefix_cache=False),
                    live,
                ),
            ]
    if not args.no_hf and workload.eos is not None:
        print(
            "  (Hugging Face row skipped: one batched generate cannot stop each request at its "
            "own eos)"
        )
    elif not args.no_hf:
        with clock.phase("Hugging Face"):
            with progress.task("Hugging Face: building the model"):
                hf_run = hf_runner(cfg, prompts, workload, weights, checkpoint_positions(args))
            if hf_run is not None:
                # Warmed up too: its first generate() pays transformers' own one-time setup.
                hf_name, hf_what = "HF generate", "transformers LlamaForCausalLM.generate, batched"
                extra.append(timed(hf_name, hf_what, hf_run, warmup=True))
    expected = None
    if not args.no_reference:
        with clock.phase("reference check"), progress.task("dense reference"):
            expected = reference_tokens(reference, prompts, workload)
    same = report.check_tokens(rows + extra, expected)
    print(report.table(rows, extra))
    print(report.notes(rows + extra, cfg, workload, args.repeats, machine_gflops))
    print(same.message)
    print(report.phases(clock.seconds))
    report.save(args.out, cfg, workload, args, rows, extra, same.ok, machine_gflops)
    return 0 if same.ok else 1


class Reference:
    """The dense, cache-free reference model on the bench's weights, built when first asked
    for (the shared-prefix workload with --no-reference never builds it)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.cfg, self.weights, self._model = cfg, weights, None

    @property
    def model(self) -> ReferenceModel:
        if self._model is None:
            self._model = ReferenceModel(self.cfg)
            if self.weights is not None:
                self._model.load_weights(self.weights)
        return self._model


def pick_eos(workload: Workload, prompts: list[list[int]], reference: Reference) -> Workload:
    """The pressure workload with one eos id per request, from the dense reference's own
    answers: the token each answer has at a seeded position 5 to 12 (common/front/workload.py's
    ``pressure_eos``). Needs the reference's first 13 tokens of every answer, with or
    without --no-reference."""
    start = time.perf_counter()
    answers = reference_generate(reference.model, prompts, PRESSURE_EOS_AT[1] + 1)
    picked = with_eos(workload, answers)
    seconds = time.perf_counter() - start
    print(
        f"  each request's eos: a token its dense-reference answer has at position "
        f"{PRESSURE_EOS_AT[0]} to {PRESSURE_EOS_AT[1]} (picked in {seconds:.2f} s)"
    )
    return picked


def reference_tokens(
    reference: Reference, prompts: list[list[int]], workload: Workload
) -> list[list[int]]:
    """The dense, cache-free model's tokens: every row must match them (each request stopped
    at its own eos when the workload has one per request)."""
    start = time.perf_counter()
    model, new = reference.model, workload.max_new_tokens
    if workload.eos is None:
        tokens = reference_generate(model, prompts, new)
    else:
        tokens = [
            reference_generate(model, [prompt], new, eos)[0]
            for prompt, eos in zip(prompts, workload.eos, strict=True)
        ]
    seconds = time.perf_counter() - start
    print(f"  {'dense reference':<26} {seconds:6.2f}s (correctness only, not timed against)")
    return tokens


if __name__ == "__main__":
    sys.exit(main())
