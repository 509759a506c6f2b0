"""What a row computed and what it held: model FLOPs, KV memory, and the machine's own limit.

Seconds alone do not say why a row is slow. Next to them the showcase prints

- the **model FLOPs** a row really did (``model_flops``): the arithmetic its tokens need, counted
  by one formula for every row, so that FLOPs / seconds says how close a row came to
- the **machine's matmul rate** (``matmul_gflops``): one large float32 matmul at the same thread
  count, about the best this machine does. A row far below it is bound by overhead (Python,
  small kernels, copies), not by arithmetic;
- the **peak KV memory** a row held: paged blocks for the engine (``paged_kv_bytes``), a dense
  ``[batch, positions]`` cache for Hugging Face (``dense_kv_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.observer import RoundObserver

MIB = 2**20
MATMUL_N = 1024  # the side of the square float32 matmul that measures the machine


@dataclass
class TokenWork:
    """What went through the model: enough to count its FLOPs.

    ``tokens``: tokens computed (prefill chunks and decode tokens); ``context``: the sum over
    those tokens of the positions each one attends to (itself included: the token at position
    ``p`` reads ``p + 1`` keys); ``sampled``: tokens generated, one lm_head row each.
    """

    tokens: int = 0
    context: int = 0
    sampled: int = 0

    def add_chunk(self, start: int, length: int) -> None:
        """A chunk of ``length`` tokens at positions ``start ... start+length-1``."""
        self.tokens += length
        # sum of (p + 1) for p in [start, start + length): an arithmetic series
        self.context += length * start + length * (length + 1) // 2


def linear_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one layer's matmuls: q, k, v, o (k and v shrink with grouped-query attention)
    and the three of the SwiGLU MLP. The norms are element-wise and not counted."""
    q_width, kv_width = cfg.num_heads * cfg.d_head, cfg.num_kv_heads * cfg.d_head
    attention = cfg.d_model * (2 * q_width + 2 * kv_width)  # q_proj + o_proj, k_proj + v_proj
    return attention + 3 * cfg.d_model * cfg.d_ff


def model_flops(cfg: ModelConfig, work: TokenWork) -> int:
    """The FLOPs of ``work`` through the model ``cfg`` (one multiply-add = 2 FLOPs):

    - every computed token: ``2 x num_layers x linear_params_per_layer`` (the projections and
      the MLP);
    - attention, per computed token and layer: ``4 x num_heads x d_head x`` its context length
      (q·kᵀ over the context, then the weighted sum of v: two matmuls of that size);
    - the lm_head, ``2 x d_model x vocab_size``, once per *sampled* token: only the last row of a
      prompt is needed. (step14 to step14_6 run the lm_head over every row of a chunk, and every
      step over the last row of each prefill chunk; that waste is not counted: these are the
      FLOPs the tokens need, the same for every row that computes the same tokens.)

    Embedding lookups, norms, RoPE, softmax and the residual adds are left out: a few FLOPs per
    element, small next to the matmuls.
    """
    per_token = 2 * cfg.num_layers * linear_params_per_layer(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.d_head * work.context
    lm_head = 2 * cfg.d_model * cfg.vocab_size * work.sampled
    return per_token * work.tokens + attention + lm_head


def dense_work(batch: int, prompt_len: int, new_tokens: int) -> TokenWork:
    """What a dense ``generate`` of ``batch`` equal-length prompts computes: every prompt token
    (no prefix cache), then ``new_tokens - 1`` decode steps (the last new token is never fed
    back); every sequence attends over all of its positions."""
    work = TokenWork(sampled=batch * new_tokens)
    for _ in range(batch):
        work.add_chunk(0, prompt_len)
        work.add_chunk(prompt_len, new_tokens - 1)  # one token per step, positions in a row
    return work


def paged_kv_bytes(cfg: ModelConfig, blocks: int) -> int:
    """The KV memory of ``blocks`` paged blocks: each holds K and V for ``block_size`` tokens in
    every layer (``2 x num_layers x block_size x num_kv_heads x d_head x dtype bytes``)."""
    return blocks * cfg.block_size * cfg.kv_bytes_per_token()


def dense_kv_bytes(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> int:
    """Hugging Face's dense cache at the end of ``generate``: ``batch x positions`` slots, where
    positions = ``prompt_len + new_tokens - 1`` (every token but the last new one), each holding
    K and V of every layer: ``2 x num_layers x num_kv_heads x d_head x dtype bytes``. Nothing is
    shared: each sequence stores its own copy of a common prefix."""
    return batch * (prompt_len + new_tokens - 1) * cfg.kv_bytes_per_token()


class TokenCounter(RoundObserver):
    """An engine observer that counts every chunk and decode token the engine schedules."""

    def __init__(self) -> None:
        self.work = TokenWork()

    def scheduled(self, seq: object, start: int, num_tokens: int) -> None:
        self.work.add_chunk(start, num_tokens)


@contextmanager
def counting(engine: object) -> Iterator[TokenWork]:
    """Count the chunks ``engine`` computes while the block runs.

    The engine tells its observer (``common/observer.py``) every chunk and decode token it
    schedules, with its first position, in every step, so the count is exact whichever tokens
    the prefix cache saved, and nothing of the engine or the model is replaced. It costs a
    method call per scheduled chunk. ``sampled`` is left for the caller (the tokens it got
    back).
    """
    counter = TokenCounter()
    engine.add_observer(counter)
    try:
        yield counter.work
    finally:
        engine.remove_observer(counter)


def matmul_gflops(device: str = "cpu", n: int = MATMUL_N, repeats: int = 10) -> float:
    """The machine's arithmetic rate: the best of ``repeats`` float32 ``n x n`` matmuls, in
    GFLOP/s, at torch's current thread count. About the most any row could reach: the model's
    own matmuls are smaller (tens to hundreds of rows), so even a row with no overhead stays
    below it."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)  # first call: allocation and kernel selection, not timed
    best = float("inf")
    for _ in range(repeats):
        wait_for(device)  # a GPU runs asynchronously: time only this matmul
        start = time.perf_counter()
        torch.mm(a, b)
        wait_for(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def wait_for(device: str) -> None:
    """Block until ``device`` has finished its queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
