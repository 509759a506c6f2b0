"""step14_7's flat batch: every shape of round attends like one ``forward`` per sequence.

``forward_batched`` runs the decode rows of a round in one padded attention call and its
prefill chunks in another; when one group is the whole round in order (a decode round, or a
prefill round of equal chunks) it skips the gather and scatter of query rows. Each of those
paths must give what per-sequence ``forward`` gives: the same last-token logits and the same
pool (float64, so only a real difference shows).
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from tests.conftest import tiny_config

ROUNDS = {
    # chunk lengths, and the tokens each sequence already has in the pool
    "decode only, equal contexts": ((1, 1, 1, 1), (8, 8, 8, 8)),
    "decode only, ragged contexts": ((1, 1, 1), (3, 12, 7)),
    "prefill only, full chunks": ((4, 4, 4), (0, 4, 8)),
    "prefill only, ragged chunks": ((4, 2, 3), (0, 8, 5)),
    "prefill then decode rows": ((4, 3, 1, 1), (4, 0, 9, 2)),
    "decode rows between chunks": ((1, 4, 1, 2), (6, 0, 11, 8)),
    "one sequence, one token": ((1,), (0,)),
}


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("shape", list(ROUNDS))
def test_every_round_shape_matches_per_sequence_forward(
    step: ModuleType, shape: str, num_kv_heads: int
) -> None:
    if not hasattr(step.TinyTransformerPaged, "forward_batched"):
        pytest.skip("forward_batched arrives in step14_7")
    cfg = tiny_config(num_kv_heads=num_kv_heads)
    chunk_lens, history_lens = ROUNDS[shape]
    rng = random.Random(len(shape))
    blocks = list(range(cfg.total_blocks))
    rng.shuffle(blocks)
    tables = [blocks[i * 6 : (i + 1) * 6] for i in range(len(chunk_lens))]
    histories = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in history_lens]
    chunks = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in chunk_lens]
    batched, serial = step.TinyTransformerPaged(cfg), step.TinyTransformerPaged(cfg)
    for model in (batched, serial):
        for history, table in zip(histories, tables):
            if history:
                model(history, table, 0)
    starts = list(history_lens)
    got = batched.forward_batched(chunks, tables, starts)
    want = torch.stack([serial(c, t, s)[-1] for c, t, s in zip(chunks, tables, starts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(batched.kv_pool_k, serial.kv_pool_k, rtol=0, atol=1e-12)
    torch.testing.assert_close(batched.kv_pool_v, serial.kv_pool_v, rtol=0, atol=1e-12)


def test_index_tensor_round_trips_python_ints(step: ModuleType) -> None:
    index_tensor = getattr(step.model, "index_tensor", None)
    if index_tensor is None:
        pytest.skip("index_tensor arrives in step14_7")
    values = [0, 5, 2**40, 7]
    got = index_tensor(values, torch.device("cpu"))
    assert got.dtype == torch.long and got.tolist() == values
    assert index_tensor([], torch.device("cpu")).shape == (0,)
