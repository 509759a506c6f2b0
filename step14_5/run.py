"""The chapter's demo: ``python -m <step>.run`` (this file is the same in every step).

Ten requests share a prefix. Served one at a time through one engine, the first misses and
caches the prefix and the other nine hit it (cold round, 9/10); served again, all ten hit (hot
round, 10/10). Outputs must not change, and at rest every block must be free or cached. Then the
same requests go through the batched engine, which must give the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common.config import parse_dtype, preset
from common.reference import ReferenceModel, reference_generate
from common.workload import demo_prompts

from . import PagedPrefixCacheEngine, TinyTransformerPaged

STEP = __package__ or "step"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {STEP}.run", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--total-blocks", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-running", type=int, default=4, help="batched engine's running set")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    return p.parse_args(argv)


def mark(ok: bool) -> str:
    return "✅" if ok else "❌"


def timed_round(label: str, engine: PagedPrefixCacheEngine, run, prompts, max_new_tokens):
    engine.reset_stats()
    start = time.perf_counter()
    outputs = run(prompts, max_new_tokens)
    ms = (time.perf_counter() - start) * 1000
    s = engine.stats
    print(
        f"{label:<28} {ms:8.1f} ms   hit rate {s.hit_rate:.0%} ({s.requests_hit}/{s.requests})"
        f"   tokens {s.token_hit_rate:.0%} ({s.cached_tokens}/{s.prompt_tokens})"
    )
    return outputs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = preset(
        "demo",
        device=args.device,
        dtype=parse_dtype(args.dtype),
        block_size=args.block_size,
        total_blocks=args.total_blocks,
        seed=args.seed,
    )
    prompts, n_new = demo_prompts(cfg.vocab_size, cfg.block_size), args.max_new_tokens
    model = TinyTransformerPaged(cfg)
    print(
        f"{STEP}: {len(prompts)} requests sharing a {3 * cfg.block_size}-token prefix, "
        f"{n_new} new tokens each ({cfg.device}, {str(cfg.dtype).removeprefix('torch.')}, "
        f"block_size={cfg.block_size}, {cfg.total_blocks} blocks)\n"
    )

    with torch.inference_mode():
        engine = PagedPrefixCacheEngine(model, max_running=args.max_running)
        cold = timed_round(
            "Round 1 (cold cache), serial", engine, engine.generate_serial, prompts, n_new
        )
        hot = timed_round(
            "Round 2 (hot cache), serial", engine, engine.generate_serial, prompts, n_new
        )
        problems = engine.ref_count_problems()
        s = engine.stats
        batched_engine = PagedPrefixCacheEngine(model, max_running=args.max_running)
        batched = timed_round(
            f"Batched (max_running={args.max_running}), cold",
            batched_engine,
            batched_engine.generate,
            prompts,
            n_new,
        )
        reference = reference_generate(ReferenceModel(cfg), prompts, n_new)

    checks = [
        (cold == hot, "Both rounds' outputs identical (the cache only saves work)"),
        (
            not problems,
            f"Every block's ref_count sane (free {s.blocks_free} + cached "
            f"{s.blocks_cached} = total {cfg.total_blocks})",
        ),
        (batched == cold, "Batched outputs identical to the serial ones"),
        (cold == reference, "Outputs identical to the dense reference model"),
    ]
    print()
    for ok, text in checks:
        print(f"{text} {mark(ok)}")
    for line in problems[:10]:
        print("   ", line)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
