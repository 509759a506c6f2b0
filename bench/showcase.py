"""``python -m bench``: every step on the same workload, side by side (``--help``: what it
does, every flag and its default)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from common.cli import HelpFormatter, device_name, dtype_name, non_negative_int, positive_int
from common.config import DTYPES, PRESETS, ModelConfig
from common.reference import ReferenceModel, reference_generate
from common.steps import FIXES, available_steps
from common.text import model_dir_arg

from . import report
from .costs import matmul_gflops
from .harness import RunResult, StepRunner, Workload, bench_config
from .hf import hf_runner

ALL_STEPS = "all"

# torch CPU threads unless --threads says otherwise. Measured on a shared 2-core VM (README,
# Benchmarks): two threads were 1.5x faster on the batched rows while the machine was quiet, and
# up to 100x slower while another program was running; one thread stays steady.
DEFAULT_THREADS = 1

DESCRIPTION = f"""\
Every step on the same workload, side by side.

Serves the same shared-prefix requests through each step --repeats times, each time through a
fresh engine (a cold cache). By default all requests run at once (--max-running 0), as Hugging
Face runs them in one batch. Then the last step again, twice: after one earlier request has
put the shared prefix in the cache (warm prefix: only the later requests are timed), and with
the prefix cache off. Then Hugging Face's generate on the same weights, all prompts in one
batch. Every row must produce the same tokens as the dense reference model.

The first row and the Hugging Face row get one untimed warm-up run (one-time setup). Each row
shows its fastest run (min s: the work is the same every run, so a slower run only measures
what else the machine was doing), flagged ! when its runs differ by more than
{report.SPREAD_FLAG}x; tokens/s; the prompt tokens the prefix cache saved; the tokens the
model computed; the peak KV memory it held; and the model FLOPs it did and their rate, next to
this machine's own matmul rate. Results go to the --out folder: results.json, and
speedups.png when matplotlib is installed.
"""


@dataclass
class Row:
    """One line of the table: a step (or a variant of one) and its figures."""

    name: str
    fixes: str
    seconds: list[float]
    result: RunResult
    new_tokens: int

    @property
    def best(self) -> float:
        """The fastest run: the statistic of a deterministic workload (every run does the same
        work, so the time above the fastest is other programs' and the OS's)."""
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Slowest run / fastest run: 1.0 on a quiet machine."""
        return max(self.seconds) / self.best

    @property
    def flagged(self) -> bool:
        return self.spread > report.SPREAD_FLAG

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.best

    @property
    def gflops_per_second(self) -> float:
        return self.result.flops / self.best / 1e9


def model_name(text: str) -> str:
    """``--model``: a preset name (common/config.py), or a local checkpoint directory."""
    if text in PRESETS:
        return text
    try:
        return model_dir_arg(text)
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, every value checked here: a bad one exits 2 with one ``error:`` line."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    w = Workload()
    p.add_argument(
        "--requests",
        type=positive_int,
        default=w.num_requests,
        metavar="N",
        help="requests, all behind one shared prefix",
    )
    p.add_argument(
        "--prefix-len",
        type=non_negative_int,
        default=w.prefix_len,
        metavar="N",
        help="tokens of the prefix every request shares",
    )
    p.add_argument(
        "--tail-len",
        type=non_negative_int,
        default=w.tail_len,
        metavar="N",
        help="tokens of each request's own after the prefix",
    )
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=w.max_new_tokens,
        metavar="N",
        help="tokens generated per request",
    )
    p.add_argument(
        "--max-running",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="requests the engine runs at once (0: all of them, as HF runs them in one batch)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block"
    )
    p.add_argument(
        "--model",
        type=model_name,
        default="demo",
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
    p.add_argument("--dtype", type=dtype_name, default="float32", help=", ".join(DTYPES))
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
        default="bench/results",
        metavar="DIR",
        help="folder for results.json and speedups.png",
    )
    args = p.parse_args(argv)
    if args.prefix_len + args.tail_len == 0:
        p.error("--prefix-len and --tail-len are both 0: a prompt needs at least one token")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out}: exists and is not a folder")
    return args


def load_model(
    args: argparse.Namespace, workload: Workload
) -> tuple[ModelConfig, Mapping[str, torch.Tensor] | None]:
    """``(cfg, weights)``: a preset with seeded weights (``weights`` None), or a checkpoint
    directory read once (every step's model and the HF row then share its tensors)."""
    changes = {"block_size": args.block_size, "device": args.device, "dtype": DTYPES[args.dtype]}
    if args.model in PRESETS:
        return bench_config(workload, args.model, **changes), None
    from common.checkpoint import load_checkpoint  # needs safetensors: pip install -e '.[real]'

    total_blocks = workload.pool_blocks(args.block_size)
    return load_checkpoint(args.model, total_blocks=total_blocks, **changes)


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
    new_tokens: int,
    warmup: bool = False,
) -> Row:
    """``repeats`` runs of one row, each printed as it finishes (a slow row shows at once).

    ``warmup``: one untimed run first. The first torch work of a process pays one-time costs
    (thread pools, kernel selection, the allocator growing) that no later run pays, so
    without it the first repeat of the first row measured the process, not the row.
    """
    seconds, result = [], None
    print(f"  {name:<26}", end="", flush=True)
    if warmup:
        run()
    for _ in range(repeats):
        result = run()
        seconds.append(result.seconds)
        print(f" {result.seconds:6.2f}s", end="", flush=True)
    row = Row(name, fixes, seconds, result, new_tokens)
    print(f"  ! {row.spread:.2f}x apart" if row.flagged else "")
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = Workload(
        args.requests,
        args.prefix_len,
        args.tail_len,
        args.new_tokens,
        args.max_running or args.requests,
    )
    cfg, weights = load_model(args, workload)
    prompts = workload.prompts(cfg.vocab_size)
    new_tokens = workload.num_requests * workload.max_new_tokens
    machine_gflops = matmul_gflops(cfg.device)
    print(report.header(cfg, workload, args.repeats, args.model, machine_gflops))

    def timed(name: str, fixes: str, run: Callable[[], RunResult], warmup: bool = False) -> Row:
        return measure(name, fixes, run, args.repeats, new_tokens, warmup)

    clock = Stopwatch()
    rows, runner = [], None
    with clock.phase("steps"):
        for name in args.steps:
            runner = StepRunner(name, cfg, weights)
            run = partial(runner.run, prompts, workload)
            rows.append(timed(name, FIXES[name][1], run, warmup=not rows))  # the first row
        last, earlier = rows[-1].name, workload.earlier_prompt(cfg.vocab_size)
        extra = [
            # The last step on a server that has seen the prefix before: one earlier request
            # (untimed, through the same engine) put it in the cache.
            timed(
                f"{last} (warm prefix)",
                "the same, after one earlier request cached the prefix",
                lambda: runner.run(prompts, workload, earlier_prompt=earlier),
            ),
            # The last step again, cache off: what the prefix cache itself buys.
            timed(
                f"{last} (no cache)",
                "the same, prefix cache disabled",
                lambda: runner.run(prompts, workload, enable_prefix_cache=False),
            ),
        ]
    if not args.no_hf:
        with clock.phase("Hugging Face"):
            hf_run = hf_runner(cfg, prompts, workload, weights)
            if hf_run is not None:
                # Warmed up too: its first generate() pays transformers' own one-time setup.
                hf_name, hf_what = "HF generate", "transformers LlamaForCausalLM.generate, batched"
                extra.append(timed(hf_name, hf_what, hf_run, warmup=True))
    expected = None
    if not args.no_reference:
        with clock.phase("reference check"):
            expected = reference_tokens(cfg, weights, prompts, workload)
    same = report.check_tokens(rows + extra, expected)
    print(report.table(rows, extra))
    print(report.notes(rows + extra, cfg, workload, args.repeats, machine_gflops))
    print(same.message)
    print(report.phases(clock.seconds))
    report.save(args.out, cfg, workload, args, rows, extra, same.ok, machine_gflops)
    return 0 if same.ok else 1


def reference_tokens(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    prompts: list[list[int]],
    workload: Workload,
) -> list[list[int]]:
    """The dense, cache-free model's tokens: every row must match them."""
    print(f"  {'dense reference':<26}", end="", flush=True)
    start = time.perf_counter()
    model = ReferenceModel(cfg)
    if weights is not None:
        model.load_weights(weights)
    tokens = reference_generate(model, prompts, workload.max_new_tokens)
    print(f" {time.perf_counter() - start:6.2f}s (correctness only, not timed against)")
    return tokens


if __name__ == "__main__":
    sys.exit(main())
