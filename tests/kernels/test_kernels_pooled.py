"""The row-pool layout of ``LoRAWeights`` (``A_pool [P, K]``, ``Bt_pool [P, N]``, slot ``s`` owning
rows ``rows[s] : rows[s] + ranks[s]``) through both backends, against an fp64 oracle read from the
pool rows: Triton interpreted on CPU (compiled on CUDA under the gpu mark) and the torch backend on
each of its paths. Rows that belong to no slot hold NaN, so a read outside a slot's rows shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_cases import PoolCase, make_case, pooled, triton_device, with_pool_slots

import kernels.cpu_lora as cpu_lora
from kernels import LoRAMeta, LoRAWeights, lora_apply_sliced, lora_apply_weights

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (backend, device): the torch backend and Triton's interpreter on CPU, the compiled kernels on CUDA.
BACKENDS = [
    ("torch", "cpu"),
    ("triton", "cpu"),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu),
]


def _skip_unless_runs(backend: str, device: str) -> None:
    if backend == "triton" or device == "cuda":
        triton_device(device)


def run(case: PoolCase, backend: str, meta: LoRAMeta | None = None, weights: LoRAWeights | None = None) -> torch.Tensor:
    y = case.y.clone()
    lora_apply_weights(y, case.x, weights or case.weights(), meta or case.meta(), backend=backend)
    return y


def assert_matches_oracle(case: PoolCase, y: torch.Tensor) -> None:
    """Within the error bound of the pool oracle; tokens that add nothing (slot -1, rank-0 slots) and
    columns outside the slices keep their bits."""
    diff = (y.double() - case.exact()).abs()
    bound = case.bound()
    assert (diff <= bound).all(), f"{(diff / bound).max().item():.2f}x the error bound"
    ranks = case.ranks.tolist()
    untouched = torch.tensor([s < 0 or ranks[s] == 0 for s in case.slots.tolist()], device=y.device)
    bits = INT_VIEW[y.dtype]
    assert torch.equal(y[untouched].view(bits), case.y[untouched].view(bits))
    covered = torch.zeros(y.shape[1], dtype=torch.bool, device=y.device)
    for B, offset in zip(case.Bs, case.offsets):
        covered[offset : offset + B.shape[1]] = True
    assert torch.equal(y[:, ~covered].view(bits), case.y[:, ~covered].view(bits))


# make_case arguments and the slots' ranks. Mixed ranks (max_rank 64 or 128) with rank-0 slots,
# 1-3 slices of different widths, decode-sized and prefill-sized steps (both launch tables).
CASES: dict[str, tuple[dict[str, object], list[int]]] = {
    "decode-3-slices-fp32": (dict(num_tokens=40, num_slots=5, rank=64, hidden=96, widths=[64, 16, 24],
                                  extra_columns=4), [8, 16, 3, 64, 0]),
    "decode-2-slices-bf16": (dict(num_tokens=33, num_slots=6, rank=64, hidden=64, widths=[48, 32],
                                  dtype=torch.bfloat16), [8, 16, 3, 64, 0, 16]),
    "decode-1-slice-fp16": (dict(num_tokens=9, num_slots=3, rank=16, hidden=48, widths=[40], dtype=torch.float16,
                                 no_adapter_fraction=0.4), [16, 4, 0]),
    "prefill-2-slices-bf16": (dict(num_tokens=600, num_slots=4, rank=64, hidden=64, widths=[32, 16],
                                   dtype=torch.bfloat16), [16, 64, 3, 8]),
    "rank-128-fp32": (dict(num_tokens=12, num_slots=3, rank=128, hidden=32, widths=[16], unused_slots=0),
                      [128, 16, 70]),
}  # fmt: skip


def named_case(name: str, device: str = "cpu", **pool_args: int) -> PoolCase:
    args, slot_ranks = CASES[name]
    seed = list(CASES).index(name)
    case = make_case(**args, slot_ranks=slot_ranks, device=device, seed=seed)  # type: ignore[arg-type]
    return pooled(case, slot_ranks, seed=seed, **pool_args)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_pool_matches_oracle(name: str, backend: str, device: str) -> None:
    _skip_unless_runs(backend, device)
    case = named_case(name, device)
    y = run(case, backend)
    assert_matches_oracle(case, y)
    assert not torch.equal(y, case.y)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_slot_tensors_and_their_pool_relayout_agree(backend: str, device: str, dtype: torch.dtype) -> None:
    """The same adapters as slot tensors and as a pool: Triton gives the same bits (one kernel, one
    launch table, masked loads either way); the torch backend agrees up to fp32 summation order (its
    matmuls see other memory layouts)."""
    _skip_unless_runs(backend, device)
    slot_ranks = [8, 16, 3, 64, 0, 64, 16]
    case = make_case(num_tokens=48, num_slots=7, rank=64, hidden=80, widths=[32, 16, 16], dtype=dtype,
                     slot_ranks=slot_ranks, pass_ranks=True, extra_columns=2, device=device, seed=4)  # fmt: skip
    pool = pooled(case, slot_ranks, seed=4)
    meta = case.meta()
    y_slots, y_pool = case.y.clone(), run(pool, backend, meta)
    lora_apply_sliced(y_slots, case.x, case.As, case.Bs, case.scaling, meta, case.offsets, ranks=case.ranks,
                      backend=backend)  # fmt: skip
    if backend == "triton":
        assert torch.equal(y_slots, y_pool)
    else:
        assert ((y_slots.double() - y_pool.double()).abs() <= pool.bound()).all()
    assert_matches_oracle(pool, y_pool)


@pytest.fixture
def grid_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 1 << 60)
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 60)


def _plan(case: PoolCase, meta: LoRAMeta) -> cpu_lora._PoolPlan:
    return cpu_lora._pool_plan(meta, case.As, case.Bs, case.ranks, case.rows, case.max_rank)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("name", ["decode-3-slices-fp32", "decode-2-slices-bf16", "prefill-2-slices-bf16"])
@pytest.mark.slow
def test_a_dora_scale_multiplies_each_slots_columns(name: str, backend: str, device: str) -> None:
    """``dora_scale`` (DoRA): a token of slot ``s`` gets ``(y + scaling B A x) * dora_scale[s + 1]`` on
    the slices' columns; row 0, rank-0 slots' rows and columns outside the slices are ones."""
    _skip_unless_runs(backend, device)
    case = named_case(name, device)
    width = case.y.shape[1]
    generator = torch.Generator().manual_seed(5)
    table = 0.5 + torch.rand(case.scaling.shape[0] + 1, width, generator=generator)
    table[0] = 1
    for slot, rank in enumerate(case.ranks.tolist()):
        if rank == 0:
            table[slot + 1] = 1
    covered = torch.zeros(width, dtype=torch.bool)
    for B, offset in zip(case.Bs, case.offsets):
        covered[offset : offset + B.shape[1]] = True
    table[:, ~covered] = 1
    table = table.to(device=case.y.device, dtype=case.y.dtype)
    weights = LoRAWeights(case.As, case.Bs, case.scaling, case.offsets, ranks=case.ranks, rows=case.rows,
                          max_rank=case.max_rank, dora_scale=table)  # fmt: skip
    y = run(case, backend, weights=weights)
    scale = table.double()[case.slots.long() + 1]
    exact = case.exact() * scale
    # Two roundings on the torch backend (the add, then the multiply): twice the add's bound, plus
    # one rounding of the product.
    bound = 2 * case.bound() * scale + exact.abs() * torch.finfo(case.y.dtype).eps
    diff = (y.double() - exact).abs()
    assert (diff <= bound).all(), f"{(diff / bound).max().item():.2f}x the error bound"
    assert torch.equal(y[case.slots < 0], case.y[case.slots < 0])


def test_a_dora_scale_of_the_wrong_shape_is_refused() -> None:
    case = named_case("decode-1-slice-fp16")
    with pytest.raises(ValueError, match=r"dora_scale must be \[S \+ 1 = 4, N >= 40\]"):
        LoRAWeights(case.As, case.Bs, case.scaling, case.offsets, ranks=case.ranks, rows=case.rows,
                    max_rank=case.max_rank, dora_scale=torch.ones(3, 40, dtype=case.y.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grid_reads_evenly_spaced_rows_as_a_view(grid_only, dtype: torch.dtype) -> None:
    """One rank, slots at evenly spaced rows (in another order than the slots): a strided view over
    the pool, in pool order, with the NaN rows between the slots skipped."""
    case = make_case(num_tokens=30, num_slots=5, rank=16, hidden=48, widths=[32, 8], dtype=dtype, seed=6)
    pool = pooled(case, [16] * 5, seed=6, gap=3)
    meta = pool.meta()
    plan = _plan(pool, meta)
    assert plan.grid is not None and plan.gather is not None and not plan.looped
    firsts = pool.rows.tolist()
    assert plan.grid.slots == sorted(plan.grid.slots, key=lambda s: firsts[s]) != sorted(plan.grid.slots)
    assert plan.gather.view == (min(firsts[s] for s in plan.grid.slots), 19)
    assert_matches_oracle(pool, run(pool, "torch", meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grid_gathers_scattered_rows_and_masks_smaller_ranks(grid_only, dtype: torch.dtype) -> None:
    """Mixed ranks at scattered rows: a gather at the largest rank, the smaller ranks' extra rows
    repeating their first row (never a neighbour's) and masked out of ``h``."""
    pool = named_case("decode-2-slices-bf16")
    pool = dataclasses.replace(pool, y=pool.y.to(dtype), x=pool.x.to(dtype), As=[A.to(dtype) for A in pool.As],
                               Bs=[B.to(dtype) for B in pool.Bs])  # fmt: skip
    meta = pool.meta()
    plan = _plan(pool, meta)
    assert plan.grid is not None and plan.gather is not None and not plan.looped
    assert plan.gather.view is None and plan.gather.mask is not None and plan.grid_rank == 64
    assert 0 not in [pool.ranks.tolist()[s] for s in plan.grid.slots], "rank-0 slots stay out of the grid"
    assert_matches_oracle(pool, run(pool, "torch", meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_loop_reads_each_slots_rows_in_place(monkeypatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 0)
    pool = named_case("decode-3-slices-fp32")
    pool = dataclasses.replace(pool, y=pool.y.to(dtype), x=pool.x.to(dtype), As=[A.to(dtype) for A in pool.As],
                               Bs=[B.to(dtype) for B in pool.Bs])  # fmt: skip
    meta = pool.meta()
    plan = _plan(pool, meta)
    assert plan.grid is None
    assert sorted((slot, first, rank) for slot, first, rank, _ in plan.looped) == sorted(
        (s, pool.rows.tolist()[s], r) for s, r in enumerate(pool.ranks.tolist()) if r and (pool.slots == s).any()
    )
    assert_matches_oracle(pool, run(pool, "torch", meta))


def test_torch_large_group_loops_beside_a_pool_grid(monkeypatch) -> None:
    """A prefill chunk beside decode tokens: the big group runs alone, the rest in a grid."""
    case = make_case(num_tokens=90, num_slots=5, rank=16, hidden=32, widths=[16, 24], seed=5)
    pool = with_pool_slots(pooled(case, [16, 8, 16, 0, 16], seed=5), [2] * 80 + [0, 1, 4, 0, 1, 4, -1, 3, 0, -1])
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", 4 * 16 * (32 * 2 + 16 + 24))
    meta = pool.meta()
    plan = _plan(pool, meta)
    assert [slot for slot, _, _, _ in plan.looped] == [2]
    assert plan.grid is not None and sorted(plan.grid.slots) == [0, 1, 4] and plan.grid.size == 3
    assert_matches_oracle(pool, run(pool, "torch", meta))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_and_ranks_rewritten_in_place_between_calls(backend: str) -> None:
    """One prepared step, the slot table rewritten between calls (an adapter moved to other rows, its
    old rows overwritten with NaN; another slot's rank cut): each call reads the table as it is."""
    _skip_unless_runs(backend, "cpu")
    case = make_case(num_tokens=24, num_slots=4, rank=16, hidden=32, widths=[16, 8], seed=8)
    pool = pooled(case, [16, 8, 16, 4], seed=8, spare=20)
    meta, weights = pool.meta(), pool.weights()
    assert_matches_oracle(pool, run(pool, backend, meta, weights))
    first, spare = int(pool.rows[0]), pool.As[0].shape[0] - 20
    for A, Bt in zip(pool.As, pool.Bs):
        A[spare : spare + 16] = A[first : first + 16].clone()
        Bt[spare : spare + 16] = Bt[first : first + 16].clone()
        A[first : first + 16] = float("nan")
        Bt[first : first + 16] = float("nan")
    pool.rows[0] = spare
    pool.ranks[2] = 5
    assert_matches_oracle(pool, run(pool, backend, meta, weights))


def test_both_backends_clamp_rows_past_the_pool_alike() -> None:
    """Past the CPU check (as on CUDA, where nothing is checked): a rank above max_rank is cut to it,
    rows past the pool's end are cut at it, a negative first row adds nothing; nothing outside the
    pool is read."""
    triton_device("cpu")
    from kernels.triton_lora import lora_apply_triton

    case = make_case(num_tokens=20, num_slots=3, rank=16, hidden=32, widths=[16], no_adapter_fraction=0.0,
                     unused_slots=0, seed=9)  # fmt: skip
    pool = pooled(case, [16, 16, 16], seed=9, gap=0)
    pool_rows = pool.As[0].shape[0]
    bad = dataclasses.replace(pool, rows=torch.tensor([pool_rows - 5, -3, 4], dtype=torch.int32),
                              ranks=torch.tensor([16, 16, 40], dtype=torch.int32))  # fmt: skip
    clamped = dataclasses.replace(pool, rows=torch.tensor([pool_rows - 5, 0, 4], dtype=torch.int32),
                                  ranks=torch.tensor([5, 0, 16], dtype=torch.int32))  # fmt: skip
    meta = bad.meta()
    outputs = []
    for apply in (cpu_lora.lora_apply_torch, lora_apply_triton):
        y = bad.y.clone()
        apply(y, bad.x, bad.As, bad.Bs, bad.scaling, meta, bad.offsets, bad.ranks, bad.rows, bad.max_rank)
        assert_matches_oracle(clamped, y)
        outputs.append(y)
    assert not torch.isnan(outputs[0]).any() and not torch.isnan(outputs[1]).any()


def test_pool_sizes_the_kernels_for_max_rank() -> None:
    """The rank block (and the launch tables) follow max_rank, not the slots' ranks."""
    triton_device("cpu")
    from kernels import triton_lora

    case = make_case(num_tokens=6, num_slots=2, rank=16, hidden=32, widths=[16], seed=10)
    for max_rank in (16, 64):
        pool = dataclasses.replace(pooled(case, [16, 8], seed=10), max_rank=max_rank)
        h = triton_lora.shrink(pool.x, pool.As, pool.meta(), pool.ranks, rows=pool.rows, max_rank=max_rank)
        assert h.shape[-1] == triton_lora.block_r(max_rank)
        assert pool.weights().rank == max_rank
        assert_matches_oracle(pool, run(pool, "triton"))


def test_pool_weights_describe_the_pool() -> None:
    case = make_case(num_tokens=4, num_slots=3, rank=16, hidden=32, widths=[16, 8], seed=1)
    weights = pooled(case, [16, 0, 8], seed=1, spare=7).weights()
    assert weights.pooled and weights.rows is not None
    assert (weights.num_slots, weights.rank, weights.hidden, weights.offsets) == (3, 16, 32, (0, 16))
    assert weights.pool_rows == weights.As[0].shape[0] >= 24 + 7
    slot_weights = LoRAWeights(case.As, case.Bs, case.scaling)
    assert not slot_weights.pooled and slot_weights.pool_rows is None


def _small_pool() -> PoolCase:
    case = make_case(num_tokens=6, num_slots=3, rank=8, hidden=16, widths=[12, 4], seed=1)
    return pooled(case, [8, 4, 8], seed=1)


def _weights(pool: PoolCase, **change: object) -> LoRAWeights:
    args: dict[str, object] = dict(As=pool.As, Bs=pool.Bs, scaling=pool.scaling, slice_offsets=pool.offsets,
                                   ranks=pool.ranks, rows=pool.rows, max_rank=pool.max_rank)  # fmt: skip
    args.update(change)
    return LoRAWeights(**args)  # type: ignore[arg-type]


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# Each builds the weights (or rewrites their slot table) and calls the op; the error and its message.
BAD: dict[str, tuple[Callable[[PoolCase], tuple[LoRAWeights, torch.Tensor]], str]] = {
    "rows past P": (lambda p: (_weights(p, rows=_i32([0, p.As[0].shape[0] - 2, 8])), p.x),
                    r"slot 1's pool rows \d+..\d+ \(rows \+ ranks\) pass the pool's P=\d+ rows"),
    "negative rows": (lambda p: (_weights(p, rows=_i32([-1, 8, 12])), p.x), r"rows must be >= 0, got rows\[0\] = -1"),
    "rank past max_rank": (lambda p: (_weights(p, ranks=_i32([8, 9, 8])), p.x),
                           r"ranks must lie in \[0, max_rank=8\], got ranks\[1\] = 9"),
    "negative rank": (lambda p: (_weights(p, ranks=_i32([8, -1, 8])), p.x), r"ranks\[1\] = -1"),
    "missing ranks": (lambda p: (_weights(p, ranks=None), p.x), "the row pool needs ranks"),
    "missing max_rank": (lambda p: (_weights(p, max_rank=None), p.x), "the row pool needs max_rank"),
    "max_rank without rows": (lambda p: (_weights(p, rows=None), p.x), "max_rank is the row pool's"),
    "max_rank zero": (lambda p: (_weights(p, max_rank=0), p.x), "max_rank must be an int >= 1, got 0"),
    "A pools' P differ": (lambda p: (_weights(p, As=[p.As[0], p.As[1][:-1]]), p.x),
                          r"A\[1\] pool must be \[P=\d+, K=16\] like A\[0\]"),
    "A pools' K differ": (lambda p: (_weights(p, As=[p.As[0], p.As[1][:, :8]]), p.x),
                          r"A\[1\] pool must be \[P=\d+, K=16\] like A\[0\]"),
    "Bt pool's P differs": (lambda p: (_weights(p, Bs=[p.Bs[0], p.Bs[1][:-1]]), p.x),
                            r"B\[1\] pool must be \[P=\d+, N\] \(B transposed\)"),
    "Bt pool's rows strided": (lambda p: (_weights(p, Bs=[p.Bs[0], p.Bs[1].repeat(1, 2)[:, ::2]]), p.x),
                               r"B\[1\] pool's rows must be contiguous \(stride 1 along N\)"),
    "slot tensors with rows": (lambda p: (_weights(p, As=[A[None] for A in p.As]), p.x), r"A pool must be \[P, K\]"),
    "rows int64": (lambda p: (_weights(p, rows=p.rows.long()), p.x), r"rows must be an int32 tensor \[S=3\]"),
    "rows length": (lambda p: (_weights(p, rows=p.rows[:2]), p.x), r"rows must be an int32 tensor \[S=3\]"),
    "ranks length": (lambda p: (_weights(p, ranks=p.ranks[:2]), p.x), r"ranks must be an int32 tensor \[S=3\]"),
    "rows elsewhere": (lambda p: (_weights(p, rows=p.rows.to("meta")), p.x), "rows is on meta but the A pool is on"),
    "dtype mix": (lambda p: (_weights(p, Bs=[p.Bs[0], p.Bs[1].double()]), p.x), "B\\[1\\] is torch.float64"),
    "x's K": (lambda p: (_weights(p), p.x[:, :8]), r"A\[0\] must be \[P, K=8\] for x's K=8"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_pool_arguments_get_a_clear_error(name: str, backend: str) -> None:
    pool = _small_pool()
    build, message = BAD[name]
    y = pool.y.clone()
    with pytest.raises((ValueError, TypeError), match=message):
        weights, x = build(pool)
        lora_apply_weights(y, x, weights, pool.meta(), backend=backend)
    assert torch.equal(y, pool.y), "nothing is written when the arguments are refused"


def test_a_slot_table_broken_after_construction_is_refused_at_the_call() -> None:
    pool = _small_pool()
    weights, meta = pool.weights(), pool.meta()
    pool.rows[2] = pool.As[0].shape[0]
    y = pool.y.clone()
    with pytest.raises(ValueError, match="pass the pool's P"):
        lora_apply_weights(y, pool.x, weights, meta)
    assert torch.equal(y, pool.y)


@st.composite
def pool_cases(draw: st.DrawFn) -> PoolCase:
    num_slots = draw(st.integers(1, 8))
    max_rank = draw(st.sampled_from([4, 16, 64]))
    slot_ranks = draw(st.lists(st.sampled_from([0, 1, 3, max_rank // 2, max_rank]), min_size=num_slots,
                               max_size=num_slots))  # fmt: skip
    num_slices = draw(st.integers(1, 3))
    case = make_case(num_tokens=draw(st.integers(1, 48)), num_slots=num_slots, rank=max_rank,
                     hidden=draw(st.sampled_from([8, 40])),
                     widths=draw(st.lists(st.sampled_from([4, 8, 24]), min_size=num_slices, max_size=num_slices)),
                     dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                     slot_ranks=slot_ranks, extra_columns=draw(st.sampled_from([0, 3])),
                     seed=draw(st.integers(0, 99)))  # fmt: skip
    gap = draw(st.sampled_from([None, 0, 2]))
    pool = pooled(case, slot_ranks, seed=draw(st.integers(0, 99)), gap=gap)
    # Skewed group sizes: a few slots take most tokens, some slots none.
    weights = draw(st.lists(st.integers(0, 8), min_size=num_slots + 1, max_size=num_slots + 1))
    choices = [s for s, w in zip(range(-1, num_slots), weights) for _ in range(w)] or [-1]
    slots = draw(st.lists(st.sampled_from(choices), min_size=pool.x.shape[0], max_size=pool.x.shape[0]))
    return with_pool_slots(pool, slots)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=pool_cases(), loop_group_macs=st.sampled_from([0, 1 << 10, 1 << 18, 1 << 60]),
       cap=st.sampled_from([0, 1 << 60]))  # fmt: skip
@pytest.mark.slow
def test_drawn_pools_on_every_torch_path(monkeypatch, case: PoolCase, loop_group_macs: int, cap: int) -> None:
    monkeypatch.setattr(cpu_lora, "LOOP_GROUP_MACS", loop_group_macs)
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", cap)
    assert_matches_oracle(case, run(case, "torch"))


@settings(max_examples=12, deadline=None)
@given(case=pool_cases())
@pytest.mark.slow
def test_drawn_pools_through_triton(case: PoolCase) -> None:
    triton_device("cpu")
    assert_matches_oracle(case, run(case, "triton"))


@pytest.mark.gpu
def test_pool_decode_replays_in_a_cuda_graph_after_the_slot_table_changes() -> None:
    """prepare + apply captured once over a pool; between replays adapters move to other rows (their
    old rows overwritten with NaN), ranks change and the slot mix changes, all in place: each replay
    matches the oracle of the pool as it then is, and never synchronises with the host."""
    triton_device("cuda")
    num_tokens, slot_ranks = 64, [16, 64, 8, 3, 16, 0, 32, 16]
    num_slots = len(slot_ranks)
    case = make_case(num_tokens=num_tokens, num_slots=num_slots, rank=64, hidden=512, widths=[512, 128, 128],
                     dtype=torch.bfloat16, slot_ranks=slot_ranks, device="cuda", seed=12)  # fmt: skip
    pool = pooled(case, slot_ranks, seed=12, spare=3 * 64)
    weights = pool.weights()
    meta = LoRAMeta(num_tokens, num_slots, "cuda")
    static_slots, static_y, y0 = pool.slots.clone(), pool.y.clone(), pool.y.clone()

    def step() -> None:
        static_y.copy_(y0)
        meta.prepare(static_slots)
        lora_apply_weights(static_y, pool.x, weights, meta)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(1)
    spare = pool.As[0].shape[0] - 3 * 64
    for round_ in range(3):
        moved, cut = (2 * round_ + 1) % num_slots, (2 * round_ + 4) % num_slots
        first, rank, target = int(pool.rows[moved]), int(pool.ranks[moved]), spare + 64 * round_
        for A, Bt in zip(pool.As, pool.Bs):
            A[target : target + rank] = A[first : first + rank].clone()
            Bt[target : target + rank] = Bt[first : first + rank].clone()
            A[first : first + rank] = float("nan")
            Bt[first : first + rank] = float("nan")
        pool.rows[moved] = target
        pool.ranks[cut] = int(pool.ranks[cut]) // 2
        static_slots.copy_(torch.randint(-1, num_slots, (num_tokens,), generator=gen).cuda())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert_matches_oracle(dataclasses.replace(pool, y=y0, slots=static_slots.clone()), static_y)


@pytest.mark.gpu
def test_pool_apply_never_synchronises_with_the_host() -> None:
    triton_device("cuda")
    pool = named_case("decode-2-slices-bf16", "cuda")
    weights, meta = pool.weights(), pool.meta()
    y = pool.y.clone()
    lora_apply_weights(y, pool.x, weights, meta)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.prepare(pool.slots)
        lora_apply_weights(y, pool.x, weights, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
