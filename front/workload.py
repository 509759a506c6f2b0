"""Prompt sets. There is no tokenizer: a prompt is a list of token ids drawn from a seed."""

from __future__ import annotations

import random


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def shared_prefix_prompts(
    num_requests: int, prefix_len: int, tail_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """``num_requests`` prompts: one common prefix (a "system prompt") + a distinct tail each."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    return [prefix + _tokens(rng, tail_len, vocab_size) for _ in range(num_requests)]


def demo_prompts(vocab_size: int, block_size: int = 16) -> list[list[int]]:
    """The chapter's demo: 10 requests sharing a 3-block prefix, each with its own tail."""
    rng = random.Random(14)
    prefix = _tokens(rng, 3 * block_size, vocab_size)
    return [prefix + _tokens(rng, 4 + i, vocab_size) for i in range(10)]


# The memory-pressure workload: short answers asked with a long max_new_tokens.
PRESSURE_PROMPT_LENS = (4, 11)  # shortest and longest prompt, in tokens
PRESSURE_EOS_AT = (5, 12)  # the eos is the answer's own token at one of these positions


def pressure_prompt_lengths(num_requests: int = 24, seed: int = 7) -> list[int]:
    """The lengths of ``pressure_prompts``, without a vocabulary (for the bench's pool check)."""
    rng = random.Random(seed)
    return [
        rng.randrange(PRESSURE_PROMPT_LENS[0], PRESSURE_PROMPT_LENS[1] + 1)
        for _ in range(num_requests)
    ]


def pressure_prompts(
    num_requests: int = 24, vocab_size: int = 1024, seed: int = 7
) -> list[list[int]]:
    """``num_requests`` short unrelated prompts, 4 to 11 tokens each (the pressure workload)."""
    rng = random.Random(seed + 1)
    return [_tokens(rng, n, vocab_size) for n in pressure_prompt_lengths(num_requests, seed)]


def pressure_eos(answers: list[list[int]], seed: int = 7) -> list[int]:
    """One eos id per request, from its own answer: the token the answer has at a seeded
    position 5 to 12. ``answers`` are the first 13 greedy tokens of each prompt (the dense
    reference's), so every request stops within 13 tokens, at the first place its answer
    produces that token."""
    rng = random.Random(seed + 2)
    last = PRESSURE_EOS_AT[1]
    if any(len(answer) <= last for answer in answers):
        raise ValueError(f"pressure_eos needs the first {last + 1} tokens of every answer")
    return [answer[rng.randrange(PRESSURE_EOS_AT[0], last + 1)] for answer in answers]
