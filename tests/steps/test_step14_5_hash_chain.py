"""step14_5's fix: the hash chain lives on ``Sequence``, so each full block is hashed once.

Before step14_5 every cache lookup re-hashes the prompt from its first block, and caching a
block re-hashes the chain up to it. From step14_5 a ``Sequence`` keeps its blocks' chain hashes
(``block_hashes``, vLLM's ``Request.block_hashes``) and extends them as blocks are needed. The
specification: the hashes it keeps are exactly ``common.hashing``'s, and ``hash_block`` runs
once per full block, cold or hot; before the fix, the counts are those of the re-hashing.

    python -m pytest tests/steps/test_step14_5_hash_chain.py -k hashed_once -s   # the counts
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from common import hashing
from tests.helpers import (
    EngineFactory,
    has_fix,
    reference_tokens,
    requires_fix,
    tiny_config,
    tokens,
)

BS = tiny_config().block_size


def count_hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``common.hashing.hash_block`` (every chain link goes through it) with a counter."""
    calls, real = [0], hashing.hash_block

    def counting(parent_hash: int, token_ids: list[int]) -> int:
        calls[0] += 1
        return real(parent_hash, token_ids)

    monkeypatch.setattr(hashing, "hash_block", counting)
    return calls


def test_each_full_block_is_hashed_once_from_step14_5(
    step: ModuleType, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24-block prompt (plus 3 tokens) and 2 new tokens: 25 full blocks in all (the first
    decode token completes block 24). From step14_5 each is hashed once, cold or hot."""
    cfg = tiny_config()
    bs, num_blocks = cfg.block_size, 24
    prompt = [random.Random(5).randrange(cfg.vocab_size) for _ in range(num_blocks * bs + 3)]
    full_blocks = (len(prompt) + 2 - 1) // bs  # every token but the last generated has KV
    lookup_blocks = (len(prompt) - 1) // bs  # blocks before the last prompt token's block
    calls = count_hash_calls(monkeypatch)
    engine = make_engine(cfg)
    counts = []
    for _ in range(2):  # cold, then hot
        calls[0] = 0
        assert engine.generate([prompt], 2) == reference_tokens(cfg, [prompt], 2)
        counts.append(calls[0])
    print(f"{step.__name__}: hash_block calls for a {num_blocks}-block prompt, cold/hot: {counts}")
    if has_fix(step, "step14_5"):
        assert counts == [full_blocks, full_blocks]
    else:
        # Cold: each of the 24 chunks that may still hit re-hashes the 24 lookup blocks, and
        # caching block i re-hashes the chain 0..i. Hot: one lookup hits all 24, then block 24
        # is cached after the first decode token.
        rehash_chains = full_blocks * (full_blocks + 1) // 2
        assert counts == [
            lookup_blocks * lookup_blocks + rehash_chains,
            lookup_blocks + full_blocks,
        ]


def test_a_preempted_request_keeps_its_hash_chain(
    step: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens never change, so a sequence's hashes stay valid across a preemption: from
    step14_5 a request that is preempted and resumed hashes no block again. In a pool that
    makes the engine preempt, hash_block runs once per full block of each request, as it does
    without preemption."""
    requires_fix(step, "step14_5")
    cfg = tiny_config(total_blocks=6)
    prompts = [tokens(595 + i, 2 * BS - 1) for i in range(4)]
    calls = count_hash_calls(monkeypatch)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=3)
    outputs = engine.generate(prompts, 6)
    assert outputs == reference_tokens(cfg, prompts, 6)
    assert engine.stats.preemptions > 0
    full_blocks = sum((len(p) + len(out) - 1) // BS for p, out in zip(prompts, outputs))
    assert calls[0] == full_blocks


def test_sequence_hash_chain_is_the_chain_hash_of_its_tokens(step: ModuleType) -> None:
    """From step14_5 a Sequence keeps its blocks' chain hashes (prompt and output alike):
    extending it to n blocks gives exactly common.hashing's first n hashes, and a later, longer
    extension keeps the earlier links."""
    requires_fix(step, "step14_5")
    prompt = tokens(590, 2 * BS + 1)
    seq = step.Sequence(0, prompt, max_new_tokens=BS + 3)
    seq.extend_block_hashes(1, BS)
    assert seq.block_hashes == hashing.hash_prefix_blocks(prompt, BS)[:1]
    for t in tokens(591, BS + 3):
        seq.generated_ids.append(t)
    seq.extend_block_hashes(3, BS)  # block 2 runs into the output
    assert seq.block_hashes == hashing.hash_prefix_blocks(seq.token_ids, BS)[:3]
    seq.extend_block_hashes(2, BS)
    assert len(seq.block_hashes) == 3
