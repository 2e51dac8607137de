"""Properties of the per-step metadata builder (CPU; the same code runs on CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import LoRAMeta
from kernels.meta import TILE_BLOCK_SIZES


@st.composite
def steps(draw):
    """(max_slots, max_num_tokens, [slot lists of successive steps]) for one reused metadata object."""
    max_slots = draw(st.integers(1, 20))
    max_tokens = draw(st.integers(1, 80))
    step = st.lists(st.integers(-1, max_slots - 1), min_size=0, max_size=max_tokens)
    return max_slots, max_tokens, draw(st.lists(step, min_size=1, max_size=3))


def _check_step(meta: LoRAMeta, slots: list[int]) -> None:
    num_tokens = len(slots)
    assert meta.num_tokens == num_tokens
    order = meta.token_indices[:num_tokens].tolist()
    assert sorted(order) == list(range(num_tokens))
    # Grouped by slot (-1 first) and stable within a slot.
    assert [(slots[t], t) for t in order] == sorted((s, t) for t, s in enumerate(slots))
    assert meta.token_slots[:num_tokens].tolist() == slots

    counts = meta.slot_counts.tolist()
    starts = meta.slot_starts.tolist()
    for s in range(meta.max_slots):
        assert counts[s] == slots.count(s)
        assert starts[s] == sum(1 for v in slots if v < s)
        assert all(slots[t] == s for t in order[starts[s] : starts[s] + counts[s]])
    used = sorted({s for s in slots if s >= 0})
    assert meta.active_slots.tolist() == used + [-1] * (meta.max_slots - len(used))
    assert int(meta.num_active) == len(used)
    assert meta.host_groups() == [(s, starts[s], starts[s] + counts[s]) for s in used]

    for block_m in TILE_BLOCK_SIZES:
        tile_slot, tile_start, tile_end = (t.tolist() for t in meta.tiles(block_m))
        grid = meta.grid_tiles(block_m)
        assert grid <= len(tile_slot)
        real = [i for i in range(grid) if tile_slot[i] >= 0]
        assert real == list(range(len(real))), "real tiles come first, padding after"
        covered = []
        for i in real:
            s = tile_slot[i]
            assert 1 <= tile_end[i] - tile_start[i] <= block_m
            assert starts[s] <= tile_start[i] and tile_end[i] <= starts[s] + counts[s]
            covered.extend(range(tile_start[i], tile_end[i]))
        first_adapter_position = slots.count(-1)
        assert covered == list(range(first_adapter_position, num_tokens)), "every adapter token once, in order"


@settings(max_examples=150, deadline=None)
@given(steps())
@pytest.mark.slow
def test_prepare_groups_tokens_by_slot(case) -> None:
    max_slots, max_tokens, step_slots = case
    meta = LoRAMeta(max_tokens, max_slots)
    for slots in step_slots:  # reused across steps: nothing of an earlier step may leak
        meta.prepare(torch.tensor(slots, dtype=torch.int64))
        _check_step(meta, slots)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_prepare_accepts_any_integer_dtype(dtype: torch.dtype) -> None:
    slots = [2, -1, 0, 2]
    meta = LoRAMeta.build(torch.tensor(slots, dtype=dtype), max_slots=3)
    _check_step(meta, slots)


@pytest.mark.parametrize(
    ("slots", "error", "message"),
    [
        (torch.tensor([[0, 1]]), ValueError, "must be 1-D"),
        (torch.tensor([0.0, 1.0]), TypeError, "integer tensor"),
        (torch.tensor([True]), TypeError, "integer tensor"),
        (torch.tensor([0, 4]), ValueError, r"\[-1, 4\), got values from 0 to 4"),
        (torch.tensor([-2, 0]), ValueError, r"\[-1, 4\), got values from -2 to 0"),
        (torch.zeros(9, dtype=torch.int64), ValueError, "9 tokens exceed this metadata's max_num_tokens=8"),
    ],
)
def test_prepare_rejects_bad_slots(slots: torch.Tensor, error: type, message: str) -> None:
    meta = LoRAMeta(max_num_tokens=8, max_slots=4)
    with pytest.raises(error, match=message):
        meta.prepare(slots)


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1"):
        LoRAMeta(0, 4)
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        LoRAMeta(4, 0)


def test_unknown_tile_size_is_refused() -> None:
    meta = LoRAMeta.build(torch.tensor([0]), max_slots=1)
    with pytest.raises(ValueError, match="block_m must be one of"):
        meta.tiles(32)
