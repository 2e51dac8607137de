"""The multi-LoRA op in torch: the engine's CPU backend (``backend="torch"``), with a cost model.

The tests hold the exact oracle (fp64, ``tests/kernels/``); this module is a backend like
``kernels/triton_lora.py``, tuned for host time on CPU.

Numerics are the kernels' own, so the two agree up to fp32 summation order: the shrink
``h = x @ A[s, :r]^T`` accumulates in fp32; for bf16/fp16 inputs ``h`` is rounded to the input
dtype before the expand (as PEFT's own ``lora_B(lora_A(x))`` does in that dtype); ``scaling[s]``
multiplies in fp32 (here, for fp32 inputs, the gathered rows of ``x``, once per call rather than once
per slice; for bf16/fp16 the rounded ``h``, so that the rounding sees the unscaled ``h``; the orders
differ by fp32 rounding only); the expand ``h @ B[s, :, :r]^T`` accumulates in fp32, is added to
``y`` in fp32 and rounded once to ``y``'s dtype. Tokens with slot ``-1``, tokens of slots whose rank is 0 and
columns outside the slices are never written.

The work is what the tokens' own adapters need, in few torch ops: on CPU an op costs microseconds of
host time, more than a decode step's LoRA arithmetic. The step's tokens are laid out once in a
*grid*, one row per slot from the lowest active slot to the highest, padded to the largest group,
and each slice costs two batched matmuls over it at the largest rank among the grid's slots. The
slot tensors are read in place: idle slots between active ones are computed and dropped, which
measured cheaper than gathering the active slots' weights. Padding a group much larger than the
rest (a prefill chunk beside decode tokens) would cost more than it saves, so such groups run one by
one at their own rank; a cost model with one measured constant picks them per call, and large
steps, where the grid stops paying, run every group alone. The gather indices are built once per
step and kept in ``LoRAMeta.host_cache``.

A row pool (``A_pool [P, K]``, ``Bt_pool [P, N]``, slot ``s`` owning rows ``rows[s] : rows[s] +
ranks[s]``) cannot be read over a span of slots in place: a slot's rows past its own rank belong to
another adapter (or to nobody). Its grid holds the gridded slots alone, ordered by first pool row,
and each call gathers their rows into ``[slots, rank, K]`` and ``[slots, rank, N]`` tensors: a
slot's rank rows past its own repeat its first row, and a mask folded into the scaling zeroes their
columns of ``h`` (so nothing outside a slot's rows is read, whatever the rest of the pool holds).
When the gridded slots share one rank and sit at evenly spaced rows (adapters loaded one after
another), the gather is a strided view instead, with no copy. Looped groups read their rows in
place. ``rows`` and ``ranks`` are read on the host once per call (a CUDA tensor synchronises, as the
torch backend does anyway); the plan and gather indices built from them are kept in
``LoRAMeta.host_cache`` under their values, so rows rewritten between calls never meet a stale plan.
On CUDA (no host check there) a slot's rank is clamped as the Triton kernels clamp it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.meta import LoRAMeta

# A grid may spend at most this many multiply-adds per slice, padding included (tokens x rank x
# (K + N)); past it, groups run one by one. Measured on the 2-core development CPU (fp32, 1 and 2
# threads, docs/benchmarks.md): below it balanced grids beat the per-group loop by 1.3-5x; from 2^24
# the grid lost in some runs, by up to 2.7x.
DENSE_MAX_MACS = 1 << 23

# The host time of a group run on its own, per slice (five torch ops: 44-88 µs on the same CPU), in
# multiply-adds of the grid's marginal cost: 0.6-2.2 M over four runs of three shapes, median 1.1 M.
# It is what padding may cost before looping pays.
LOOP_GROUP_MACS = 1 << 20


@dataclass(frozen=True)
class _Grid:
    """Tokens laid out ``[slots of the span, size]``, one row per slot of ``span`` (a pool's grid: one
    row per slot of ``slots``), each group's tokens first, then padding (repeats of a token); padded
    cells are computed and dropped before anything is added to ``y``."""

    slots: list[int]  # the groups' slots: ascending, or a pool's in pool order
    span: slice | None  # the slot tensors' rows the grid covers (its first to its last slot); None in a pool
    size: int
    x_index: torch.Tensor  # [span length * size] token of each cell
    rows: torch.Tensor  # tokens of the real cells, in grid order
    cells: torch.Tensor | None  # positions of the real cells in the grid; None when nothing is padded


@dataclass(frozen=True)
class _Plan:
    grid: _Grid | None
    grid_rank: int
    looped: list[tuple[int, int, torch.Tensor]]  # (slot, rank, tokens) of groups run one by one


@dataclass(frozen=True)
class _PoolGather:
    """How a pool grid reads its slots' rows: ``view`` ``(first row, row step)`` when every slot has
    the grid's rank at evenly spaced rows (a strided view, no copy), else ``index`` (pool row of each
    slot's rank row, padding repeating the slot's first row); ``mask`` ``[slots, 1, rank]`` zeroes
    the padding's columns of ``h`` (None when no slot is padded)."""

    slots: torch.Tensor  # [slots] the grid's slots, for their scalings
    view: tuple[int, int] | None
    index: torch.Tensor | None
    mask: torch.Tensor | None

    def read(self, pool: torch.Tensor, rank: int) -> torch.Tensor:
        """The grid slots' rows of ``pool [P, W]`` as ``[slots, rank, W]``."""
        num, width = self.slots.numel(), pool.shape[1]
        if self.view is not None:
            first, step = self.view
            rows, cols = pool.stride()
            return pool.as_strided((num, rank, width), (step * rows, rows, cols), pool.storage_offset() + first * rows)
        assert self.index is not None
        return pool.index_select(0, self.index).view(num, rank, width)


@dataclass(frozen=True)
class _PoolPlan:
    grid: _Grid | None
    grid_rank: int
    gather: _PoolGather | None
    looped: list[tuple[int, int, int, torch.Tensor]]  # (slot, first row, rank, tokens) of groups run alone


@dataclass(frozen=True)
class _Step:
    """The step's non-empty groups on the host: ``(slot, start, count)`` in sorted positions."""

    groups: list[tuple[int, int, int]]
    order: torch.Tensor  # token ids in sorted positions (LoRAMeta.token_indices, int64)
    order_list: list[int]  # the same on the host


def lora_apply_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor | None,
    rows: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> None:
    """Add every slice's LoRA output into its columns of ``y``, in place (arguments validated by
    :class:`kernels.LoRAWeights`): slot tensors, or with ``rows`` row pools whose slots have at
    most ``max_rank`` rows."""
    if meta.num_tokens == 0:
        return
    scales = scaling.float()
    span = _packed_span(Bs, slice_offsets)
    if rows is not None:
        if ranks is None or max_rank is None:
            raise TypeError("a row pool (rows given) needs ranks and max_rank")
        _apply_pool(y, x, As, Bs, scales, meta, slice_offsets, span, ranks, rows, max_rank)
        return
    plan = _plan(meta, As, Bs, ranks)
    if plan.grid is not None:
        _apply_grid(y, x, As, Bs, scales, slice_offsets, span, plan.grid, plan.grid_rank)
    for slot, rank, tokens in plan.looped:
        views = [(A[slot, :rank], B[slot, :, :rank].T) for A, B in zip(As, Bs)]
        _apply_group(y, x, views, scales[slot], slice_offsets, span, tokens)


def _apply_pool(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scales: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    span: tuple[int, int] | None,
    ranks: torch.Tensor,
    rows: torch.Tensor,
    max_rank: int,
) -> None:
    """The row pool's grid and looped groups (module docstring)."""
    plan = _pool_plan(meta, As, Bs, ranks, rows, max_rank)
    if plan.grid is not None:
        assert plan.gather is not None
        _apply_pool_grid(y, x, As, Bs, scales, slice_offsets, span, plan.grid, plan.grid_rank, plan.gather)
    for slot, first, rank, tokens in plan.looped:
        views = [(A[first : first + rank], B[first : first + rank]) for A, B in zip(As, Bs)]
        _apply_group(y, x, views, scales[slot], slice_offsets, span, tokens)


def _step(meta: LoRAMeta) -> _Step:
    step = meta.host_cache.get(_Step)
    if not isinstance(step, _Step):  # not built yet this step (the cache holds objects of any type)
        order = meta.token_indices[: meta.num_tokens].long()
        step = meta.host_cache[_Step] = _Step(meta.host_groups(), order, order.tolist())
    return step


def _plan(
    meta: LoRAMeta, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], ranks: torch.Tensor | None
) -> _Plan:
    """Which groups go in the grid and which run alone, for this call's ranks and shapes.

    Cached per step under everything it depends on (the constants too, which benchmarks and tests
    change between calls): in the engine, the four projection shapes of a layer, so a step builds
    four plans and every other call is a lookup.
    """
    slot_ranks = tuple(ranks.tolist()) if ranks is not None else None
    full_rank, hidden = As[0].shape[1], As[0].shape[2]
    widths = tuple(B.shape[1] for B in Bs)
    key = (_Plan, slot_ranks, full_rank, hidden, widths, DENSE_MAX_MACS, LOOP_GROUP_MACS)
    plan = meta.host_cache.get(key)
    if not isinstance(plan, _Plan):
        plan = meta.host_cache[key] = _make_plan(meta, slot_ranks, full_rank, hidden, widths)
    return plan


def _make_plan(
    meta: LoRAMeta, slot_ranks: tuple[int, ...] | None, full_rank: int, hidden: int, widths: tuple[int, ...]
) -> _Plan:
    step = _step(meta)
    groups = _groups(step, slot_ranks if slot_ranks is not None else (full_rank,) * meta.max_slots)
    if not groups:
        return _Plan(None, 0, [])
    best_k, grid_rank = _split(groups, hidden, widths, meta.max_slots, compact=False)
    looped = [(slot, rank, step.order[start : start + count]) for slot, start, count, rank in groups[:best_k]]
    gridded = sorted((slot, start, count) for slot, start, count, _ in groups[best_k:])
    if not gridded:
        return _Plan(None, 0, looped)
    return _Plan(_grid(meta, step, gridded, compact=False), grid_rank, looped)


def _groups(step: _Step, slot_ranks: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``(slot, start, count, rank)`` of the step's groups that add anything, largest first."""
    groups = [(slot, start, end - start, slot_ranks[slot]) for slot, start, end in step.groups]
    return sorted((g for g in groups if g[3] > 0), key=lambda g: -g[2])


def _split(
    groups: list[tuple[int, int, int, int]], hidden: int, widths: tuple[int, ...], max_slots: int, *, compact: bool
) -> tuple[int, int]:
    """``(k, rank)``: the ``k`` largest groups run alone, the rest in a grid of that rank.

    Looping the k largest groups costs their own arithmetic plus a fixed cost each; the grid holds
    the rest at their largest count and rank, one row per slot of their span (``compact``: one row
    per group, as a pool's grid has), plus one fixed cost."""
    # suffix_rank[k], suffix_rows[k]: the rank and the row count of a grid of groups k and after.
    macs_per_rank = sum(hidden + width for width in widths)  # per token, all slices
    widest = hidden + max(widths)
    fixed = len(widths) * LOOP_GROUP_MACS
    suffix_rank, suffix_rows = [0] * len(groups), [0] * len(groups)
    rank_max, low, high = 0, max_slots, -1
    for k in range(len(groups) - 1, -1, -1):
        slot, _, _, rank = groups[k]
        rank_max, low, high = max(rank_max, rank), min(low, slot), max(high, slot)
        suffix_rank[k], suffix_rows[k] = rank_max, len(groups) - k if compact else high - low + 1
    best_k, best_cost, looped_cost = len(groups), None, 0
    for k, (_, _, count, rank) in enumerate(groups):
        cells = suffix_rows[k] * count  # the grid's size is group k's count
        if cells * suffix_rank[k] * widest <= DENSE_MAX_MACS:
            cost = looped_cost + cells * suffix_rank[k] * macs_per_rank + fixed
            if best_cost is None or cost < best_cost:
                best_k, best_cost = k, cost
        looped_cost += count * rank * macs_per_rank + fixed
    if best_cost is not None and looped_cost < best_cost:
        best_k = len(groups)
    return best_k, suffix_rank[best_k] if best_k < len(groups) else 0


def _pool_plan(
    meta: LoRAMeta,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    ranks: torch.Tensor,
    rows: torch.Tensor,
    max_rank: int,
) -> _PoolPlan:
    """:func:`_plan` for a row pool, cached per step under the slots' rows and ranks themselves."""
    pool_rows, hidden = As[0].shape
    widths = tuple(B.shape[1] for B in Bs)
    first_rows, slot_ranks = tuple(rows.tolist()), tuple(ranks.tolist())
    key = (_PoolPlan, first_rows, slot_ranks, max_rank, pool_rows, hidden, widths, DENSE_MAX_MACS, LOOP_GROUP_MACS)
    plan = meta.host_cache.get(key)
    if not isinstance(plan, _PoolPlan):
        plan = _make_pool_plan(meta, first_rows, slot_ranks, max_rank, pool_rows, hidden, widths)
        meta.host_cache[key] = plan
    return plan


def _make_pool_plan(
    meta: LoRAMeta,
    first_rows: tuple[int, ...],
    slot_ranks: tuple[int, ...],
    max_rank: int,
    pool_rows: int,
    hidden: int,
    widths: tuple[int, ...],
) -> _PoolPlan:
    # The kernels' clamp (a CPU call was range-checked before): up to max_rank, inside the pool.
    clamped = [0 if first < 0 else max(0, min(rank, max_rank, pool_rows - first))
               for first, rank in zip(first_rows, slot_ranks)]  # fmt: skip
    step = _step(meta)
    groups = _groups(step, clamped)
    if not groups:
        return _PoolPlan(None, 0, None, [])
    best_k, grid_rank = _split(groups, hidden, widths, meta.max_slots, compact=True)
    looped = [(slot, first_rows[slot], rank, step.order[start : start + count])
              for slot, start, count, rank in groups[:best_k]]  # fmt: skip
    gridded = sorted(groups[best_k:], key=lambda g: (first_rows[g[0]], g[0]))
    if not gridded:
        return _PoolPlan(None, 0, None, looped)
    grid = _grid(meta, step, [(slot, start, count) for slot, start, count, _ in gridded], compact=True)
    firsts = [first_rows[slot] for slot, _, _, _ in gridded]
    return _PoolPlan(grid, grid_rank, _pool_gather(grid, firsts, [g[3] for g in gridded], grid_rank), looped)


def _pool_gather(grid: _Grid, firsts: list[int], ranks: list[int], rank: int) -> _PoolGather:
    """How the grid's slots (first rows ``firsts``, ranks ``ranks``, in grid order) read the pool."""
    device = grid.x_index.device
    slots = torch.tensor(grid.slots, device=device)
    steps = {b - a for a, b in zip(firsts, firsts[1:])}
    if all(r == rank for r in ranks) and len(steps) <= 1:
        return _PoolGather(slots, (firsts[0], steps.pop() if steps else 0), None, None)
    index = torch.tensor([first + (j if j < r else 0) for first, r in zip(firsts, ranks) for j in range(rank)],
                         device=device)  # fmt: skip
    if min(ranks) == rank:
        return _PoolGather(slots, None, index, None)
    mask = torch.tensor([[float(j < r) for j in range(rank)] for r in ranks], device=device)
    return _PoolGather(slots, None, index, mask.view(len(ranks), 1, rank))


def _grid(meta: LoRAMeta, step: _Step, groups: list[tuple[int, int, int]], *, compact: bool) -> _Grid:
    """The grid of ``groups`` (ascending slots; ``compact``: a pool's, in the given order, one row per
    group and none for idle slots), shared by every plan of the step that grids them."""
    key = (_Grid, compact, tuple(groups))
    grid = meta.host_cache.get(key)
    if isinstance(grid, _Grid):
        return grid
    # Built as host lists, then one copy each: for a decode step's few hundred cells that is cheaper
    # than a dozen small torch ops (DENSE_MAX_MACS bounds the cells). Padding repeats a group's last
    # token; an idle slot's row repeats the first group's first token.
    slots = [slot for slot, _, _ in groups]
    size = max(count for _, _, count in groups)
    by_slot = {slot: (start, count) for slot, start, count in groups}
    order = step.order_list
    x_index: list[int] = []
    rows: list[int] = []
    cells: list[int] = []
    for slot in slots if compact else range(slots[0], slots[-1] + 1):
        start, count = by_slot.get(slot, (groups[0][1], 0))
        tokens = order[start : start + count]
        cells.extend(range(len(x_index), len(x_index) + count))
        x_index.extend(tokens + [order[start + max(count - 1, 0)]] * (size - count))
        rows.extend(tokens)
    device = step.order.device
    x_index_t = torch.tensor(x_index, device=device)
    padded = len(rows) < len(x_index)
    rows_t = torch.tensor(rows, device=device) if padded else x_index_t
    cells_t = torch.tensor(cells, device=device) if padded else None
    span = None if compact else slice(slots[0], slots[-1] + 1)
    grid = meta.host_cache[key] = _Grid(slots, span, size, x_index_t, rows_t, cells_t)
    return grid


def _packed_span(Bs: Sequence[torch.Tensor], slice_offsets: Sequence[int]) -> tuple[int, int] | None:
    """``(first, end)`` column when the slices tile one run of ``y``'s columns without gaps (a
    fused q/k/v or gate/up projection), else None."""
    spans = sorted((offset, offset + B.shape[1]) for B, offset in zip(Bs, slice_offsets))
    if any(end != next_start for (_, end), (next_start, _) in zip(spans, spans[1:])):
        return None
    return spans[0][0], spans[-1][1]


def _scale_rows(xs: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Apply ``scale`` to the fp32 gathered rows ``xs`` of an fp32 ``x`` in place (a fresh gather):
    once per call rather than once per slice. For bf16/fp16 it must wait for ``h`` to be rounded, so
    it is returned for :func:`_hidden`; None when already applied."""
    if dtype != torch.float32:
        return scale
    xs.mul_(scale)
    return None


def _hidden(h: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 shrink output rounded to the input dtype, as the kernels (and PEFT) do, then scaled."""
    if scale is None:
        return h
    return h.to(dtype).float().mul_(scale)


def _add_slices(
    y: torch.Tensor,
    rows: torch.Tensor,
    cells: torch.Tensor | None,
    deltas: list[tuple[int, torch.Tensor]],
    span: tuple[int, int] | None,
) -> None:
    """Add each slice's ``(offset, delta)`` into ``y[rows]``; ``cells`` picks the rows of ``delta``
    that hold real tokens. Slices that tile one run of columns are packed and added in one op."""
    if span is not None and len(deltas) > 1:
        first, end = span
        packed = deltas[0][1].new_empty(deltas[0][1].shape[0], end - first)
        for offset, delta in deltas:
            packed[:, offset - first : offset - first + delta.shape[1]].copy_(delta)
        deltas = [(first, packed)]
    for offset, delta in deltas:
        if cells is not None:
            delta = delta.index_select(0, cells)
        _add_into(y[:, offset : offset + delta.shape[1]], rows, delta)


def _add_into(y_cols: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """``y_cols[rows] += delta`` (``rows`` distinct) with fp32 addition and one rounding to ``y``'s
    dtype."""
    if y_cols.dtype != torch.float32:
        y_cols.index_copy_(0, rows, (y_cols.index_select(0, rows).float() + delta).to(y_cols.dtype))
    elif y_cols.is_contiguous():
        y_cols.index_add_(0, rows, delta)
    else:
        # On a column slice torch's CPU index_add_ falls back to a scatter several times slower
        # (118 vs 27 µs for the engine's gate/up decode shape); with distinct rows this is the same sum.
        y_cols.index_put_((rows,), delta, accumulate=True)


def _apply_grid(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scales: torch.Tensor,
    slice_offsets: Sequence[int],
    span: tuple[int, int] | None,
    grid: _Grid,
    rank: int,
) -> None:
    """Two ``bmm`` per slice over the grid; padded rank rows and columns up to ``rank`` are read, so
    they must hold zeros (the documented contract)."""
    assert grid.span is not None  # a slot-tensor grid
    num_rows = grid.span.stop - grid.span.start
    xs = x.index_select(0, grid.x_index).float().view(num_rows, grid.size, x.shape[1])
    scale = _scale_rows(xs, scales[grid.span].view(num_rows, 1, 1), x.dtype)
    # A grid over every slot at full rank reads the slot tensors as they are (two view ops fewer).
    whole = grid.span == slice(0, As[0].shape[0]) and rank == As[0].shape[1]
    deltas = []
    for A, B, offset in zip(As, Bs, slice_offsets):
        if not whole:
            A, B = A[grid.span, :rank], B[grid.span, :, :rank]
        h = _hidden(torch.bmm(xs, A.float().mT), x.dtype, scale)
        deltas.append((offset, torch.bmm(h, B.float().mT).view(-1, B.shape[1])))
    _add_slices(y, grid.rows, grid.cells, deltas, span)


def _apply_pool_grid(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scales: torch.Tensor,
    slice_offsets: Sequence[int],
    span: tuple[int, int] | None,
    grid: _Grid,
    rank: int,
    gather: _PoolGather,
) -> None:
    """Two ``bmm`` per slice over a pool's grid, on its slots' rows read as ``gather`` says; the
    scaling (and the padding's mask) multiplies ``h``, per slice."""
    num_rows = len(grid.slots)
    xs = x.index_select(0, grid.x_index).float().view(num_rows, grid.size, x.shape[1])
    scale = scales.index_select(0, gather.slots).view(num_rows, 1, 1)
    if gather.mask is not None:
        scale = scale * gather.mask
    deltas = []
    for A, Bt, offset in zip(As, Bs, slice_offsets):
        h = _hidden(torch.bmm(xs, gather.read(A, rank).float().mT), x.dtype, scale)
        deltas.append((offset, torch.bmm(h, gather.read(Bt, rank).float()).view(-1, Bt.shape[1])))
    _add_slices(y, grid.rows, grid.cells, deltas, span)


def _apply_group(
    y: torch.Tensor,
    x: torch.Tensor,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    scale: torch.Tensor,
    slice_offsets: Sequence[int],
    span: tuple[int, int] | None,
    rows: torch.Tensor,
) -> None:
    """One slot's tokens at the slot's own rank: ``views`` holds each slice's ``(A [r, K], B^T [r, N])``."""
    xs = x.index_select(0, rows).float()
    row_scale = _scale_rows(xs, scale, x.dtype)
    deltas = []
    for (a, bt), offset in zip(views, slice_offsets):
        h = _hidden(xs @ a.float().T, x.dtype, row_scale)
        deltas.append((offset, h @ bt.float()))
    _add_slices(y, rows, None, deltas, span)
