"""What a row computed and what it held: model FLOPs, KV memory, and the machine's own limit.

Seconds alone do not say why a row is slow. Next to them ``python -m bench`` prints

- the **model FLOPs** a row really did (``model_flops``): the arithmetic its tokens need, counted
  by one formula for every row, so that FLOPs / seconds says how close a row came to
- the **machine's matmul rate** (``matmul_gflops``): one large float32 matmul at the same thread
  count, about the best this machine does. A row far below it is bound by overhead (Python,
  small kernels, copies), not by arithmetic;
- the **FLOP floor** of the workload (``floor_work``): what any engine must compute at the
  least, every distinct prompt prefix once; at the machine's rate, the time no engine beats;
- the **peak KV memory** a row held: paged blocks for the engine
  (``common.memory.kv_bytes_per_block``), a dense ``[batch, positions]`` cache for a peer
  without one (``dense_kv_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.device import synchronize
from common.memory import linear_params_per_layer
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


def dense_work(
    batch: int, prompt_len: int, new_tokens: int, shared: int = 0, shared_cached: bool = False
) -> TokenWork:
    """What a dense batch of ``batch`` equal-length prompts computes: the first ``shared``
    prompt tokens once for all (CTranslate2's static prompt; none for HF's ``generate``, which
    computes every prompt token, and none at all when ``shared_cached``: a cache held them),
    then each prompt's other tokens, then ``new_tokens - 1`` decode steps (the last new token is
    never fed back); every sequence attends over all of its positions."""
    work = TokenWork(sampled=batch * new_tokens)
    if not shared_cached:
        work.add_chunk(0, shared)
    for _ in range(batch):
        work.add_chunk(shared, prompt_len - shared)
        work.add_chunk(prompt_len, new_tokens - 1)  # one token per step, positions in a row
    return work


def dense_figures(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    shared: int = 0,
    shared_cached: bool = False,
) -> dict[str, int]:
    """A peer's row figures from its dense batch (``dense_work``, ``dense_kv_bytes``)."""
    work = dense_work(batch, prompt_len, new_tokens, shared, shared_cached)
    return {
        "computed_prefill_tokens": work.tokens - batch * (new_tokens - 1),
        "computed_decode_tokens": batch * (new_tokens - 1),
        "kv_peak_bytes": dense_kv_bytes(cfg, batch, prompt_len, new_tokens),
        "flops": model_flops(cfg, work),
    }


def floor_work(prompts: list[list[int]], answers: list[list[int]]) -> TokenWork:
    """The least any engine computes to give ``answers``: every distinct prompt prefix once
    (the nodes of the prompts' trie: a prefix the requests share counts once, as if the best
    possible cache computed it for all), then each answer's tokens but the last, fed back.
    What a paged prefix cache computes on a cold start when the requests leapfrog through a
    shared prefix, block size aside; what a dense batch computes many times over."""
    work = TokenWork(sampled=sum(len(answer) for answer in answers))
    trie: dict[int, dict] = {}
    for prompt in prompts:
        node = trie
        for position, token in enumerate(prompt):
            if token not in node:
                node[token] = {}
                work.add_chunk(position, 1)
            node = node[token]
    for prompt, answer in zip(prompts, answers, strict=True):
        work.add_chunk(len(prompt), max(len(answer) - 1, 0))
    return work


@dataclass(frozen=True)
class Floor:
    """The workload's FLOP floor (``floor_work``) and the machine's matmul rate: together,
    the time no engine could beat on this machine, and the yardstick of every row."""

    flops: int
    machine_gflops: float

    @property
    def seconds(self) -> float:
        return self.flops / (self.machine_gflops * 1e9)

    def multiple(self, seconds: float) -> float:
        """How many times the floor ``seconds`` is."""
        return seconds / self.seconds


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
    """Count the chunks ``engine`` computes while the block runs, from what it tells its
    observer (``common/observer.py``): exact whichever tokens the cache saved, and nothing
    replaced. ``sampled`` is left for the caller (the tokens it got back)."""
    counter = TokenCounter()
    engine.observer.add(counter)
    try:
        yield counter.work
    finally:
        engine.observer.remove(counter)


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
        synchronize(device)  # a GPU runs asynchronously: time only this matmul
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9
