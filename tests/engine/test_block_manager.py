"""The paged KV cache's block bookkeeping: blocks are never shared, never lost, and cover tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.block_manager import BlockManager
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence


def _seq(num_tokens: int) -> Sequence:
    return Sequence(
        request_id="r",
        prompt=None,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(),
        detokenizer=None,  # type: ignore[arg-type]  # never decoded here
    )


def test_blocks_cover_tokens_and_slots_map_into_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(10)
    assert blocks.blocks_needed(seq, 10) == 3
    blocks.allocate(seq, 10)
    seq.num_computed_tokens = 10
    assert len(seq.block_table) == 3 and blocks.num_free_blocks == 5
    assert blocks.blocks_needed(seq, 2) == 0 and blocks.blocks_needed(seq, 3) == 1
    slots = [blocks.slot_of(seq, p) for p in range(10)]
    assert len(set(slots)) == 10
    assert all(slot // 4 == seq.block_table[p // 4] for p, slot in enumerate(slots))
    blocks.free(seq)
    assert seq.block_table == [] and blocks.num_free_blocks == 8 and blocks.usage == 0


def test_over_allocation_is_refused() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    seq = _seq(9)
    assert not blocks.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="2 free blocks, 3 needed"):
        blocks.allocate(seq, 9)
    assert blocks.num_free_blocks == 2


def test_try_allocate_allocates_or_changes_nothing() -> None:
    """The scheduler's one-look check-and-allocate: True and the blocks (a copy of a shared partial
    last block among them) when the free ones suffice, False and nothing changed when not; a token
    landing in a last block held alone needs no free block."""
    blocks = BlockManager(num_blocks=4, block_size=4)
    parent, child = _seq(6), _seq(6)
    assert blocks.try_allocate(parent, 6)
    parent.num_computed_tokens = 6
    blocks.fork(parent, child)
    child.num_computed_tokens = 6
    shared = list(parent.block_table)
    assert not blocks.try_allocate(child, 7), "its last block copied and two more: 3 blocks, 2 free"
    assert child.block_table == shared and blocks.num_free_blocks == 2 and blocks.take_copies() == []
    assert blocks.try_allocate(child, 1)
    assert child.block_table[0] == shared[0] and child.block_table[1] not in shared
    assert blocks.take_copies() == [(shared[1], child.block_table[1])] and blocks.num_free_blocks == 1
    child.num_computed_tokens = 7
    other = _seq(0)
    assert blocks.try_allocate(other, 4)  # the last free block goes: none is left
    assert blocks.num_free_blocks == 0
    assert blocks.try_allocate(child, 1) and blocks.try_allocate(parent, 1), "each writes a last block it holds alone"
    assert blocks.take_copies() == [] and not blocks.try_allocate(parent, 3)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        BlockManager(num_blocks=0, block_size=16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.booleans()), min_size=1, max_size=40))
def test_random_grow_and_free_never_shares_or_loses_a_block(ops: list[tuple[int, int, bool]]) -> None:
    blocks = BlockManager(num_blocks=16, block_size=3)
    seqs = [_seq(0) for _ in range(6)]
    for index, grow, free in ops:
        seq = seqs[index]
        if free:
            blocks.free(seq)
            seq.num_computed_tokens = 0
        elif blocks.can_allocate(seq, grow):
            blocks.allocate(seq, grow)
            seq.num_computed_tokens += grow
        owned = [b for s in seqs for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + blocks.num_free_blocks == 16, "a block was lost"
        for s in seqs:
            assert len(s.block_table) == -(-s.num_computed_tokens // 3)
