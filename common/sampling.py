"""Sampling: what a request asks for (``SamplingParams``), what each round hands back
(``RequestOutput``), and the sampler every step shares.

vLLM's names throughout. Greedy (``temperature=0``, the default) takes the argmax, as the
chapter does. Otherwise the logits go through the filters Hugging Face applies, in its order
(temperature, then top-k, then top-p), and a token is drawn from what is left.

The draw is what makes this engine's sampling special: the k-th token of a request is drawn with
a generator seeded by (the request's seed, k) and nothing else. No generator is shared between
requests or carried from round to round, so batching, preemption (a resumed request recomputes
its KV but never draws a token again) and the prefix cache cannot change which token comes out:
every step samples the same tokens, and the suite checks it as it checks greedy decoding.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from .errors import RequestError
from .numbers import is_int, is_number

FinishReason = Literal["stop", "length", "abort"]
MAX_SEED = 2**63  # seeds are in [0, MAX_SEED): what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How a request is decoded (vLLM's ``SamplingParams``, the fields this engine needs).

    ``max_tokens``: the most tokens to generate. ``temperature``: 0 is greedy; higher flattens
    the distribution. ``top_k``: keep the k most likely tokens (0 or -1: all). ``top_p``: keep
    the most likely tokens whose probabilities add up to ``top_p`` (1: all). ``seed``: the
    request's own seed (None: the engine gives it one from its seeded generator).
    ``stop_token_ids``: ids that end the request like eos does (``finish_reason`` "stop").
    A bad value raises ``RequestError`` (a ``ValueError``) naming the field in its message and
    in its ``param``, when the object is made.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check = {
            "max_tokens": (is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            "temperature": (is_number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            "top_p": (is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            "top_k": (is_int(self.top_k) and self.top_k >= -1, "an integer >= 1, or 0 or -1 (all)"),
            "seed": (
                self.seed is None or (is_int(self.seed) and 0 <= self.seed < MAX_SEED),
                "None or an integer in [0, 2**63)",
            ),
        }
        for name, (ok, what) in check.items():
            if not ok:
                got = getattr(self, name)
                raise RequestError(f"SamplingParams.{name} must be {what}, got {got!r}", name)
        stop = as_stop_ids(self.stop_token_ids)
        set_fields = object.__setattr__  # frozen: normalize once, here
        set_fields(self, "max_tokens", int(self.max_tokens))
        set_fields(self, "temperature", float(self.temperature))
        set_fields(self, "top_p", float(self.top_p))
        set_fields(self, "top_k", max(int(self.top_k), 0))
        set_fields(self, "seed", None if self.seed is None else int(self.seed))
        set_fields(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class RequestOutput:
    """What a round did for one request (vLLM's ``RequestOutput``, flattened): the tokens it
    produced this round, all it has produced so far, and whether and why it ended."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None  # "stop": eos or a stop id; "length": max_tokens
    # Prompt tokens whose KV came from the prefix cache instead of the model (vLLM's
    # ``num_cached_tokens``): what an OpenAI server reports as ``cached_tokens``.
    num_cached_tokens: int = 0


def as_stop_ids(ids: object) -> tuple[int, ...]:
    """A collection of token ids (a list, like vLLM's), as a tuple of ints."""
    ok = not isinstance(ids, (str, bytes)) and isinstance(ids, Iterable)
    ids = list(ids) if ok else ids
    if not ok or not all(is_int(t) and t >= 0 for t in ids):
        raise RequestError(
            f"SamplingParams.stop_token_ids must be a list of token ids (ints >= 0), got {ids!r}",
            "stop_token_ids",
        )
    return tuple(int(t) for t in ids)


GREEDY = SamplingParams()  # the chapter's decoding: the argmax, 16 tokens unless told


def with_seed(params: SamplingParams, seeds: random.Random) -> SamplingParams:
    """``params`` with a seed: its own, or the next of the engine's generator, so that a run
    without seeds is reproducible too (requests are queued in the same order in every step)."""
    if params.seed is not None:
        return params
    return replace(params, seed=seeds.randrange(MAX_SEED))


# ---- the sampler ---------------------------------------------------------------------------


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Hugging Face's warpers, one row per request: divide by the temperature, then keep the
    top-k, then the top-p; a token filtered out gets -inf. Rows are independent, so a row gives
    the same numbers alone or in a batch."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    # top-k: every token at least as likely as the k-th (ties at the k-th all stay)
    k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).clamp(max=vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, -math.inf)
    # top-p: drop the least likely tokens while what they add up to is at most 1 - top_p
    ascending, order = logits.sort(dim=-1)
    tail = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = tail <= torch.tensor([1 - p.top_p for p in params], device=logits.device)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    return logits.masked_fill(drop.scatter(1, order, drop), -math.inf)


def draw_generator(seed: int, k: int) -> torch.Generator:
    """The generator of a request's k-th draw: seeded by (seed, k) alone. A hash, so that
    (seed 1, token 0) and (seed 0, token 1) do not share their numbers."""
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % MAX_SEED)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]: row i belongs to a request decoded with
    ``params[i]``, and the token is its ``steps[i]``-th (0 for the first generated token).

    Greedy rows take the argmax. The others are drawn by an exponential race (vLLM's way):
    token i wins ``argmax(p_i / E_i)`` with E_i ~ Exp(1), which happens with probability p_i
    exactly. The E_i come from the row's own generator, on the CPU, so a GPU run draws the same.
    """
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        probs = filter_logits(logits[drawn], [params[i] for i in drawn]).softmax(dim=-1)
        race = torch.stack(
            [exponentials(params[i].seed, steps[i], probs.shape[-1]) for i in drawn]
        ).to(probs.device)
        tokens[drawn] = (probs / race).argmax(dim=-1).to(tokens.dtype)
    return tokens.tolist()


def exponentials(seed: int | None, k: int, vocab: int) -> torch.Tensor:
    """``vocab`` draws of Exp(1) for a request's k-th token, never 0 (p / 0 would win)."""
    if seed is None:
        raise ValueError("a sampled request needs a seed (the engine gives one: with_seed)")
    race = torch.empty(vocab).exponential_(generator=draw_generator(seed, k))
    return race.clamp_min_(torch.finfo(race.dtype).tiny)
