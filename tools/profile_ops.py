"""Where a step's time goes on the bench's shared-prefix workload, by torch operator.

    python -m tools.profile_ops --step step14_7 --threads 1
    python -m tools.profile_ops --step step14_9 --model smollm2-135m --dtype bfloat16

Builds the bench's default workload (16 requests, a 256-token shared prefix + 32 tokens of
their own, 32 new tokens each, all at once, on the ``demo`` model or another preset, in float32
or another dtype), warms the prefix as the
bench's warm row does (one earlier request through the same engine), runs it once untimed,
then once under ``torch.profiler``, and prints the operators that took the most of the run's
own CPU time (each operator's "self" time: what it spent outside the operators it called), and
the share of the matmuls (``aten::mm``, ``addmm``, ``bmm``, ``matmul``, ``linear``) in it.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.workloads.shared_prefix import SharedPrefix
from common.config import DTYPES, PRESETS, preset
from front.steps import STEPS, load_step

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", choices=STEPS, default="step14_7", help="the step to profile")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (default: 1)")
    parser.add_argument("--top", type=int, default=8, help="operators to list (default: 8)")
    parser.add_argument("--cold", action="store_true", help="no earlier request: a cold cache")
    parser.add_argument("--model", choices=sorted(PRESETS), default="demo", help="the preset")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the model's dtype")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    workload = SharedPrefix()
    cfg = preset(args.model, total_blocks=workload.pool_blocks(16), dtype=args.dtype)
    step = load_step(args.step)
    model = step.TinyTransformerPaged(cfg)
    prompts = workload.prompts(cfg.vocab_size)

    def engine():
        fresh = step.PagedPrefixCacheEngine(model, max_running=workload.max_running)
        if not args.cold:
            fresh.generate([workload.earlier_prompt(cfg.vocab_size)], workload.max_new_tokens)
        return fresh

    engine().generate(prompts, workload.max_new_tokens)  # untimed: one-time setup
    timed = engine()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        timed.generate(prompts, workload.max_new_tokens)
        seconds = time.perf_counter() - began
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    state = "cold" if args.cold else "warm"
    matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMULS) / total
    print(
        f"{args.step}, {state} prefix, {args.threads} thread(s): {seconds:.3f} s profiled "
        f"({args.model} in {args.dtype}; {matmul:.0%} of it in matmuls)"
    )
    print(f"{'operator':<44} {'self CPU':>9} {'share':>6} {'calls':>7}")
    for e in ops[: args.top]:
        share = e.self_cpu_time_total / total
        ms = e.self_cpu_time_total / 1e3
        print(f"{e.key:<44} {ms:>7.1f}ms {share:>6.0%} {e.count:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
