"""BlockManager: the page-frame allocator under every step's engine.

Reference counts are the only thing standing between a shared prefix block and its reuse by
another request, so every misuse must raise at once and leave the pool exactly as it was: a
half-applied bad call would corrupt KV silently, long after the bug that caused it.
``release()``, which step14_6 adds, is specified in ``test_step14_6_release.py``; here its
misuses join the others from step14_6 on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.helpers import assert_raises_unchanged, block_manager_snapshot, has_fix

TOTAL = 6  # small, so random ids often land on blocks in use


def drain_free_ids(bm: object) -> list[int]:
    """The free pool's ids, read through the public API: allocate all of it, give it back.

    Freeing in allocation order restores the pool as it was, so this is safe between rules.
    """
    ids = bm.allocate(bm.num_free)
    bm.free(ids)
    return ids


# ---- unit tests ---------------------------------------------------------------------------------


def test_allocate_gives_distinct_ids_with_ref_count_one(step: ModuleType) -> None:
    """Two owners of one fresh block would overwrite each other's KV."""
    bm = step.BlockManager(TOTAL)
    ids = bm.allocate(4)
    assert len(set(ids)) == 4
    assert all(0 <= b < TOTAL for b in ids)
    assert [bm.ref_count(b) for b in ids] == [1] * 4
    assert bm.num_free == TOTAL - 4
    assert set(bm.allocate(2)).isdisjoint(ids)


def test_free_returns_blocks_to_the_pool(step: ModuleType) -> None:
    """A block whose last owner lets go must be allocatable again, at ref_count 0 meanwhile."""
    bm = step.BlockManager(TOTAL)
    ids = bm.allocate(TOTAL)
    bm.free(ids[:2])
    assert bm.num_free == 2
    assert [bm.ref_count(b) for b in ids[:2]] == [0, 0]
    assert sorted(bm.allocate(2)) == sorted(ids[:2])


def test_retain_adds_an_owner(step: ModuleType) -> None:
    """A retained block survives one free: the other owner still reads it."""
    bm = step.BlockManager(TOTAL)
    (bid,) = bm.allocate(1)
    bm.retain(bid)
    assert bm.ref_count(bid) == 2
    bm.free([bid])
    assert bm.ref_count(bid) == 1
    assert bm.num_free == TOTAL - 1


def test_allocate_beyond_free_pool_raises_and_changes_nothing(step: ModuleType) -> None:
    """All or nothing: a refused allocation must not leak the blocks it could have served."""
    bm = step.BlockManager(TOTAL)
    bm.allocate(TOTAL - 2)
    assert_raises_unchanged(bm, step.NoFreeBlocksError, lambda: bm.allocate(3))
    assert len(bm.allocate(2)) == 2


def test_allocate_zero_is_a_no_op(step: ModuleType) -> None:
    """A request whose whole prompt is a cache hit may need no new block at all."""
    bm = step.BlockManager(TOTAL)
    before = block_manager_snapshot(bm)
    assert bm.allocate(0) == []
    assert block_manager_snapshot(bm) == before


def test_double_free_raises_and_changes_nothing(step: ModuleType) -> None:
    bm = step.BlockManager(TOTAL)
    a, b = bm.allocate(2)
    bm.free([a])
    assert_raises_unchanged(bm, ValueError, lambda: bm.free([a]))
    # The good id in the same call must not be freed either.
    assert_raises_unchanged(bm, ValueError, lambda: bm.free([b, a]))
    assert bm.ref_count(b) == 1


def test_freeing_one_reference_twice_in_one_call_raises(step: ModuleType) -> None:
    """``free([b, b])`` on a ref_count-1 block is a double free even within one call."""
    bm = step.BlockManager(TOTAL)
    (bid,) = bm.allocate(1)
    assert_raises_unchanged(bm, ValueError, lambda: bm.free([bid, bid]))
    bm.retain(bid)
    bm.free([bid, bid])  # two references: now legal
    assert bm.ref_count(bid) == 0
    assert bm.num_free == TOTAL


def test_retaining_a_free_block_raises(step: ModuleType) -> None:
    """A free block may be handed to anyone by the next allocate: it cannot gain an owner."""
    bm = step.BlockManager(TOTAL)
    (bid,) = bm.allocate(1)
    bm.free([bid])
    assert_raises_unchanged(bm, ValueError, lambda: bm.retain(bid))


@pytest.mark.parametrize("bad_id", [-1, TOTAL, TOTAL + 7])
def test_out_of_range_ids_raise(step: ModuleType, bad_id: int) -> None:
    """-1 must not silently mean "the last block" (Python list indexing)."""
    bm = step.BlockManager(TOTAL)
    bm.allocate(TOTAL)  # every in-range block is in use, so only the range check can refuse
    misuses: list[Callable[[], object]] = [
        lambda: bm.ref_count(bad_id),
        lambda: bm.retain(bad_id),
        lambda: bm.free([bad_id]),
    ]
    if has_fix(step, "step14_6"):
        misuses.append(lambda: bm.release(bad_id))
    for misuse in misuses:
        assert_raises_unchanged(bm, ValueError, misuse)


# ---- stateful test against a model of the ref counts -------------------------------------------


def block_manager_machine(step: ModuleType) -> type[RuleBasedStateMachine]:
    """A state machine for ``step``'s BlockManager; ``self.refs`` is the expected ref counts."""

    class BlockManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.bm = step.BlockManager(TOTAL)
            self.refs = [0] * TOTAL

        def expect_misuse(self, error: type[Exception], call: Callable[[], object]) -> None:
            assert_raises_unchanged(self.bm, error, call)

        @rule(n=st.integers(0, TOTAL + 1))
        def allocate(self, n: int) -> None:
            if n > self.refs.count(0):
                self.expect_misuse(step.NoFreeBlocksError, lambda: self.bm.allocate(n))
                return
            ids = self.bm.allocate(n)
            assert len(set(ids)) == n
            assert all(self.refs[b] == 0 for b in ids)
            for b in ids:
                self.refs[b] = 1

        @rule(ids=st.lists(st.integers(0, TOTAL - 1), max_size=4))
        def free(self, ids: list[int]) -> None:
            if any(self.refs[b] < n for b, n in Counter(ids).items()):
                self.expect_misuse(ValueError, lambda: self.bm.free(ids))
                return
            self.bm.free(ids)
            for b in ids:
                self.refs[b] -= 1

        @rule(bid=st.integers(0, TOTAL - 1))
        def retain(self, bid: int) -> None:
            if self.refs[bid] == 0:
                self.expect_misuse(ValueError, lambda: self.bm.retain(bid))
                return
            self.bm.retain(bid)
            self.refs[bid] += 1

        @precondition(lambda self: has_fix(step, "step14_6"))
        @rule(bid=st.integers(0, TOTAL - 1))
        def release(self, bid: int) -> None:
            if self.refs[bid] == 0:
                self.expect_misuse(ValueError, lambda: self.bm.release(bid))
                return
            self.release_owned(bid)

        def release_owned(self, bid: int) -> None:
            """Dropping a last reference through ``release`` may be refused (only ``free``
            returns blocks to the pool) or may free the block; anything else is a bug."""
            if self.refs[bid] == 1:
                try:
                    self.bm.release(bid)
                except ValueError:
                    return
            else:
                self.bm.release(bid)
            self.refs[bid] -= 1

        @rule(bid=st.sampled_from([-1, TOTAL]))
        def out_of_range(self, bid: int) -> None:
            self.expect_misuse(ValueError, lambda: self.bm.retain(bid))
            self.expect_misuse(ValueError, lambda: self.bm.free([bid]))

        @invariant()
        def ref_counts_match_the_model(self) -> None:
            assert [self.bm.ref_count(b) for b in range(TOTAL)] == self.refs

        @invariant()
        def free_plus_in_use_is_total(self) -> None:
            in_use = sum(1 for b in range(TOTAL) if self.bm.ref_count(b) > 0)
            assert self.bm.num_free + in_use == TOTAL

        @invariant()
        def free_pool_holds_exactly_the_unowned_blocks(self) -> None:
            """Every free block has ref_count 0, and no id is both free and in use."""
            before = block_manager_snapshot(self.bm)
            free_ids = drain_free_ids(self.bm)
            # a free block with owners would now read 0:
            assert block_manager_snapshot(self.bm) == before
            assert len(set(free_ids)) == len(free_ids) == self.bm.num_free
            assert sorted(free_ids) == [b for b in range(TOTAL) if self.refs[b] == 0]

    return BlockManagerMachine


def test_block_manager_state_machine(step: ModuleType) -> None:
    """Random sequences of allocate / free / retain (/ release) against expected ref counts."""
    run_state_machine_as_test(
        block_manager_machine(step),
        settings=settings(max_examples=50, stateful_step_count=40, deadline=None),
    )


def test_allocate_a_negative_count_raises_and_changes_nothing(step: ModuleType) -> None:
    """allocate(-1) is a caller's bug, not a request for nothing."""
    bm = step.BlockManager(TOTAL)
    bm.allocate(2)
    assert_raises_unchanged(bm, ValueError, lambda: bm.allocate(-1))


@pytest.mark.parametrize("total", [0, -3])
def test_a_pool_needs_at_least_one_block(step: ModuleType, total: int) -> None:
    with pytest.raises(ValueError, match="total_blocks"):
        step.BlockManager(total)


def test_no_free_blocks_error_says_how_many_are_free(step: ModuleType) -> None:
    """The refusal names what was asked and what is left, and is a RuntimeError."""
    bm = step.BlockManager(TOTAL)
    bm.allocate(TOTAL - 1)
    with pytest.raises(step.NoFreeBlocksError, match=rf"asked for 2 blocks, only 1 of {TOTAL}"):
        bm.allocate(2)
    assert issubclass(step.NoFreeBlocksError, RuntimeError)
    assert len(bm.allocate(1)) == 1  # the last block was not lost


def test_every_block_can_be_allocated_and_freed_in_any_order(step: ModuleType) -> None:
    """All TOTAL blocks come out, each once, and go back whatever order they are freed in."""
    bm = step.BlockManager(TOTAL)
    ids = bm.allocate(TOTAL)
    assert sorted(ids) == list(range(TOTAL)) and bm.num_free == 0
    for block_id in ids[::-1][:2] + ids[:-2]:
        bm.free([block_id])
    assert bm.num_free == TOTAL
    assert sorted(bm.allocate(TOTAL)) == list(range(TOTAL))


def test_peak_used_is_the_high_water_mark(step: ModuleType) -> None:
    """peak_used: the most blocks ever out of the free pool at once; freeing never lowers it."""
    bm = step.BlockManager(TOTAL)
    assert bm.peak_used == 0
    first = bm.allocate(3)
    bm.free(first[:2])
    assert bm.peak_used == 3
    bm.allocate(1)
    assert bm.peak_used == 3
    bm.allocate(3)
    assert bm.peak_used == 5
