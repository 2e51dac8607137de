"""Every path of the torch reference (a grid over a run of active slots or over a span with idle slots,
padded or not; groups run one by one; both at once) against a plain fp64 per-token oracle."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_cases import UNIT_ROUNDOFF, Case, make_case

import kernels.cpu_lora as cpu_lora
from kernels import LoRAMeta, lora_apply_sliced

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def oracle(case: Case, slot_ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, bound)``: ``y0 + scaling[s] * B[s, :, :r] @ (A[s, :r] @ x[t])`` token by token in
    fp64, and how far one correct implementation may be from it.

    Bound per element, with ``M`` the magnitude of everything summed into it: fp32 summation of the
    shrink (K terms), the expand (r terms), the scaling and the final add, each ``2^-24 M`` per
    term; for bf16/fp16 also one rounding of ``h`` and one of the output, ``u M`` each."""
    exact = case.y.double().clone()
    magnitude = case.y.double().abs().clone()
    hidden = case.x.shape[1]
    for t, slot in enumerate(case.slots.tolist()):
        rank = slot_ranks[slot] if slot >= 0 else 0
        if rank == 0:
            continue
        x = case.x[t].double()
        scale = float(case.scaling[slot])
        for A, B, offset in zip(case.As, case.Bs, case.offsets):
            a, b = A[slot, :rank].double(), B[slot, :, :rank].double()
            columns = slice(offset, offset + B.shape[1])
            exact[t, columns] += scale * (b @ (a @ x))
            magnitude[t, columns] += abs(scale) * (b.abs() @ (a.abs() @ x.abs()))
    max_rank = max(slot_ranks, default=0)
    rounding = 0.0 if case.x.dtype == torch.float32 else 2 * UNIT_ROUNDOFF[case.x.dtype]
    fp32 = (hidden + max_rank + 3) * UNIT_ROUNDOFF[torch.float32]
    return exact, (rounding + fp32) * magnitude + 1e-30


def run(case: Case, meta: LoRAMeta | None = None, strided_y: bool = False) -> torch.Tensor:
    """The reference's output for ``case``; with ``strided_y``, written through a view into a wider
    buffer (as a caller may pass)."""
    if strided_y:
        tokens, columns = case.y.shape
        y = torch.zeros(tokens, columns + 2, dtype=case.y.dtype)[:, 1 : columns + 1].copy_(case.y)
    else:
        y = case.y.clone()
    meta = meta if meta is not None else case.meta()
    lora_apply_sliced(y, case.x, case.As, case.Bs, case.scaling, meta, case.offsets, ranks=case.ranks)
    return y


def assert_matches_oracle(case: Case, y: torch.Tensor) -> None:
    slot_ranks = case.ranks.tolist() if case.ranks is not None else [case.As[0].shape[1]] * case.As[0].shape[0]
    exact, bound = oracle(case, slot_ranks)
    diff = (y.double() - exact).abs()
    assert (diff <= bound).all(), f"{(diff / bound).max().item():.2f}x the error bound"
    # Tokens that add nothing (slot -1, rank-0 slots) and columns outside the slices keep their bits,
    # -0.0 included (an added +0.0 would turn it into +0.0).
    untouched = torch.tensor([s < 0 or slot_ranks[s] == 0 for s in case.slots.tolist()], dtype=torch.bool)
    bits = INT_VIEW[y.dtype]
    assert torch.equal(y[untouched].view(bits), case.y[untouched].view(bits))
    covered = torch.zeros(y.shape[1], dtype=torch.bool)
    for B, offset in zip(case.Bs, case.offsets):
        covered[offset : offset + B.shape[1]] = True
    assert torch.equal(y[:, ~covered].view(bits), case.y[:, ~covered].view(bits))


def with_slots(case: Case, slots: list[int]) -> Case:
    """``case`` with its tokens' slots replaced (as many tokens as before)."""
    assert len(slots) == case.x.shape[0]
    return dataclasses.replace(case, slots=torch.tensor(slots))


def negative_zeros(case: Case) -> Case:
    """``case`` whose ``y`` holds -0.0 in every fourth element, so touching a row shows."""
    y = case.y.clone()
    y.view(-1)[::4] = -0.0
    return dataclasses.replace(case, y=y)


def plan_of(case: Case, meta: LoRAMeta) -> cpu_lora._Plan:
    return cpu_lora._plan(meta, case.As, case.Bs, case.ranks)


@pytest.fixture
def grid_only(monkeypatch) -> None:
    """Every group in the grid: a looped group costs more than any padding could."""
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 1 << 60)
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 60)


@pytest.fixture
def loop_only(monkeypatch) -> None:
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 0)


# 30 tokens over slots 1..4 (a contiguous run) of 6, three without an adapter; slot 4 has 9 tokens,
# the others 6, so the grid pads.
RUN_SLOTS = [1, 2, 3, 4] * 6 + [-1, 4, -1, 4, 4, -1]
# The same counts over scattered slots 0, 2, 3, 5: the grid spans slots 0..5, idle slots 1 and 4
# computed and dropped.
SCATTERED_SLOTS = [{1: 0, 2: 2, 3: 3, 4: 5}.get(s, -1) for s in RUN_SLOTS]
# Every group of equal size: nothing padded.
BALANCED_SLOTS = [0, 1, 2, 3, 4, 5] * 5


def in_layout(case: Case, layout: str) -> Case:
    """``case`` (slices packed back to back, no other column) with its slices laid out in ``y`` as
    ``layout`` says: ``packed`` as is; ``gaps`` with untouched columns between and around them;
    ``wider`` packed inside a wider ``y``; ``unordered`` packed, the slices passed in another order
    than their columns."""
    if layout in ("gaps", "wider"):
        between = 2 if layout == "gaps" else 0
        pieces, offsets, column = [torch.randn(case.y.shape[0], 3).to(case.y.dtype)], [], 3
        for B, offset in zip(case.Bs, case.offsets):
            pieces += [case.y[:, offset : offset + B.shape[1]], torch.randn(case.y.shape[0], between).to(case.y.dtype)]
            offsets.append(column)
            column += B.shape[1] + between
        pieces.append(torch.randn(case.y.shape[0], 1).to(case.y.dtype))
        return dataclasses.replace(case, y=torch.cat(pieces, dim=1), offsets=offsets)
    if layout == "unordered":
        order = [len(case.Bs) - 1, *range(len(case.Bs) - 1)]
        return dataclasses.replace(case, As=[case.As[i] for i in order], Bs=[case.Bs[i] for i in order],
                                   offsets=[case.offsets[i] for i in order])  # fmt: skip
    assert layout == "packed"
    return case


LAYOUTS = ["packed", "gaps", "wider", "unordered"]


def named_case(dtype: torch.dtype, slots: list[int], slot_ranks: list[int] | None = None, layout: str = "gaps") -> Case:
    case = make_case(num_tokens=len(slots), num_slots=6, rank=16, hidden=48, widths=[32, 8, 8], dtype=dtype,
                     slot_ranks=slot_ranks, pass_ranks=slot_ranks is not None, seed=11)  # fmt: skip
    return negative_zeros(in_layout(with_slots(case, slots), layout))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "slots, span, padded",
    [(RUN_SLOTS, slice(1, 5), True), (SCATTERED_SLOTS, slice(0, 6), True), (BALANCED_SLOTS, slice(0, 6), False)],
    ids=["run", "scattered", "balanced"],
)
@pytest.mark.slow
def test_grid(grid_only, dtype: torch.dtype, slots: list[int], span: slice, padded: bool, layout: str) -> None:
    case = named_case(dtype, slots, slot_ranks=[16, 8, 16, 4, 16, 8], layout=layout)
    meta = case.meta()
    plan = plan_of(case, meta)
    assert plan.grid is not None and not plan.looped and plan.grid_rank == 16
    assert plan.grid.span == span
    assert (plan.grid.cells is not None) == padded
    assert_matches_oracle(case, run(case, meta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_idle_slots_in_the_span_never_reach_y(grid_only, dtype: torch.dtype) -> None:
    """Whatever the idle slots between active ones hold (NaN here: a slot being refilled, say), their
    rows are computed and dropped."""
    case = named_case(dtype, SCATTERED_SLOTS, slot_ranks=[16, 8, 16, 4, 16, 8])
    for A, B in zip(case.As, case.Bs):
        A[[1, 4]] = float("nan")
        B[[1, 4]] = float("nan")
    case = dataclasses.replace(case, scaling=case.scaling.index_fill(0, torch.tensor([1, 4]), float("nan")))
    meta = case.meta()
    assert plan_of(case, meta).grid.span == slice(0, 6)
    assert_matches_oracle(case, run(case, meta))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [RUN_SLOTS, SCATTERED_SLOTS], ids=["run", "scattered"])
@pytest.mark.slow
def test_loop(loop_only, dtype: torch.dtype, slots: list[int], layout: str) -> None:
    """Each group at its own rank: even garbage past a slot's rank (which the contract forbids, and
    the grid would read up to its largest rank) never reaches ``y``."""
    slot_ranks = [16, 8, 16, 4, 16, 8]
    case = named_case(dtype, slots, slot_ranks, layout)
    for A, B in zip(case.As, case.Bs):
        for slot, rank in enumerate(slot_ranks):
            A[slot, rank:] = 1e3
            B[slot, :, rank:] = 1e3
    meta = case.meta()
    plan = plan_of(case, meta)
    assert plan.grid is None and sorted(rank for _, rank, _ in plan.looped) == [4, 8, 16, 16]
    assert_matches_oracle(case, run(case, meta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_group_loops_beside_a_grid(monkeypatch, dtype: torch.dtype) -> None:
    """A prefill chunk beside decode tokens: the big group runs alone, the small ones in a grid."""
    case = make_case(num_tokens=90, num_slots=5, rank=16, hidden=32, widths=[16, 24], dtype=dtype,
                     slot_ranks=[16, 8, 16, 0, 16], pass_ranks=True, extra_columns=2, seed=5)  # fmt: skip
    slots = [2] * 80 + [0, 1, 4, 0, 1, 4, -1, 3, 0, -1]
    case = negative_zeros(with_slots(case, slots))
    # Padding slot 2's 80 tokens into a grid beside groups of 3 would cost far more than one
    # group's fixed cost; looping the three small groups too would not pay.
    width = 32 * 2 + 16 + 24
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 4 * 16 * width)
    meta = case.meta()
    plan = plan_of(case, meta)
    assert [slot for slot, _, _ in plan.looped] == [2]
    assert plan.grid is not None and plan.grid.slots == [0, 1, 4] and plan.grid.size == 3
    assert_matches_oracle(case, run(case, meta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_beyond_the_ranks_is_not_read(grid_only, dtype: torch.dtype) -> None:
    """Ranks below the slot tensors' R: the grid multiplies up to the largest active rank only, so
    whatever lies beyond it (here garbage, which the contract forbids) never reaches ``y``."""
    case = named_case(dtype, BALANCED_SLOTS, slot_ranks=[8, 4, 8, 8, 0, 8])
    for A, B in zip(case.As, case.Bs):
        A[:, 8:] = 1e3
        B[:, :, 8:] = 1e3
    meta = case.meta()
    assert plan_of(case, meta).grid_rank == 8
    assert_matches_oracle(case, run(case, meta))


@pytest.mark.parametrize("dtype, big", [(torch.bfloat16, 256), (torch.float16, 2048)])
@pytest.mark.parametrize("path", ["grid", "loop"])
def test_the_shrink_is_rounded_to_the_input_dtype(monkeypatch, path: str, dtype: torch.dtype, big: int) -> None:
    """``h = [big + 1, -big]`` is exact in fp32, but ``big + 1`` rounds to ``big`` in the input
    dtype (a tie, to even); with ``B = [1, 1]`` the output is 0 when ``h`` is rounded as the
    kernels and PEFT round it, 1 otherwise."""
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 60 if path == "grid" else 0)
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 1 << 60)
    A = torch.tensor([[[big, 1.0], [-big / 2, -big / 2]]] * 2, dtype=dtype)
    B = torch.ones(2, 1, 2, dtype=dtype)
    x = torch.ones(3, 2, dtype=dtype)
    y = torch.zeros(3, 1, dtype=dtype)
    slots = torch.tensor([0, 1, 1])
    lora_apply_sliced(y, x, [A], [B], torch.ones(2), LoRAMeta.build(slots, 2))
    assert y.flatten().tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("path", ["grid", "loop"])
def test_rank_zero_and_unused_slots_add_nothing(monkeypatch, path: str) -> None:
    """Slot 2's tokens sit between slots 1 and 3 at rank 0: the grid spans slot 2 but drops its rows."""
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 60 if path == "grid" else 0)
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 1 << 60)
    case = named_case(torch.float32, RUN_SLOTS, slot_ranks=[16, 16, 0, 16, 0, 16])
    meta = case.meta()
    plan = plan_of(case, meta)
    gridded = plan.grid.slots if plan.grid is not None else []
    assert sorted(gridded + [slot for slot, _, _ in plan.looped]) == [1, 3]
    assert plan.grid is None or plan.grid.span == slice(1, 4)
    assert_matches_oracle(case, run(case, meta))
    # Every token's slot at rank 0: nothing to do at all.
    zero = named_case(torch.float32, RUN_SLOTS, slot_ranks=[16, 0, 0, 0, 0, 16])
    assert plan_of(zero, zero.meta()) == cpu_lora._Plan(None, 0, [])
    assert_matches_oracle(zero, run(zero))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["grid", "loop"])
@pytest.mark.slow
def test_strided_y(monkeypatch, path: str, dtype: torch.dtype) -> None:
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 60 if path == "grid" else 0)
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 1 << 60)
    for layout in ("packed", "gaps"):
        case = named_case(dtype, RUN_SLOTS, [16, 8, 16, 4, 16, 8], layout)
        assert_matches_oracle(case, run(case, strided_y=True))


def test_only_tokens_without_adapter() -> None:
    case = named_case(torch.float32, [-1] * 30)
    assert_matches_oracle(case, run(case))


def test_plans_follow_each_step_and_each_calls_ranks() -> None:
    """One metadata object reused across steps (as the engine does), and calls of one step with
    different per-layer ranks: every call uses its own step's grouping and its own ranks."""
    meta = LoRAMeta(max_num_tokens=40, max_slots=6)
    for slots in (RUN_SLOTS, SCATTERED_SLOTS, BALANCED_SLOTS[:7], RUN_SLOTS):
        meta.prepare(torch.tensor(slots))
        for slot_ranks in ([16, 8, 16, 4, 16, 8], [0, 16, 16, 16, 0, 16]):
            case = named_case(torch.float32, slots + [-1] * (30 - len(slots)), slot_ranks)
            case = dataclasses.replace(case, x=case.x[: len(slots)], y=case.y[: len(slots)],
                                       slots=case.slots[: len(slots)])  # fmt: skip
            assert_matches_oracle(case, run(case, meta))


@st.composite
def cases(draw) -> Case:
    num_slots = draw(st.integers(1, 8))
    num_tokens = draw(st.integers(1, 48))
    rank = draw(st.sampled_from([4, 8, 16]))
    slot_ranks = draw(st.lists(st.sampled_from([0, rank // 2, rank]), min_size=num_slots, max_size=num_slots))
    num_slices = draw(st.integers(1, 3))
    widths = draw(st.lists(st.sampled_from([4, 8, 24]), min_size=num_slices, max_size=num_slices))
    case = make_case(num_tokens=num_tokens, num_slots=num_slots, rank=rank, hidden=draw(st.sampled_from([8, 40])),
                     widths=widths, dtype=draw(st.sampled_from(DTYPES)), slot_ranks=slot_ranks,
                     pass_ranks=draw(st.booleans()), seed=draw(st.integers(0, 99)))  # fmt: skip
    case = in_layout(case, draw(st.sampled_from(LAYOUTS)))
    # Skewed group sizes: a few slots take most tokens, some slots none.
    weights = draw(st.lists(st.integers(0, 8), min_size=num_slots + 1, max_size=num_slots + 1))
    choices = [s for s, w in zip(range(-1, num_slots), weights) for _ in range(w)] or [-1]
    slots = draw(st.lists(st.sampled_from(choices), min_size=num_tokens, max_size=num_tokens))
    return negative_zeros(with_slots(case, slots))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), loop_group_macs=st.sampled_from([0, 1 << 10, 1 << 18, 1 << 60]), cap=st.sampled_from([0, 1 << 60]))
@pytest.mark.slow
def test_drawn_steps_on_every_path(monkeypatch, case: Case, loop_group_macs: int, cap: int) -> None:
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", loop_group_macs)
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", cap)
    assert_matches_oracle(case, run(case))
