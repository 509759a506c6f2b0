"""What a request may be: the input checks of every step's engine, in one place.

``check_request`` is called once per request, before the request touches the engine: a bad
one raises ``RequestError`` (a ``ValueError``) saying what is wrong and naming the argument in
its ``param``, and the engine's state stays as it was (for ``generate``, all prompts are checked
before any is queued: all or nothing). The two rules about size, ``check_context_length`` and
``check_fits_pool``, are the ones every front end calls too, before it loads anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import ContextLengthError, RequestError
from .numbers import cdiv, is_int
from .sampling_params import SamplingParams


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
    """The request as plain ints, or ``RequestError`` naming what is wrong with it."""
    vocab = cfg.vocab_size
    prompt = as_token_list(prompt_ids)
    if not prompt:
        raise RequestError("prompt is empty: a request needs at least one token", "prompt_ids")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt_ids"
        )
    params = as_sampling_params(max_new_tokens, sampling_params)
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        raise RequestError(
            f"SamplingParams.stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab})",
            "stop_token_ids",
        )
    for name in ("logprobs", "prompt_logprobs"):  # vLLM refuses past its max_logprobs
        asked = getattr(params, name)
        if asked is not None and asked > vocab:
            raise RequestError(
                f"SamplingParams.{name} {asked} asks for more tokens than the vocabulary's {vocab}",
                name,
            )
    stop = as_eos_ids(eos_token_id, vocab) | frozenset(params.stop_token_ids)
    check_context_length(len(prompt), params.max_tokens, cfg)
    check_fits_pool(len(prompt), params.max_tokens, cfg)
    return Request(prompt, params.max_tokens, stop, params)


def check_fits_pool(prompt_len: int, max_new_tokens: int, cfg: ModelConfig) -> None:
    """A request must fit in the KV pool alone, at the end of its longest life: admitted, it
    could otherwise never finish, however many others were preempted for it."""
    need = blocks_for_request(prompt_len, max_new_tokens, cfg.block_size)
    if need <= cfg.total_blocks:
        return
    prompt_fits = blocks_for_request(prompt_len, 1, cfg.block_size) <= cfg.total_blocks
    raise RequestError(
        f"a request of {prompt_len} prompt + {max_new_tokens} new tokens needs {need} KV "
        f"blocks of {cfg.block_size} tokens, and the pool has {cfg.total_blocks}: raise "
        f"total_blocks (--total-blocks) to at least {need}"
        + (", or lower max_new_tokens (--max-new-tokens)" if prompt_fits else ""),
        "max_new_tokens" if prompt_fits else "prompt_ids",
    )


def check_token_budget(max_num_batched_tokens: object, block_size: int, max_running: int) -> int:
    """A round's token budget (step14_9's ``max_num_batched_tokens``, vLLM's name): an int that
    holds a block of prefill beside a decode token of every other running request, since a
    prefill chunk is whole blocks (vLLM's need not be; it asks for at least ``max_num_seqs``).
    Returns it; ``ValueError`` naming the field otherwise."""
    least = block_size + max_running - 1
    if not is_int(max_num_batched_tokens) or max_num_batched_tokens < least:
        raise ValueError(
            f"max_num_batched_tokens must be an int >= block_size + max_running - 1 = {least} "
            f"(a block of prefill beside every other running request's decode token), got "
            f"{max_num_batched_tokens!r}"
        )
    return int(max_num_batched_tokens)


def as_sampling_params(max_new_tokens: object, sampling_params: object) -> SamplingParams:
    """The request's ``SamplingParams``: the one given, or greedy decoding of
    ``max_new_tokens`` tokens (the chapter's API); one of them, and not both, since they could
    disagree (no default length: vLLM's 16 tokens would surprise a reader of the chapter)."""
    if sampling_params is None:
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise RequestError(
                f"max_new_tokens must be an integer >= 1 (or give sampling_params), "
                f"got {max_new_tokens!r}",
                "max_new_tokens",
            )
        return SamplingParams(max_tokens=int(max_new_tokens))
    if not isinstance(sampling_params, SamplingParams):
        raise RequestError(
            f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}",
            "sampling_params",
        )
    if max_new_tokens is not None:
        raise RequestError(
            "give max_new_tokens or sampling_params (its max_tokens), not both: "
            f"got {max_new_tokens!r} and {sampling_params.max_tokens}",
            "max_new_tokens",
        )
    return sampling_params


def check_context_length(prompt_len: int, max_new_tokens: int, cfg: ModelConfig) -> None:
    """A request must fit in the positions the model knows: prompt + max_new_tokens at most
    ``cfg.max_model_len`` (vLLM's rule; by default a checkpoint's ``max_position_embeddings``).
    Past it a model computes, but at positions it was never trained on."""
    limit = cfg.max_model_len
    if limit is None or prompt_len + max_new_tokens <= limit:
        return
    raise ContextLengthError(
        f"a prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = "
        f"{prompt_len + max_new_tokens} is past the model's context length of {limit} tokens "
        f"({context_length_source(cfg)}): shorten the prompt, lower max_new_tokens "
        f"(--max-new-tokens), or raise max_model_len (--max-model-len)",
        prompt_len,
        max_new_tokens,
        limit,
    )


def context_length_source(cfg: ModelConfig) -> str:
    """Where ``cfg.max_model_len`` came from, for the message that refuses a request."""
    trained = cfg.max_position_embeddings
    if trained is None:
        return "max_model_len, set by the caller (--max-model-len)"
    if cfg.max_model_len == trained:
        return "the checkpoint's max_position_embeddings"
    return f"max_model_len (--max-model-len); the checkpoint was trained on {trained} positions"


def long_context_warning(cfg: ModelConfig) -> str | None:
    """A ``max_model_len`` past the positions the checkpoint was trained on is allowed (vLLM
    allows it too, when asked), but deserves a word: the model never saw those positions."""
    trained, limit = cfg.max_position_embeddings, cfg.max_model_len
    if trained is None or limit is None or limit <= trained:
        return None
    return (
        f"max_model_len {limit} is past the {trained} positions the checkpoint was trained on "
        "(its max_position_embeddings): a longer request runs the model on positions it never "
        "saw, and its text may fall apart"
    )


def check_requests(
    prompts: object,
    max_new_tokens: object,
    eos_token_id: object,
    cfg: ModelConfig,
    sampling_params: object = None,
    labels: list[str] | None = None,
) -> list[Request]:
    """``check_request`` for every prompt of a batch, before any is queued: a bad one leaves
    the engine untouched. The checked requests are what the engine queues (a prompt given as
    a one-shot iterator is read once). ``sampling_params``: one for all, or one per prompt.
    ``labels``: how an error names each prompt (the text front end's ``prompt 2 ('...')``)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise RequestError(
            f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}",
            "prompts",
        )
    prompts = list(prompts)
    per_prompt = sampling_params_per_prompt(sampling_params, len(prompts))
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, per_prompt, strict=True)):
        try:
            requests.append(check_request(prompt, max_new_tokens, eos_token_id, cfg, params))
        except RequestError as exc:
            if labels is not None:  # the same error, and which prompt it is about
                exc.args = (f"{labels[i]}: {exc}",)
            raise
    return requests


def sampling_params_per_prompt(sampling_params: object, num_prompts: int) -> list[object]:
    """``sampling_params`` for each of ``num_prompts`` prompts: one (or None) for all, or a
    list with one per prompt; a list of another length, a single item too, is refused (vLLM's
    rule: which prompt it was meant for cannot be told)."""
    if not isinstance(sampling_params, (list, tuple)):
        return [sampling_params] * num_prompts
    if len(sampling_params) != num_prompts:
        raise RequestError(
            f"{len(sampling_params)} sampling_params for {num_prompts} prompts: give one "
            "SamplingParams for all, or a list with one per prompt",
            "sampling_params",
        )
    return list(sampling_params)


def as_token_list(prompt_ids: object) -> list[int]:
    """A prompt (a list, tuple, 1-D integer tensor, any iterable of ints) as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise RequestError("a prompt tensor must be 1-D with an integer dtype", "prompt_ids")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
        raise RequestError(
            f"prompt must be a sequence of token ids, got {type(prompt_ids).__name__}",
            "prompt_ids",
        )
    tokens = list(prompt_ids)
    if not all(is_int(t) for t in tokens):
        raise RequestError("prompt token ids must be integers", "prompt_ids")
    return [int(t) for t in tokens]


def as_eos_ids(eos_token_id: object, vocab_size: int | None) -> frozenset[int]:
    """``None``, one id, or a collection of ids (Llama 3 lists several), as a set of ids in
    ``[0, vocab_size)`` (``vocab_size`` None: any id >= 0, the model not known yet)."""
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
    end = math.inf if vocab_size is None else vocab_size
    if not all(is_int(t) and 0 <= t < end for t in ids):
        raise RequestError(
            f"eos_token_id must be None, a token id or a collection of token ids in "
            f"[0, {end}), got {eos_token_id!r}",
            "eos_token_id",
        )
    return frozenset(int(t) for t in ids)
