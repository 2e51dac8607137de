"""Triton kernels of the multi-LoRA op: a segmented split-K shrink and a segmented expand.

Both kernels walk the tile table of :class:`kernels.LoRAMeta`: a program owns up to ``BLOCK_M``
consecutive sorted positions of one active slot (a padding tile has slot ``-1`` and exits at once),
so a launch needs no host knowledge of the slot mix and a CUDA graph can replay it for any mix.

- shrink: ``h[k, slice, p, :] = x[token(p), K chunk k] @ A_slice[slot, :, K chunk k]^T`` in fp32. K
  is split over ``SPLIT_K`` programs per tile when tokens are few; their partial sums are written
  side by side (no atomics, so no zeroed buffer and no memset launch).
- expand: ``y[token(p), off_slice + n] += scaling[slot] * (sum_k h[k, slice, p]) @ B_slice[slot, n]^T``:
  the partials are added and ``h`` rounded to the input dtype once per tile (as PEFT's own bf16 path
  does); a program then walks a chunk of output columns ``BLOCK_N`` at a time, optionally loading
  the next block of ``B`` and ``y`` before adding the current one (``PREFETCH``).

One launch of each serves every slice of a fused projection (last grid axis). Slot ``s`` reads only
its first ``ranks[s]`` rows of A and columns of B: masked loads fetch no memory, so a zero-padded
smaller adapter costs its own rank.

Both layouts of :class:`kernels.LoRAWeights` run the same kernels. A slot's rank row ``r`` sits at
``first_row * stride_s + r * stride_r``: for slot tensors ``first_row`` is the slot and the strides
are the 3-D tensors' own; for a row pool (``HAS_ROWS``) ``first_row = rows[slot]`` is read on the
device and ``stride_s = stride_r`` is the pool's row stride (``A_pool [P, K]``, ``Bt_pool [P, N]``,
whose rows are B's columns, so the expand reads contiguous ``n``). The launch tables and the rank
block are keyed on ``max_rank`` there, and a slot's rank is clamped to it and to the pool's end.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.jit import jit
from kernels.meta import LoRAMeta

# Streaming multiprocessors the launch heuristics size grids for (H200: 132).
_SMS = 132
# Steps of at most this many tokens take row tiles of 16 and the decode tables. A serving step of
# this size is a decode batch spread over many adapters plus a prompt or two, and 64-row tiles
# would be mostly empty for the decode groups: on the H200 (bench/lora_mixed.py, one layer of the
# 8B shape, 32 slots, rank 16) the decode tables took 87 against 150 us for 63 decodes + a
# 256-token prompt, 91 against 150 for 150 + 256, and 76.5 against 79.2 even for two 256-token
# prompts. Past 512 tokens (not measured) the prefill tables stay.
DECODE_MAX_TOKENS = 512

T = TypeVar("T")


@jit
def _pick_ptr(index: tl.tensor, p0: tl.tensor, p1: tl.tensor, p2: tl.tensor) -> tl.tensor:
    """The slice's pointer among three."""
    if index == 0:
        ptr = p0
    elif index == 1:
        ptr = p1
    else:
        ptr = p2
    return ptr


@jit
def _pick_int(index: tl.tensor, v0: tl.tensor, v1: tl.tensor, v2: tl.tensor) -> tl.tensor:
    """The slice's integer among three, by arithmetic: Triton turns integer arguments equal to 1 (a
    unit stride) into compile-time constants, which cannot flow out of a run-time branch."""
    return v0 * (index == 0) + v1 * (index == 1) + v2 * (index == 2)


@jit
def _dot(a: tl.tensor, b: tl.tensor, acc: tl.tensor, PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> tl.tensor:
    """``acc + a @ b`` with fp32 accumulation.

    ``UPCAST`` is set only under ``TRITON_INTERPRET=1`` for bf16: the interpreter multiplies bf16
    tiles as their raw uint16 bits. Products of bf16 values are exact in fp32, so the upcast dot
    computes what the tensor cores compute.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@jit
def _tile(tile_slot_ptr: tl.tensor, tile_start_ptr: tl.tensor, tile_end_ptr: tl.tensor, token_idx_ptr: tl.tensor,
          ranks_ptr: tl.tensor, slot_rows_ptr: tl.tensor, pid_m: tl.tensor, full_rank: tl.tensor,
          pool_rows: tl.tensor, HAS_RANKS: tl.constexpr, HAS_ROWS: tl.constexpr,
          BLOCK_M: tl.constexpr) -> tuple[tl.tensor, ...]:  # fmt: skip
    """The tile's slot, the slot's first row (int64: the slot itself, or its first pool row), its
    rank, its sorted positions, their mask and their token ids. Slot -1 marks a padding tile.

    The rank is clamped to the padded R (or max_rank) and, in a pool, to the rows left before the
    pool's end, with a negative first row giving rank 0: CUDA cannot range-check without a sync,
    and the clamp keeps every load inside the tensors."""
    slot = tl.load(tile_slot_ptr + pid_m)
    rank = full_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + tl.maximum(slot, 0)), full_rank)
    first_row = slot.to(tl.int64)
    if HAS_ROWS:
        first_row = tl.load(slot_rows_ptr + tl.maximum(slot, 0)).to(tl.int64)
        rank = tl.where(first_row < 0, 0, tl.maximum(tl.minimum(rank, pool_rows - first_row), 0))
    rows = tl.load(tile_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(tile_end_ptr + pid_m)
    tokens = tl.load(token_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return slot, first_row, rank, rows, row_mask, tokens


@jit
def _shrink_tile(x_ptr: tl.tensor, a_rows: tl.tensor, tokens: tl.tensor, row_mask: tl.tensor, offs_r: tl.tensor,
                 r_mask: tl.tensor, k_lo: tl.tensor, k_hi: tl.tensor, stride_xt: tl.tensor, stride_xk: tl.tensor,
                 stride_ak: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, K_STAGES: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr) -> tl.tensor:  # fmt: skip
    """``x[tokens, k_lo:k_hi] @ A[:, k_lo:k_hi]^T`` in fp32 (``a_rows``: the slot's A rows ``offs_r``)."""
    x_rows = x_ptr + tokens[:, None] * stride_xt
    a_cols = a_rows[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=K_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_tile = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=row_mask[:, None], other=0.0)
            a_tile = tl.load(a_cols + offs_k[:, None] * stride_ak, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < k_hi
            x_tile = tl.load(
                x_rows + offs_k[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            a_tile = tl.load(a_cols + offs_k[:, None] * stride_ak, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc = _dot(x_tile, a_tile, acc, PRECISION, UPCAST)
    return acc


@jit
def _expand_columns(h: tl.tensor, scale: tl.tensor, b_cols: tl.tensor, y_rows: tl.tensor, row_mask: tl.tensor,
                    r_mask: tl.tensor, n_lo: tl.tensor, n_hi: tl.tensor, col_offset: tl.tensor, stride_bn: tl.tensor,
                    stride_yn: tl.tensor, dora_row: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREFETCH: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    HAS_DORA: tl.constexpr) -> None:  # fmt: skip
    """``y[rows, col_offset + n] += scale * h @ B[n, :]^T`` for ``n`` in ``[n_lo, n_hi)``; with
    ``HAS_DORA`` the sum is then multiplied by ``dora_row[col_offset + n]`` (DoRA's epilogue: one
    more load per column block, no launch of its own).

    ``h`` is ``[BLOCK_M, BLOCK_R]`` in the input dtype, ``b_cols`` the slot's B at ``n = 0`` for each
    rank index, ``y_rows`` the tile's rows of y at column 0. With ``PREFETCH``, block ``i + 1`` of B
    and y is loaded before block ``i`` is added and stored, so two blocks of loads are in flight
    (the compiler cannot hoist a load of y above the previous block's store to y). The compiler's
    own pipelining is off for this loop either way.
    """
    offs = tl.arange(0, BLOCK_N)
    b_rows = b_cols[:, None]
    if PREFETCH:
        cols = n_lo + offs
        mask = cols < n_hi
        b_tile = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_mask[:, None] & mask[None, :], other=0.0)
        y_tile = tl.load(y_rows + (col_offset + cols)[None, :] * stride_yn,
                         mask=row_mask[:, None] & mask[None, :], other=0.0)  # fmt: skip
    for n in tl.range(n_lo, n_hi, BLOCK_N, num_stages=1):
        cols = n + offs
        mask = cols < n_hi
        if PREFETCH:
            next_cols = cols + BLOCK_N
            next_mask = next_cols < n_hi
            b_next = tl.load(b_rows + next_cols[None, :] * stride_bn, mask=r_mask[:, None] & next_mask[None, :],
                             other=0.0)  # fmt: skip
            y_next = tl.load(y_rows + (col_offset + next_cols)[None, :] * stride_yn,
                             mask=row_mask[:, None] & next_mask[None, :], other=0.0)  # fmt: skip
        else:
            b_tile = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_mask[:, None] & mask[None, :], other=0.0)
            y_tile = tl.load(y_rows + (col_offset + cols)[None, :] * stride_yn,
                             mask=row_mask[:, None] & mask[None, :], other=0.0)  # fmt: skip
        acc = _dot(h, b_tile, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, UPCAST)
        total = y_tile.to(tl.float32) + acc * scale
        if HAS_DORA:
            total *= tl.load(dora_row + col_offset + cols, mask=mask, other=1.0).to(tl.float32)[None, :]
        out = total.to(y_tile.dtype)
        tl.store(y_rows + (col_offset + cols)[None, :] * stride_yn, out, mask=row_mask[:, None] & mask[None, :])
        if PREFETCH:
            b_tile = b_next
            y_tile = y_next


@jit
def _shrink_kernel(
    x_ptr: tl.tensor, a0_ptr: tl.tensor, a1_ptr: tl.tensor, a2_ptr: tl.tensor, h_ptr: tl.tensor,
    tile_slot_ptr: tl.tensor, tile_start_ptr: tl.tensor, tile_end_ptr: tl.tensor, token_idx_ptr: tl.tensor,
    ranks_ptr: tl.tensor, slot_rows_ptr: tl.tensor,
    K: tl.tensor, full_rank: tl.tensor, pool_rows: tl.tensor,
    stride_xt: tl.tensor, stride_xk: tl.tensor, stride_as: tl.tensor, stride_ar: tl.tensor, stride_ak: tl.tensor,
    stride_hk: tl.tensor, stride_hs: tl.tensor, stride_hp: tl.tensor,
    HAS_RANKS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, K_STAGES: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
) -> None:  # fmt: skip
    """``h[pid_k, slice, p, :rank]`` = this program's K chunk of ``x[token(p)] @ A_slice[slot]^T``."""
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot, first_row, rank, rows, row_mask, tokens = _tile(
        tile_slot_ptr, tile_start_ptr, tile_end_ptr, token_idx_ptr, ranks_ptr, slot_rows_ptr, pid_m, full_rank,
        pool_rows, HAS_RANKS, HAS_ROWS, BLOCK_M,
    )  # fmt: skip
    if (slot < 0) | (rank == 0):
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_rows = _pick_ptr(pid_s, a0_ptr, a1_ptr, a2_ptr) + first_row * stride_as + offs_r * stride_ar
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    acc = _shrink_tile(x_ptr, a_rows, tokens, row_mask, offs_r, r_mask, k_lo, tl.minimum(k_lo + k_chunk, K),
                       stride_xt, stride_xk, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, K_STAGES, PRECISION,
                       UPCAST)  # fmt: skip
    h_ptrs = h_ptr + pid_k * stride_hk + pid_s * stride_hs + rows[:, None] * stride_hp + offs_r[None, :]
    tl.store(h_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


@jit
def _expand_kernel(
    h_ptr: tl.tensor, b0_ptr: tl.tensor, b1_ptr: tl.tensor, b2_ptr: tl.tensor, y_ptr: tl.tensor,
    tile_slot_ptr: tl.tensor, tile_start_ptr: tl.tensor, tile_end_ptr: tl.tensor, token_idx_ptr: tl.tensor,
    ranks_ptr: tl.tensor, slot_rows_ptr: tl.tensor, scaling_ptr: tl.tensor, dora_ptr: tl.tensor,
    stride_dora: tl.tensor, full_rank: tl.tensor, pool_rows: tl.tensor, n0: tl.tensor, n1: tl.tensor, n2: tl.tensor, off0: tl.tensor,
    off1: tl.tensor, off2: tl.tensor, n_chunk: tl.tensor,
    stride_bs0: tl.tensor, stride_bs1: tl.tensor, stride_bs2: tl.tensor,
    stride_bn0: tl.tensor, stride_bn1: tl.tensor, stride_bn2: tl.tensor,
    stride_br0: tl.tensor, stride_br1: tl.tensor, stride_br2: tl.tensor,
    stride_hk: tl.tensor, stride_hs: tl.tensor, stride_hp: tl.tensor, stride_yt: tl.tensor, stride_yn: tl.tensor,
    HAS_RANKS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_DORA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
) -> None:  # fmt: skip
    """``y[token(p), off_slice + cols] += scaling[slot] * (sum of h partials)[p] @ B_slice[slot, cols]^T``
    (with ``HAS_DORA``, then times ``dora[slot + 1, off_slice + cols]``)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot, first_row, rank, rows, row_mask, tokens = _tile(
        tile_slot_ptr, tile_start_ptr, tile_end_ptr, token_idx_ptr, ranks_ptr, slot_rows_ptr, pid_m, full_rank,
        pool_rows, HAS_RANKS, HAS_ROWS, BLOCK_M,
    )  # fmt: skip
    width = _pick_int(pid_s, n0, n1, n2)
    n_lo = pid_n * n_chunk
    if (slot < 0) | (rank == 0) | (n_lo >= width):
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h_ptrs = h_ptr + pid_s * stride_hs + rows[:, None] * stride_hp + offs_r[None, :]
    h_mask = row_mask[:, None] & r_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(h_ptrs + i * stride_hk, mask=h_mask, other=0.0)

    b_cols = _pick_ptr(pid_s, b0_ptr, b1_ptr, b2_ptr) + offs_r * _pick_int(pid_s, stride_br0, stride_br1, stride_br2)
    b_cols += first_row * _pick_int(pid_s, stride_bs0, stride_bs1, stride_bs2)
    if HAS_ROWS:
        # A pool's rows are contiguous (LoRAWeights checks it): a compile-time unit stride along n lets
        # the compiler vectorise the loads of B^T, which a picked stride hides (3x slower on the H200).
        stride_bn = 1
    else:
        stride_bn = _pick_int(pid_s, stride_bn0, stride_bn1, stride_bn2)
    h = acc.to(b0_ptr.dtype.element_ty)
    scale = tl.load(scaling_ptr + slot).to(tl.float32)
    _expand_columns(h, scale, b_cols, y_ptr + tokens[:, None] * stride_yt, row_mask, r_mask, n_lo,
                    tl.minimum(n_lo + n_chunk, width), _pick_int(pid_s, off0, off1, off2), stride_bn, stride_yn,
                    dora_ptr + (slot + 1) * stride_dora, BLOCK_M, BLOCK_N, PREFETCH, PRECISION, UPCAST,
                    HAS_DORA)  # fmt: skip


# True when TRITON_INTERPRET=1 was set before this module was imported: the kernels then run on CPU
# tensors through Triton's interpreter (tests), not compiled for a GPU.
INTERPRETED = isinstance(_shrink_kernel, InterpretedFunction)


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandConfig:
    """``programs``: the grid size the column split aims for (each program loops over its chunk);
    ``ONE_BLOCK_EACH`` gives every program a single ``block_n`` block."""

    block_m: int
    block_n: int
    programs: int
    prefetch: bool
    num_warps: int
    num_stages: int


# An expand ``programs`` target no grid reaches: one column block per program.
ONE_BLOCK_EACH = 1 << 30

# The launch tables, keyed by rank class (:func:`rank_class`); no run-time autotuning, which would
# break graph capture. The fastest configurations of the H200 sweep in docs/benchmarks.md; the
# compiler's resource report for sm_90 shows no register spills in any of them.
#
# Decode-sized steps: 16-row tiles, K split until the shrink grid has about this many programs.
DECODE_SHRINK_PROGRAMS = 8 * _SMS
DECODE_EXPAND: dict[int, ExpandConfig] = {
    16: ExpandConfig(block_m=16, block_n=128, programs=16 * _SMS, prefetch=True, num_warps=4, num_stages=1),
    64: ExpandConfig(block_m=16, block_n=64, programs=ONE_BLOCK_EACH, prefetch=False, num_warps=4,
                     num_stages=1),
    128: ExpandConfig(block_m=16, block_n=64, programs=ONE_BLOCK_EACH, prefetch=False, num_warps=4,
                      num_stages=1),
}  # fmt: skip
PREFILL_SHRINK: dict[int, ShrinkConfig] = {
    16: ShrinkConfig(block_m=64, block_k=128, split_k=4, num_warps=8, num_stages=4),
    64: ShrinkConfig(block_m=64, block_k=64, split_k=4, num_warps=8, num_stages=3),
}
PREFILL_EXPAND: dict[int, ExpandConfig] = {
    16: ExpandConfig(block_m=64, block_n=128, programs=16 * _SMS, prefetch=True, num_warps=8, num_stages=1),
    64: ExpandConfig(block_m=64, block_n=64, programs=8 * _SMS, prefetch=True, num_warps=8, num_stages=1),
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_r(rank: int) -> int:
    """The rank block: the whole padded rank in one block (at least 16, tl.dot's minimum)."""
    return _next_pow2(max(rank, 16))


def rank_class(rank: int) -> int:
    """The launch tables' key for a padded rank: 16 (up to 16), 64 (up to 64) or 128 (above)."""
    return 16 if rank <= 16 else 64 if rank <= 64 else 128


def _column_chunk(width: int, block_n: int, other_programs: int, programs: int) -> int:
    """Columns per program: split ``width`` into whole blocks over enough programs that the grid
    (``other_programs`` along the other axes) reaches about ``programs``."""
    blocks: int = triton.cdiv(width, block_n)
    split = max(1, min(blocks, programs // max(1, other_programs)))
    chunk_blocks: int = triton.cdiv(blocks, split)
    return chunk_blocks * block_n


def _block_k(block_k: int, rank: int, hidden: int) -> int:
    """The table's K block, no wider than K needs, and narrower for ranks above 64 so a pipeline
    stage of A (``BLOCK_K x BLOCK_R``) stays within 16 K elements."""
    return max(16, min(block_k, _next_pow2(hidden), 16384 // block_r(rank)))


def _three(values: Sequence[T], fill: T) -> list[T]:
    """Pad per-slice arguments to the kernels' three slots (unused slots are never read)."""
    return list(values) + [fill] * (3 - len(values))


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """(dot input precision, upcast flag) for the input dtype.

    fp32 stays fp32 on the tensor cores (no silent TF32): it is the accuracy path, not the fast one.
    """
    return ("ieee" if dtype == torch.float32 else "tf32"), (dtype == torch.bfloat16 and INTERPRETED)


def lora_apply_triton(
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
    dora_scale: torch.Tensor | None = None,
) -> None:
    """Shrink then expand for every slice (arguments validated by :class:`kernels.LoRAWeights`):
    slot tensors, or with ``rows`` row pools whose slots have at most ``max_rank`` rows;
    ``dora_scale`` multiplies each slot's output columns in the expand's epilogue."""
    if meta.num_tokens == 0:
        return
    h = shrink(x, As, meta, ranks, rows=rows, max_rank=max_rank)
    expand(y, h, Bs, scaling, meta, slice_offsets, ranks, rows=rows, max_rank=max_rank, dora_scale=dora_scale)


def _full_rank(slots: torch.Tensor, rank_dim: int, rows: torch.Tensor | None, max_rank: int | None) -> int:
    """The rank the kernels are sized for: the slot tensors' R, or a row pool's ``max_rank``."""
    if rows is None:
        return slots.shape[rank_dim]
    if max_rank is None:
        raise TypeError("a row pool (rows given) needs max_rank")
    return max_rank


def shrink_config(
    meta: LoRAMeta, hidden: int, rank: int, num_slices: int = 1, programs: int | None = None
) -> ShrinkConfig:
    """The prefill table's shrink; for a decode-sized step 16-row tiles, split-K until the grid has
    about ``programs`` (default ``DECODE_SHRINK_PROGRAMS``) programs."""
    if meta.num_tokens > DECODE_MAX_TOKENS:
        return PREFILL_SHRINK[min(rank_class(rank), 64)]
    return _decode_shrink(meta.grid_tiles(16) * num_slices, hidden, rank, programs or DECODE_SHRINK_PROGRAMS)


@functools.lru_cache(maxsize=4096)
def _decode_shrink(tiles: int, hidden: int, rank: int, programs: int) -> ShrinkConfig:
    """Cached: an engine asks the same few questions 128 times a step, and host time is its cost."""
    block_k = _block_k(256, rank, hidden)
    split_k = 1
    while tiles * split_k * 2 <= programs and split_k * 2 * block_k <= hidden:
        split_k *= 2
    return ShrinkConfig(16, block_k, split_k, 4, 3)


def expand_config(meta: LoRAMeta, rank: int) -> ExpandConfig:
    """The prefill or the decode table's expand."""
    table = PREFILL_EXPAND if meta.num_tokens > DECODE_MAX_TOKENS else DECODE_EXPAND
    return table[min(rank_class(rank), max(table))]


def shrink(
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    meta: LoRAMeta,
    ranks: torch.Tensor | None,
    config: ShrinkConfig | None = None,
    *,
    rows: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> torch.Tensor:
    """``h [split_k, slices, T, R_pad]`` fp32 partial sums, row ``p`` = sorted position ``p`` (only
    adapter rows and each slot's own rank are written: :func:`expand` reads nothing else). ``As``:
    slot tensors ``[S, R, K]``, or with ``rows`` row pools ``[P, K]``."""
    num_slices, hidden, rank = len(As), x.shape[1], _full_rank(As[0], 1, rows, max_rank)
    if any(A.stride() != As[0].stride() for A in As):
        raise ValueError("all slices' A must have the same strides (use contiguous slot tensors)")
    A0 = As[0]
    # (slot, rank row, k) strides: a pool's rank rows are its rows.
    a_strides = (A0.stride(0), A0.stride(1), A0.stride(2)) if rows is None else (A0.stride(0), *A0.stride())
    sc = config or shrink_config(meta, hidden, rank, num_slices)
    block_k = _block_k(sc.block_k, rank, hidden)
    precision, upcast = _precision(x.dtype)
    tile_slot, tile_start, tile_end = meta.tiles(sc.block_m)
    h = torch.empty((sc.split_k, num_slices, meta.num_tokens, block_r(rank)), dtype=torch.float32, device=x.device)
    a = _three(As, A0)
    grid = (sc.split_k, meta.grid_tiles(sc.block_m), num_slices)
    _shrink_kernel[grid](
        x, a[0], a[1], a[2], h,
        tile_slot, tile_start, tile_end, meta.token_indices, ranks if ranks is not None else tile_slot,
        rows if rows is not None else tile_slot,
        hidden, rank, A0.shape[0],
        x.stride(0), x.stride(1), *a_strides, h.stride(0), h.stride(1), h.stride(2),
        HAS_RANKS=ranks is not None, HAS_ROWS=rows is not None, BLOCK_M=sc.block_m, BLOCK_R=block_r(rank),
        BLOCK_K=block_k,
        SPLIT_K=sc.split_k, EVEN_K=hidden % (sc.split_k * block_k) == 0, K_STAGES=sc.num_stages,
        PRECISION=precision, UPCAST=upcast,
        num_warps=sc.num_warps, num_stages=sc.num_stages,
    )  # fmt: skip
    return h


def expand(
    y: torch.Tensor,
    h: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor | None,
    config: ExpandConfig | None = None,
    *,
    rows: torch.Tensor | None = None,
    max_rank: int | None = None,
    dora_scale: torch.Tensor | None = None,
) -> None:
    """``y[token(p), slice columns] += scaling[slot] * h[:, slice, p].sum(0) @ B_slice[slot]^T``,
    then times ``dora_scale[slot + 1, columns]`` when given (DoRA, :class:`kernels.LoRAWeights`).
    ``Bs``: slot tensors ``[S, N, R]``, or with ``rows`` transposed row pools ``[P, N]`` with unit
    stride along ``N``."""
    num_slices, rank = len(Bs), _full_rank(Bs[0], 2, rows, max_rank)
    ec = config or expand_config(meta, rank)
    precision, upcast = _precision(y.dtype)
    tile_slot, tile_start, tile_end = meta.tiles(ec.block_m)
    tiles = meta.grid_tiles(ec.block_m)
    b = _three(Bs, Bs[0])
    widths = _three([B.shape[1] for B in Bs], 0)
    n_chunk = _column_chunk(max(widths), ec.block_n, tiles * num_slices, ec.programs)
    grid = (triton.cdiv(max(widths), n_chunk), tiles, num_slices)
    # (slot, n, rank row) strides: a transposed pool's rank rows are its rows.
    b_strides = [(B.stride(0), B.stride(1), B.stride(2)) if rows is None else (B.stride(0), B.stride(1), B.stride(0))
                 for B in b]  # fmt: skip
    _expand_kernel[grid](
        h, b[0], b[1], b[2], y,
        tile_slot, tile_start, tile_end, meta.token_indices, ranks if ranks is not None else tile_slot,
        rows if rows is not None else tile_slot, scaling, dora_scale if dora_scale is not None else scaling,
        dora_scale.stride(0) if dora_scale is not None else 0,
        rank, Bs[0].shape[0], *widths, *_three(slice_offsets, 0), n_chunk,
        *(st[0] for st in b_strides), *(st[1] for st in b_strides), *(st[2] for st in b_strides),
        h.stride(0), h.stride(1), h.stride(2), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, HAS_ROWS=rows is not None, HAS_DORA=dora_scale is not None,
        BLOCK_M=ec.block_m, BLOCK_N=ec.block_n,
        BLOCK_R=block_r(rank), SPLIT_K=h.shape[0], PREFETCH=ec.prefetch, PRECISION=precision, UPCAST=upcast,
        num_warps=ec.num_warps, num_stages=ec.num_stages,
    )  # fmt: skip
