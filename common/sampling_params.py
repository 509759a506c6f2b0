"""Sampling's data: what a request asks for (``SamplingParams``) and what each round hands back
(``RequestOutput``, with ``TokenLogprobs`` when asked). The sampler that computes them, shared
by every step, is ``sampler.py`` (vLLM splits them the same way: ``sampling_params.py`` and
``v1/sample/sampler.py``).

vLLM's names with vLLM's meanings, and vLLM's checks: a bad value is refused when the
``SamplingParams`` is made, naming its field. Every field has the default that changes nothing,
so a request that sets none of the newer ones (penalties, ``min_p``, ``min_tokens``, logprobs)
is decoded exactly as before they existed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from .errors import RequestError
from .numbers import is_int, is_number

FinishReason = Literal["stop", "length", "abort"]
MAX_SEED = 2**63  # seeds are in [0, MAX_SEED): what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How a request is decoded (vLLM's ``SamplingParams``, the fields this engine needs).

    Args:
        max_tokens: the most tokens to generate.
        temperature: 0 is greedy (the argmax); higher flattens the distribution.
        top_p: keep the most likely tokens whose probabilities add up to ``top_p`` (1: all).
        top_k: keep the k most likely tokens (0 or -1: all).
        seed: the request's own seed (None: the engine gives it one from its seeded generator).
        stop_token_ids: ids that end the request like eos does (``finish_reason`` "stop").
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the request has
            generated at least once (> 0: new tokens rather than repeats).
        frequency_penalty: in [-2, 2]; subtracted once per time the request generated a token.
        repetition_penalty: > 0; every token of the prompt or the output has a positive logit
            divided by it, a negative one multiplied (> 1: fewer repeats; 1: off).
        min_p: in [0, 1]; after the temperature, a token whose probability is below ``min_p``
            times the most likely token's is dropped (0: off).
        min_tokens: until the request has generated this many tokens (at most ``max_tokens``),
            its eos and stop ids cannot be drawn.
        logprobs: return, for every generated token, its log-probability and those of the
            ``logprobs`` most likely tokens (0: the token's own only; None: nothing).
        prompt_logprobs: the same for every prompt token but the first, scored once
            (``scoring.py``). Such a request does not read the prefix cache (vLLM's rule,
            ``skip_reading_prefix_cache``); its blocks are still cached for others.

    The penalties and ``min_tokens`` apply to greedy requests too, before the argmax (vLLM's
    order); logprobs are the model's own (vLLM's default ``logprobs_mode``, "raw_logprobs"):
    log_softmax of its logits before any penalty, temperature or filter. ``sampler.py`` says
    how each is computed, and in which order.

    Raises:
        RequestError: (a ``ValueError``) a bad value, naming the field in its message and in
            its ``param``, when the object is made.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name, (ok, what) in self._checks().items():
            if not ok:
                got = getattr(self, name)
                raise RequestError(f"SamplingParams.{name} must be {what}, got {got!r}", name)
        stop = as_stop_ids(self.stop_token_ids)
        set_fields = object.__setattr__  # frozen: normalize once, here
        for name in ("temperature", "top_p", "min_p", *PENALTIES):
            set_fields(self, name, float(getattr(self, name)))
        for name in ("max_tokens", "min_tokens"):
            set_fields(self, name, int(getattr(self, name)))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            set_fields(self, name, None if value is None else int(value))
        set_fields(self, "top_k", max(int(self.top_k), 0))
        set_fields(self, "stop_token_ids", stop)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Does the request compute every prompt position, adopting nothing from the prefix
        cache? vLLM's rule for one that asks for its prompt's logprobs: each position's logits
        are needed. Its blocks are still cached for the others."""
        return self.prompt_logprobs is not None

    def _checks(self) -> dict[str, tuple[bool, str]]:
        """Each field: is its value good, and what a good one is (vLLM's ranges)."""

        def count_or_none(value: object) -> bool:
            return value is None or (is_int(value) and value >= 0)

        def penalty(value: object) -> bool:
            return is_number(value) and -2 <= value <= 2

        return {
            "max_tokens": (is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            "temperature": (is_number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            "top_p": (is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            "top_k": (is_int(self.top_k) and self.top_k >= -1, "an integer >= 1, or 0 or -1 (all)"),
            "seed": (
                self.seed is None or (is_int(self.seed) and 0 <= self.seed < MAX_SEED),
                "None or an integer in [0, 2**63)",
            ),
            "presence_penalty": (penalty(self.presence_penalty), "a number in [-2, 2]"),
            "frequency_penalty": (penalty(self.frequency_penalty), "a number in [-2, 2]"),
            "repetition_penalty": (
                is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                "a number > 0",
            ),
            "min_p": (is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            "min_tokens": (
                is_int(self.min_tokens)
                and 0 <= self.min_tokens <= (self.max_tokens if is_int(self.max_tokens) else 0),
                f"an integer in [0, max_tokens] (max_tokens is {self.max_tokens!r})",
            ),
            "logprobs": (count_or_none(self.logprobs), "None or an integer >= 0"),
            "prompt_logprobs": (count_or_none(self.prompt_logprobs), "None or an integer >= 0"),
        }

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Does any penalty change the logits? (All off, the sampler skips them.)"""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities at one place of a request: its token's, and the most likely
    tokens' (vLLM's ``Logprob`` entries of one position, flattened). Raw: log_softmax of the
    model's logits there, before any penalty, temperature or filter (vLLM's default
    ``logprobs_mode``)."""

    token_id: int  # the token at this place
    logprob: float  # its log-probability (raw: log_softmax of the model's logits)
    top: tuple[tuple[int, float], ...]  # the N most likely (id, logprob), most likely first


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
    # One per id of ``new_token_ids`` (this round's only) when the request asked for
    # ``logprobs``; None when it did not.
    logprobs: list[TokenLogprobs] | None = None
    # One per prompt token, the first None (nothing comes before it), when the request asked
    # for ``prompt_logprobs``: handed out once, on the output that carries its first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, next_output: RequestOutput) -> RequestOutput:
        """This output and the request's next one as one (for a reader who took neither): the
        next one's state, with the new tokens and their logprobs of both, and the prompt's
        logprobs if either carries them. (vLLM's ``RequestOutput.add`` merges in place; this one
        is frozen, so it returns the merge.)"""
        logprobs = next_output.logprobs
        return replace(
            next_output,
            new_token_ids=self.new_token_ids + next_output.new_token_ids,
            logprobs=None if logprobs is None else (self.logprobs or []) + logprobs,
            prompt_logprobs=self.prompt_logprobs or next_output.prompt_logprobs,
        )


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
