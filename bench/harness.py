"""What every benchmark shares: building a step's engine and timing one workload through it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.config import ModelConfig, preset
from common.steps import load_step
from common.workload import bench_prompts


@dataclass(frozen=True)
class Workload:
    """Requests behind one shared prefix (a system prompt), served together."""

    num_requests: int = 16
    prefix_len: int = 128
    tail_len: int = 32
    max_new_tokens: int = 32
    max_running: int = 8
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return bench_prompts(
            self.num_requests, self.prefix_len, self.tail_len, vocab_size, self.seed
        )

    def pool_blocks(self, block_size: int) -> int:
        """A pool roomy enough that every request runs without waiting for memory."""
        per_request = -(-(self.prefix_len + self.tail_len + self.max_new_tokens) // block_size)
        return per_request * self.max_running + 8


def bench_config(workload: Workload, model: str = "bench", **changes: object) -> ModelConfig:
    """The ``model`` preset with a KV pool sized for ``workload``."""
    cfg = preset(model, **changes)
    return cfg.replace(total_blocks=workload.pool_blocks(cfg.block_size))


@dataclass
class RunResult:
    """One run's tokens and time, and the engine's counters (left at 0 by the HF row)."""

    outputs: list[list[int]]
    seconds: float
    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    computed_decode_tokens: int = 0


class StepRunner:
    """One step's model, kept across runs; each run gets a fresh engine (a cold cache), so
    every repeat does the same work."""

    def __init__(self, step_name: str, cfg: ModelConfig) -> None:
        self.step = load_step(step_name)
        self.model = self.step.TinyTransformerPaged(cfg)

    def run(
        self, prompts: list[list[int]], workload: Workload, enable_prefix_cache: bool = True
    ) -> RunResult:
        engine = self.step.PagedPrefixCacheEngine(
            self.model, max_running=workload.max_running, enable_prefix_cache=enable_prefix_cache
        )
        start = time.perf_counter()
        with torch.inference_mode():
            outputs = engine.generate(prompts, workload.max_new_tokens)
        if self.model.cfg.device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        s = engine.stats
        return RunResult(
            outputs,
            seconds,
            requests=s.requests,
            requests_hit=s.requests_hit,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            computed_prefill_tokens=s.computed_prefill_tokens,
            computed_decode_tokens=s.computed_decode_tokens,
        )
