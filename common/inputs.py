"""What a request may be: the input checks of every step's engine, in one place.

``check_request`` is called once per request, before the request touches the engine: a bad
one raises ``ValueError`` saying what is wrong, and the engine's state stays as it was (for
``generate``, all prompts are checked before any is queued: all or nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import RequestError
from .numbers import is_int
from .sampling import SamplingParams


def cdiv(a: int, b: int) -> int:
    """Ceiling division (vLLM's ``cdiv``): the blocks that ``a`` tokens fill at ``b`` a block."""
    return -(-a // b)


def blocks_for_request(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Blocks a request holds at the end of its longest life: every token whose KV is written
    (the last generated token is never fed back, so it needs no slot)."""
    return cdiv(prompt_len + max_new_tokens - 1, block_size)


@dataclass(frozen=True)
class Request:
    """A request that passed the checks, in the engine's own types."""

    prompt_ids: list[int]
    max_new_tokens: int
    # eos ids and the request's stop_token_ids: any of them ends it (finish_reason "stop")
    eos_token_ids: frozenset[int]
    sampling_params: SamplingParams


def check_request(
    prompt_ids: object,
    max_new_tokens: object,
    eos_token_id: object,
    cfg: ModelConfig,
    sampling_params: object = None,
) -> Request:
    """The request as plain ints, or ``ValueError`` naming what is wrong with it."""
    vocab = cfg.vocab_size
    prompt = as_token_list(prompt_ids)
    if not prompt:
        raise ValueError("prompt is empty: a request needs at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    params = as_sampling_params(max_new_tokens, sampling_params)
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        raise ValueError(
            f"SamplingParams.stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab})"
        )
    stop = as_eos_ids(eos_token_id, vocab) | frozenset(params.stop_token_ids)
    check_context_length(len(prompt), params.max_tokens, cfg)
    need = blocks_for_request(len(prompt), params.max_tokens, cfg.block_size)
    if need > cfg.total_blocks:
        raise ValueError(
            f"request needs {need} blocks ({len(prompt)} prompt + {params.max_tokens} new "
            f"tokens at block_size={cfg.block_size}) but the pool has only "
            f"{cfg.total_blocks}: it could never run"
        )
    return Request(prompt, params.max_tokens, stop, params)


def as_sampling_params(max_new_tokens: object, sampling_params: object) -> SamplingParams:
    """The request's ``SamplingParams``: the one given, or greedy decoding of
    ``max_new_tokens`` tokens (the chapter's API); one of them, and not both, since they could
    disagree (no default length: vLLM's 16 tokens would surprise a reader of the chapter)."""
    if sampling_params is None:
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be an integer >= 1 (or give sampling_params), "
                f"got {max_new_tokens!r}"
            )
        return SamplingParams(max_tokens=int(max_new_tokens))
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(
            f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
        )
    if max_new_tokens is not None:
        raise ValueError(
            "give max_new_tokens or sampling_params (its max_tokens), not both: "
            f"got {max_new_tokens!r} and {sampling_params.max_tokens}"
        )
    return sampling_params


def check_context_length(prompt_len: int, max_new_tokens: int, cfg: ModelConfig) -> None:
    """A request must fit in the positions the model knows: prompt + max_new_tokens at most
    ``cfg.max_model_len`` (vLLM's rule; a checkpoint's ``max_position_embeddings``). Past it a
    model computes, but at positions it was never trained on."""
    limit = cfg.max_model_len
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise RequestError(
            f"a prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = "
            f"{prompt_len + max_new_tokens} is past the model's context length of {limit} "
            f"tokens (max_position_embeddings): shorten the prompt, lower max_new_tokens "
            f"(--max-new-tokens), or raise max_model_len (--max-model-len) at your own risk"
        )


def check_requests(
    prompts: object,
    max_new_tokens: object,
    eos_token_id: object,
    cfg: ModelConfig,
    sampling_params: object = None,
) -> list[Request]:
    """``check_request`` for every prompt of a batch, before any is queued: a bad one leaves
    the engine untouched. The checked requests are what the engine queues (a prompt given as
    a one-shot iterator is read once). ``sampling_params``: one for all, or one per prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(sampling_params)} sampling_params for {len(prompts)} prompts: give one "
                "for all, or one per prompt"
            )
        per_prompt = list(sampling_params)
    else:
        per_prompt = [sampling_params] * len(prompts)
    return [
        check_request(p, max_new_tokens, eos_token_id, cfg, params)
        for p, params in zip(prompts, per_prompt, strict=True)
    ]


def as_token_list(prompt_ids: object) -> list[int]:
    """A prompt (a list, tuple, 1-D integer tensor, any iterable of ints) as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError("a prompt tensor must be 1-D with an integer dtype")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt_ids).__name__}")
    tokens = list(prompt_ids)
    if not all(is_int(t) for t in tokens):
        raise ValueError("prompt token ids must be integers")
    return [int(t) for t in tokens]


def as_eos_ids(eos_token_id: object, vocab_size: int) -> frozenset[int]:
    """``None``, one id, or a collection of ids (Llama 3 lists several), as a set of ids."""
    if eos_token_id is None:
        return frozenset()
    if is_int(eos_token_id):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, Iterable):
        ids = [eos_token_id]  # refused below
    elif getattr(eos_token_id, "ndim", 1) != 1:
        ids = [eos_token_id]  # a tensor or array that is a non-integer scalar or a matrix
    else:
        ids = list(eos_token_id)
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(
            f"eos_token_id must be None, a token id or a collection of token ids in "
            f"[0, {vocab_size}), got {eos_token_id!r}"
        )
    return frozenset(int(t) for t in ids)
