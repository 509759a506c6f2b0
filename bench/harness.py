"""What every benchmark shares: building a step's engine and timing one workload through it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from common.config import ModelConfig, preset
from common.front.steps import load_step
from common.front.workload import (
    PRESSURE_EOS_AT,
    bench_prompts,
    pressure_eos,
    pressure_prompt_lengths,
    pressure_prompts,
)
from common.inputs import blocks_for_request

from .costs import TokenWork, counting, model_flops, paged_kv_bytes, wait_for

SHARED_PREFIX = "shared-prefix"
PRESSURE = "pressure"
SCALE = "scale"  # bench/scale.py
WORKLOADS = (SHARED_PREFIX, PRESSURE, SCALE)


@dataclass(frozen=True)
class Workload:
    """The requests a bench run serves: one of two kinds.

    ``shared-prefix`` (the default, the showcase's): 16 requests behind one shared prefix (a
    system prompt), each a 256-token prefix + 32 tokens of its own, 32 new tokens each, and
    ``max_running=16`` so that all of them run at once, as the Hugging Face row runs them in
    one batch.

    ``pressure`` (``pressure_workload()``): short unrelated prompts whose answers stop at their
    own eos (``eos``, one id per request) long before ``max_new_tokens``, in a small pool
    (``total_blocks``): what memory on demand buys over reserving each request's worst case.
    ``prefix_len`` and ``tail_len`` are unused there.
    """

    num_requests: int = 16
    prefix_len: int = 256
    tail_len: int = 32
    max_new_tokens: int = 32
    max_running: int = 16
    seed: int = 0
    kind: str = SHARED_PREFIX
    total_blocks: int | None = None  # the KV pool; None: room for every request at once
    eos: tuple[int, ...] | None = None  # per request; the pressure workload's, once picked

    def prompts(self, vocab_size: int) -> list[list[int]]:
        if self.kind == PRESSURE:
            return pressure_prompts(self.num_requests, vocab_size, self.seed)
        return bench_prompts(
            self.num_requests, self.prefix_len, self.tail_len, vocab_size, self.seed
        )

    def prompt_lengths(self) -> list[int]:
        """Every prompt's length, without drawing the prompts (no vocabulary needed)."""
        if self.kind == PRESSURE:
            return pressure_prompt_lengths(self.num_requests, self.seed)
        return [self.prefix_len + self.tail_len] * self.num_requests

    def describe(self) -> str:
        """One line: what the requests are."""
        if self.kind == PRESSURE:
            lengths = self.prompt_lengths()
            return (
                f"{self.num_requests} requests: unrelated prompts of {min(lengths)} to "
                f"{max(lengths)} tokens, each stopping at its own eos within "
                f"{PRESSURE_EOS_AT[1] + 1} tokens, max_new_tokens={self.max_new_tokens}, "
                f"max_running={self.max_running}"
            )
        return (
            f"{self.num_requests} requests: a {self.prefix_len}-token shared prefix + "
            f"{self.tail_len} own tokens each, {self.max_new_tokens} new tokens, "
            f"max_running={self.max_running}"
        )

    def earlier_prompt(self, vocab_size: int) -> list[int]:
        """One more request behind the same prefix, with a tail of its own: the "earlier
        traffic" that warms the cache before the timed requests arrive (the prompts are drawn
        prefix first, then one tail per request, so request ``n + 1`` extends the set)."""
        return bench_prompts(
            self.num_requests + 1, self.prefix_len, self.tail_len, vocab_size, self.seed
        )[-1]

    def largest_request_blocks(self, block_size: int) -> int:
        """Blocks the largest request holds at the end of its longest life: a pool smaller
        than this could never run it (the engine refuses it)."""
        longest = max(self.prompt_lengths())
        return blocks_for_request(longest, self.max_new_tokens, block_size)

    def pool_blocks(self, block_size: int) -> int:
        """``total_blocks`` when set; else a pool roomy enough that every request runs
        without waiting for memory, with room for the earlier request's blocks too (the warm
        rows keep them cached)."""
        if self.total_blocks is not None:
            return self.total_blocks
        per_request = -(-(self.prefix_len + self.tail_len + self.max_new_tokens) // block_size)
        return per_request * (self.max_running + 1) + 8


def pressure_workload(**changes: object) -> Workload:
    """The memory-pressure workload's defaults: two dozen prompts of 4 to 11 tokens,
    ``max_new_tokens=64``, eight at a time at most, in a pool of 48 blocks (of 4 tokens: the
    block size is the model's, ``--block-size``). Its ``eos`` is picked from the reference's
    answers (``with_eos``)."""
    fields = dict(
        kind=PRESSURE,
        num_requests=24,
        prefix_len=0,
        tail_len=0,
        max_new_tokens=64,
        max_running=8,
        seed=7,
        total_blocks=48,
    )
    return Workload(**{**fields, **changes})


def with_eos(workload: Workload, answers: list[list[int]]) -> Workload:
    """The pressure workload with one eos id per request, picked from ``answers`` (the dense
    reference's first tokens of each prompt: ``pressure_eos``)."""
    return replace(workload, eos=tuple(pressure_eos(answers, workload.seed)))


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
    # How many ran at once, and what memory pressure cost (0 for a row without an engine).
    rounds: int = 0  # rounds that ran at least one sequence
    seqs_scheduled: int = 0  # sequences run, summed over the rounds
    preemptions: int = 0

    @property
    def seqs_per_round(self) -> float:
        """Sequences a round ran, on average (``EngineStats.seqs_per_round``)."""
        return self.seqs_scheduled / self.rounds if self.rounds else 0.0


def serve_requests(engine, prompts: list[list[int]], workload: Workload) -> list[list[int]]:
    """Every prompt through ``engine``, served together; each request stops at its own eos
    when the workload has one per request (``add_request`` takes one per request, ``generate``
    one for all)."""
    if workload.eos is None:
        return engine.generate(prompts, workload.max_new_tokens)
    ids = [
        engine.add_request(prompt, workload.max_new_tokens, eos)
        for prompt, eos in zip(prompts, workload.eos, strict=True)
    ]
    while engine.has_work:
        engine.step()
    return [engine.pop_output(rid) for rid in ids]


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
        with counting(engine) as work:
            self.live = work
            start = time.perf_counter()
            with torch.inference_mode():
                outputs = serve_requests(engine, prompts, workload)
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
            rounds=s.rounds,
            seqs_scheduled=s.seqs_scheduled,
            preemptions=s.preemptions,
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
