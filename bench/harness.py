"""What every benchmark shares: building a step's engine and timing one workload through it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from common.config import ModelConfig, preset
from common.steps import load_step
from common.workload import bench_prompts

from .costs import TokenWork, counting, model_flops, paged_kv_bytes, wait_for


@dataclass(frozen=True)
class Workload:
    """Requests behind one shared prefix (a system prompt), served together.

    The default is the showcase's: 16 requests, each a 256-token shared prefix + 32 tokens of
    its own, 32 new tokens each, and ``max_running=16`` so that all of them run at once, as the
    Hugging Face row runs them in one batch.
    """

    num_requests: int = 16
    prefix_len: int = 256
    tail_len: int = 32
    max_new_tokens: int = 32
    max_running: int = 16
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return bench_prompts(
            self.num_requests, self.prefix_len, self.tail_len, vocab_size, self.seed
        )

    def earlier_prompt(self, vocab_size: int) -> list[int]:
        """One more request behind the same prefix, with a tail of its own: the "earlier
        traffic" that warms the cache before the timed requests arrive (the prompts are drawn
        prefix first, then one tail per request, so request ``n + 1`` extends the set)."""
        return bench_prompts(
            self.num_requests + 1, self.prefix_len, self.tail_len, vocab_size, self.seed
        )[-1]

    def pool_blocks(self, block_size: int) -> int:
        """A pool roomy enough that every request runs without waiting for memory, with room
        for the earlier request's blocks too (the warm rows keep them cached)."""
        per_request = -(-(self.prefix_len + self.tail_len + self.max_new_tokens) // block_size)
        return per_request * (self.max_running + 1) + 8


def bench_config(workload: Workload, model: str = "bench", **changes: object) -> ModelConfig:
    """The ``model`` preset with a KV pool sized for ``workload``."""
    cfg = preset(model, **changes)
    return cfg.replace(total_blocks=workload.pool_blocks(cfg.block_size))


@dataclass
class RunResult:
    """One run's tokens and time, the engine's counters, and what the run cost.

    ``requests`` stays 0 for a row without a prefix cache at all (Hugging Face); such a row
    fills in the computed tokens, FLOPs and KV bytes from its own formulas.
    """

    outputs: list[list[int]]
    seconds: float
    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    computed_decode_tokens: int = 0
    blocks_peak: int = 0  # the most blocks out of the free pool at once (0: not paged)
    kv_peak_bytes: int = 0  # the KV memory those blocks (or a dense cache) took
    flops: int = 0  # model FLOPs of what was computed (bench.costs.model_flops)


class StepRunner:
    """One step's model, kept across runs; each run gets a fresh engine (a cold cache), so
    every repeat does the same work.

    ``weights``: a checkpoint's tensors (``common.checkpoint.load_checkpoint``) for a ``cfg``
    without a seed; every step's model then shares them.
    """

    def __init__(
        self,
        step_name: str,
        cfg: ModelConfig,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.step = load_step(step_name)
        self.model = self.step.TinyTransformerPaged(cfg)
        if weights is not None:
            self.model.load_weights(weights)
        self.live: TokenWork | None = None  # the run in progress's count, for a status line

    def engine(
        self,
        workload: Workload,
        enable_prefix_cache: bool = True,
        earlier_prompt: list[int] | None = None,
    ):
        """A fresh engine; with ``earlier_prompt``, after one request of it was served (so its
        prefix is in the cache, as on a server that has seen traffic) and the counters zeroed.
        ``blocks_peak`` keeps counting from the engine's creation: the cached prefix is memory
        the timed requests use."""
        engine = self.step.PagedPrefixCacheEngine(
            self.model, max_running=workload.max_running, enable_prefix_cache=enable_prefix_cache
        )
        if earlier_prompt is not None:
            with torch.inference_mode():
                engine.generate([earlier_prompt], 1)
            engine.reset_stats()
        return engine

    def serve(self, engine, prompts: list[list[int]], workload: Workload) -> RunResult:
        """Time ``prompts`` through ``engine``: only this is measured."""
        with counting(self.model) as work:
            self.live = work
            start = time.perf_counter()
            with torch.inference_mode():
                outputs = engine.generate(prompts, workload.max_new_tokens)
            wait_for(self.model.cfg.device)
            seconds = time.perf_counter() - start
        self.live = None
        work.sampled = sum(len(ids) for ids in outputs)
        s, cfg = engine.stats, self.model.cfg
        return RunResult(
            outputs,
            seconds,
            requests=s.requests,
            requests_hit=s.requests_hit,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            computed_prefill_tokens=s.computed_prefill_tokens,
            computed_decode_tokens=s.computed_decode_tokens,
            blocks_peak=s.blocks_peak,
            kv_peak_bytes=paged_kv_bytes(cfg, s.blocks_peak),
            flops=model_flops(cfg, work),
        )

    def run(
        self,
        prompts: list[list[int]],
        workload: Workload,
        enable_prefix_cache: bool = True,
        earlier_prompt: list[int] | None = None,
    ) -> RunResult:
        """A fresh engine (warmed by ``earlier_prompt`` when given, untimed), then ``prompts``
        through it, timed."""
        engine = self.engine(workload, enable_prefix_cache, earlier_prompt)
        return self.serve(engine, prompts, workload)
