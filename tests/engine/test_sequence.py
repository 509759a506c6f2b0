"""Sequence: one request's state, on its own and through a whole life in the engine.

The specification: a sequence carries its token stream (prompt, then output), knows when its
prefill is done and when it must finish (``max_new_tokens`` or any of its eos ids), and moves
WAITING -> PREFILLING (one chunk per round: a block, or from step14_9 on the whole blocks of the
token budget) -> RUNNING (one token per round) ->
FINISHED, with its blocks released. The hash chain that step14_5 keeps on it is specified in
``test_step14_5_hash_chain.py``.
"""

from __future__ import annotations

from types import ModuleType

from common.status import SequenceStatus
from tests.helpers import EngineFactory, budget_args, prefill_chunk, tiny_config, tokens

CFG = tiny_config()
BS = CFG.block_size


def test_sequence_unit(step: ModuleType) -> None:
    """Sequence's own bookkeeping: token stream, last token, prefill done, when it finishes."""
    seq = step.Sequence(0, [1, 2, 3], max_new_tokens=3, eos_token_ids=frozenset({9, 7}))
    assert (seq.prompt_len, seq.num_tokens, seq.last_token_id) == (3, 3, 3)
    assert not seq.is_prefill_done
    seq.prefill_offset = 3
    assert seq.is_prefill_done
    seq.status = step.SequenceStatus.RUNNING
    seq.append_token(4)
    assert (seq.token_ids, seq.num_tokens, seq.last_token_id) == ([1, 2, 3, 4], 4, 4)
    assert seq.status is step.SequenceStatus.RUNNING
    seq.append_token(9)  # eos
    assert seq.status is step.SequenceStatus.FINISHED
    capped = step.Sequence(1, [1], max_new_tokens=2)
    capped.status = step.SequenceStatus.RUNNING
    capped.append_token(0)
    assert capped.status is step.SequenceStatus.RUNNING
    capped.append_token(0)
    assert capped.status is step.SequenceStatus.FINISHED


def test_sequence_moves_waiting_prefilling_running_finished(
    step: ModuleType, make_engine: EngineFactory
) -> None:
    """Each round advances a prefilling sequence by one chunk (prefill_offset is the prompt
    tokens with KV, never more than the prompt): a block, or two under step14_9's budget of two
    blocks; then it decodes one token per round, then it is FINISHED with its blocks
    released."""
    engine = make_engine(**budget_args(step, 2 * BS))
    chunk = prefill_chunk(engine)
    prompt, max_new = tokens(560, 2 * BS + 3), 3
    engine.add_request(prompt, max_new)
    (seq,) = engine.scheduler.waiting
    assert seq.status is SequenceStatus.WAITING and seq.prefill_offset == 0
    seen = []
    while engine.has_work:
        engine.step()
        seen.append((seq.status, seq.prefill_offset, len(seq.generated_ids)))
    ends = [BS, 2 * BS] if chunk == BS else [2 * BS]
    assert ends == list(range(chunk, len(prompt), chunk))
    prefill = [(SequenceStatus.PREFILLING, end, 0) for end in ends]
    assert seen == [
        *prefill,
        (SequenceStatus.RUNNING, len(prompt), 1),
        (SequenceStatus.RUNNING, len(prompt), 2),
        (SequenceStatus.FINISHED, len(prompt), 3),
    ]
    assert seq.block_table == []
