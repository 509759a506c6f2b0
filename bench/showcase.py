"""``python -m bench``: every step on the same workload, side by side (``--help``: what it
does, every flag and its default)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import DTYPES, PRESETS
from common.reference import ReferenceModel, reference_generate
from common.steps import FIXES, available_steps

from . import report
from .cli import HelpFormatter, device_name, dtype_name, non_negative_int, positive_int
from .harness import RunResult, StepRunner, Workload, bench_config
from .hf import hf_runner

ALL_STEPS = "all"

DESCRIPTION = """\
Every step on the same workload, side by side.

Serves the same shared-prefix requests through each step --repeats times (a fresh engine, so a
cold cache, each time), checks that every row produced the same tokens as the dense reference
model, and prints what each step buys. Results go to the --out folder: results.json, and
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
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.median


def model_name(text: str) -> str:
    """``--model``: a preset name (common/config.py), or a local checkpoint directory."""
    if text in PRESETS or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory"
    )


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
        type=positive_int,
        default=w.max_running,
        metavar="N",
        help="requests the engine runs at once",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block"
    )
    p.add_argument(
        "--model",
        type=model_name,
        default="demo",
        metavar="PRESET",
        help=f"the model's config preset: {', '.join(PRESETS)}",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        metavar="N",
        help="runs per row; the table shows their median",
    )
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="torch CPU threads (0: torch's default)",
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
    if args.model not in PRESETS:
        # A checkpoint directory (model_name let it through). The one place to wire it: drop
        # this error, and in main() build cfg from the checkpoint instead of bench_config().
        p.error(f"--model {args.model}: checkpoint directories are not supported yet")
    return args


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
    name: str, fixes: str, run: Callable[[], RunResult], repeats: int, new_tokens: int
) -> Row:
    """``repeats`` runs of one row, each printed as it finishes (a slow row shows at once)."""
    seconds, result = [], None
    print(f"  {name:<22}", end="", flush=True)
    for _ in range(repeats):
        result = run()
        seconds.append(result.seconds)
        print(f" {result.seconds:6.2f}s", end="", flush=True)
    print()
    return Row(name, fixes, seconds, result, new_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = Workload(
        args.requests, args.prefix_len, args.tail_len, args.new_tokens, args.max_running
    )
    cfg = bench_config(
        workload,
        args.model,
        block_size=args.block_size,
        device=args.device,
        dtype=DTYPES[args.dtype],
    )
    prompts = workload.prompts(cfg.vocab_size)
    new_tokens = workload.num_requests * workload.max_new_tokens
    print(report.header(cfg, workload, args.repeats))

    def timed(name: str, fixes: str, run: Callable[[], RunResult]) -> Row:
        return measure(name, fixes, run, args.repeats, new_tokens)

    clock = Stopwatch()
    rows, runner = [], None
    with clock.phase("steps"):
        for name in args.steps:
            runner = StepRunner(name, cfg)
            rows.append(timed(name, FIXES[name][1], lambda r=runner: r.run(prompts, workload)))
        # The last step again, cache off: what the prefix cache itself buys.
        extra = [
            timed(
                f"{rows[-1].name} (no cache)",
                "the same, prefix cache disabled",
                lambda: runner.run(prompts, workload, enable_prefix_cache=False),
            )
        ]
    if not args.no_hf:
        with clock.phase("Hugging Face"):
            hf_run = hf_runner(cfg, prompts, workload)
            if hf_run is not None:
                extra.append(
                    timed("HF generate", "transformers LlamaForCausalLM.generate, batched", hf_run)
                )
    expected = None
    if not args.no_reference:
        with clock.phase("reference check"):
            expected = reference_tokens(cfg, prompts, workload)
    same = report.check_tokens(rows + extra, expected)
    print(report.table(rows, extra))
    print(same.message)
    print(report.phases(clock.seconds))
    report.save(args.out, cfg, workload, args, rows, extra, same.ok)
    return 0 if same.ok else 1


def reference_tokens(cfg, prompts: list[list[int]], workload: Workload) -> list[list[int]]:
    """The dense, cache-free model's tokens: every row must match them."""
    print("  dense reference       ", end="", flush=True)
    start = time.perf_counter()
    tokens = reference_generate(ReferenceModel(cfg), prompts, workload.max_new_tokens)
    print(f" {time.perf_counter() - start:6.2f}s (correctness only, not timed against)")
    return tokens


if __name__ == "__main__":
    sys.exit(main())
