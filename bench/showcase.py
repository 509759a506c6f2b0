"""``python -m bench``: every step on the same workload, side by side.

Loads each step, serves the same shared-prefix requests through it ``--repeats`` times (a fresh
engine, so a cold cache, each time), checks that every step produced the same tokens as the
dense reference model, and prints what each step buys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from common.config import parse_dtype
from common.reference import ReferenceModel, reference_generate
from common.steps import FIXES, available_steps

from . import report
from .harness import RunResult, StepRunner, Workload, bench_config
from .hf import hf_runner


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    w = Workload()
    p.add_argument("--requests", type=int, default=w.num_requests)
    p.add_argument("--prefix-len", type=int, default=w.prefix_len, help="shared prefix tokens")
    p.add_argument("--tail-len", type=int, default=w.tail_len, help="distinct tokens per request")
    p.add_argument("--new-tokens", type=int, default=w.max_new_tokens)
    p.add_argument("--max-running", type=int, default=w.max_running)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", default="demo", help="config preset: tiny, demo or bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", default=",".join(available_steps()), help="comma-separated")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face row")
    p.add_argument("--no-reference", action="store_true", help="skip the dense-model check")
    p.add_argument("--out", default="bench/results", help="where results.json / speedups.png go")
    return p.parse_args(argv)


def measure(name: str, fixes: str, run, repeats: int, new_tokens: int) -> Row:
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
        dtype=parse_dtype(args.dtype),
    )
    prompts = workload.prompts(cfg.vocab_size)
    new_tokens = workload.num_requests * workload.max_new_tokens
    print(report.header(cfg, workload, args.repeats))

    def timed(name: str, fixes: str, run) -> Row:
        return measure(name, fixes, run, args.repeats, new_tokens)

    rows, runner = [], None
    for name in [s for s in args.steps.split(",") if s]:
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
    hf_run = None if args.no_hf else hf_runner(cfg, prompts, workload)
    if hf_run is not None:
        extra.append(
            timed("HF generate", "transformers LlamaForCausalLM.generate, batched", hf_run)
        )
    expected = None if args.no_reference else reference_tokens(cfg, prompts, workload)
    same = report.check_tokens(rows + extra, expected)
    print(report.table(rows, extra))
    print(same.message)
    report.save(args.out, cfg, workload, args, rows, extra, same.ok)
    return 0 if same.ok else 1


def reference_tokens(cfg, prompts, workload: Workload) -> list[list[int]]:
    print("  dense reference       ", end="", flush=True)
    start = time.perf_counter()
    tokens = reference_generate(ReferenceModel(cfg), prompts, workload.max_new_tokens)
    print(f" {time.perf_counter() - start:6.2f}s (correctness only, not timed against)")
    return tokens


if __name__ == "__main__":
    sys.exit(main())
