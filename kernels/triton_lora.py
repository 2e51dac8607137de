"""Triton kernels of the multi-LoRA op: a segmented shrink and a segmented expand.

Both kernels walk the tile table of :class:`kernels.LoRAMeta`: program ``m`` of the first grid axis
owns up to ``BLOCK_M`` consecutive sorted positions of one active slot (a padding tile has slot
``-1`` and exits at once), so a launch needs no host knowledge of the slot mix and a CUDA graph can
replay it for any mix.

- shrink: ``h[slice, p, :] = x[token(p)] @ A_slice[slot]^T`` in fp32 for every sorted position
  ``p``. With few tokens there is little to parallelise over tokens, so K is split across programs
  (split-K) and the partial sums are added atomically into a zeroed ``h``.
- expand: ``y[token(p), off_slice + n] += scaling[slot] * h[slice, p, :] @ B_slice[slot, n, :]^T``
  with fp32 accumulation; ``h`` is first rounded to the input dtype (as PEFT's own bf16 path does).

One launch of each serves every slice of a fused projection (third grid axis). Slot ``s`` reads only
its first ``ranks[s]`` rows of A and columns of B: masked loads fetch no memory, so a zero-padded
smaller adapter costs its own rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.meta import LoRAMeta

# Programs per streaming multiprocessor the split-K heuristic aims for (H200: 132 SMs).
_TARGET_PROGRAMS = 132 * 4


@triton.jit
def _pick_ptr(index, p0, p1, p2):
    """The slice's pointer among three."""
    if index == 0:
        ptr = p0
    elif index == 1:
        ptr = p1
    else:
        ptr = p2
    return ptr


@triton.jit
def _pick_int(index, v0, v1, v2):
    """The slice's integer among three, by arithmetic: Triton turns integer arguments equal to 1 (a
    unit stride) into compile-time constants, which cannot flow out of a run-time branch."""
    return v0 * (index == 0) + v1 * (index == 1) + v2 * (index == 2)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    ``UPCAST`` is set only under ``TRITON_INTERPRET=1`` for bf16: the interpreter multiplies bf16
    tiles as their raw uint16 bits. Products of bf16 values are exact in fp32, so the upcast dot
    computes what the tensor cores compute.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    h_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    token_idx_ptr,
    ranks_ptr,
    K,
    full_rank,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_hs,
    stride_hp,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_kr = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + pid_m)
    if slot < 0:
        return
    rank = full_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), full_rank)  # never past the padded R
    pid_k = pid_kr % SPLIT_K
    r_start = (pid_kr // SPLIT_K) * BLOCK_R
    if r_start >= rank:
        return

    a_ptr = _pick_ptr(pid_s, a0_ptr, a1_ptr, a2_ptr)
    rows = tl.load(tile_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(tile_end_ptr + pid_m)
    tokens = tl.load(token_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank

    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    x_rows = x_ptr + tokens[:, None] * stride_xt
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
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

    h_ptrs = h_ptr + pid_s * stride_hs + rows[:, None] * stride_hp + offs_r[None, :]
    h_mask = row_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=h_mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=h_mask, sem="relaxed")


@triton.jit
def _expand_kernel(
    h_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    token_idx_ptr,
    ranks_ptr,
    scaling_ptr,
    full_rank,
    n0,
    n1,
    n2,
    off0,
    off1,
    off2,
    stride_bs0,
    stride_bs1,
    stride_bs2,
    stride_bn0,
    stride_bn1,
    stride_bn2,
    stride_br0,
    stride_br1,
    stride_br2,
    stride_hs,
    stride_hp,
    stride_yt,
    stride_yn,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + pid_m)
    if slot < 0:
        return
    width = _pick_int(pid_s, n0, n1, n2)
    n_start = pid_n * BLOCK_N
    if n_start >= width:
        return
    rank = full_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), full_rank)  # never past the padded R
    if rank == 0:
        return

    b_ptr = _pick_ptr(pid_s, b0_ptr, b1_ptr, b2_ptr)
    stride_bs = _pick_int(pid_s, stride_bs0, stride_bs1, stride_bs2)
    stride_bn = _pick_int(pid_s, stride_bn0, stride_bn1, stride_bn2)
    stride_br = _pick_int(pid_s, stride_br0, stride_br1, stride_br2)
    col_offset = _pick_int(pid_s, off0, off1, off2)

    rows = tl.load(tile_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(tile_end_ptr + pid_m)
    tokens = tl.load(token_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width

    h_rows = h_ptr + pid_s * stride_hs + rows[:, None] * stride_hp
    b_cols = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h_tile = tl.load(h_rows + offs_r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b_tile = tl.load(b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        h_tile = h_tile.to(b_ptr.dtype.element_ty)
        acc = _dot(h_tile, b_tile, acc, PRECISION, UPCAST)
    acc = acc * tl.load(scaling_ptr + slot).to(tl.float32)

    y_ptrs = y_ptr + tokens[:, None] * stride_yt + (col_offset + offs_n)[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


# True when TRITON_INTERPRET=1 was set before this module was imported: the kernels then run on CPU
# tensors through Triton's interpreter (tests), not compiled for a GPU.
INTERPRETED = isinstance(_shrink_kernel, InterpretedFunction)


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_r: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_m(num_tokens: int) -> int:
    """Decode-sized steps (few tokens per adapter) tile rows by 16, prefill by 64."""
    return 16 if num_tokens <= 256 else 64


def shrink_config(meta: LoRAMeta, hidden: int, rank: int, num_slices: int) -> ShrinkConfig:
    """Launch configuration of the shrink for this step (table-driven, no autotuning at run time).

    From the H200 sweep and the compiler's register report (docs/benchmarks.md): decode splits K
    until the grid has about four programs per SM; prefill reads x in 64-wide K blocks with split-K
    4, and 8 warps at rank 64, the widest tiles that still compile without register spills.
    """
    block_m = _block_m(meta.num_tokens)
    block_r = min(_next_pow2(max(rank, 16)), 64)
    if block_m == 64:
        block_k = min(64, max(16, _next_pow2(hidden)))
        split_k = max(1, min(4, hidden // block_k))
        return ShrinkConfig(block_m, block_r, block_k, split_k, 4 if block_r <= 16 else 8, 3)
    block_k = min(256, max(16, _next_pow2(hidden)))
    programs = meta.grid_tiles(block_m) * triton.cdiv(rank, block_r) * num_slices
    split_k = 1
    while programs * split_k * 2 <= _TARGET_PROGRAMS and split_k * 2 * block_k <= hidden:
        split_k *= 2
    return ShrinkConfig(block_m, block_r, block_k, split_k, 4, 3)


def expand_config(meta: LoRAMeta, rank: int) -> ExpandConfig:
    """Launch configuration of the expand for this step (same sources): 64 output columns a
    program; 8 warps for prefill tiles at rank 64 so the accumulator does not spill."""
    block_m = _block_m(meta.num_tokens)
    block_r = min(_next_pow2(max(rank, 16)), 64)
    if block_m == 16:
        return ExpandConfig(block_m, 64, block_r, 4, 3)
    return ExpandConfig(block_m, 64, block_r, 4 if block_r <= 16 else 8, 2)


def _three(values: Sequence, fill) -> list:
    """Pad per-slice arguments to the kernels' three slots (unused slots are never read)."""
    return list(values) + [fill] * (3 - len(values))


def lora_apply_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor | None,
) -> None:
    """Shrink then expand for every slice (arguments validated by :func:`kernels.lora_apply_sliced`)."""
    if meta.num_tokens == 0:
        return
    h = shrink(x, As, meta, ranks)
    expand(y, h, Bs, scaling, meta, slice_offsets, ranks)


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """(dot input precision, upcast flag) for the input dtype.

    fp32 stays fp32 on the tensor cores (no silent TF32): it is the accuracy path, not the fast one.
    """
    return ("ieee" if dtype == torch.float32 else "tf32"), (dtype == torch.bfloat16 and INTERPRETED)


def shrink(
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    meta: LoRAMeta,
    ranks: torch.Tensor | None,
    config: ShrinkConfig | None = None,
) -> torch.Tensor:
    """``h [slices, T, R_pad]`` fp32, row ``p`` = sorted position ``p`` (only adapter rows written)."""
    num_slices = len(As)
    hidden = x.shape[1]
    A0 = As[0]
    rank = A0.shape[1]
    if any(A.stride() != A0.stride() for A in As):
        raise ValueError("all slices' A must have the same strides (use contiguous slot tensors)")
    sc = config or shrink_config(meta, hidden, rank, num_slices)
    precision, upcast = _precision(x.dtype)
    tile_slot, tile_start, tile_end = meta.tiles(sc.block_m)
    rank_pad = triton.cdiv(rank, sc.block_r) * sc.block_r
    # Split-K partial sums are added atomically, so h starts at zero; otherwise every read row is written.
    alloc = torch.zeros if sc.split_k > 1 else torch.empty
    h = alloc((num_slices, meta.num_tokens, rank_pad), dtype=torch.float32, device=x.device)
    a = _three(As, A0)
    grid = (meta.grid_tiles(sc.block_m), sc.split_k * triton.cdiv(rank, sc.block_r), num_slices)
    _shrink_kernel[grid](
        x, a[0], a[1], a[2], h,
        tile_slot, tile_start, tile_end, meta.token_indices, ranks if ranks is not None else tile_slot,
        hidden, rank,
        x.stride(0), x.stride(1),
        A0.stride(0), A0.stride(1), A0.stride(2),
        h.stride(0), h.stride(1),
        HAS_RANKS=ranks is not None,
        BLOCK_M=sc.block_m, BLOCK_R=sc.block_r, BLOCK_K=sc.block_k, SPLIT_K=sc.split_k,
        EVEN_K=hidden % (sc.split_k * sc.block_k) == 0,
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
) -> None:
    """``y[token(p), slice columns] += scaling[slot] * h[slice, p] @ B_slice[slot]^T`` in place."""
    num_slices = len(Bs)
    rank = Bs[0].shape[2]
    ec = config or expand_config(meta, rank)
    precision, upcast = _precision(y.dtype)
    tile_slot, tile_start, tile_end = meta.tiles(ec.block_m)
    b = _three(Bs, Bs[0])
    widths = _three([B.shape[1] for B in Bs], 0)
    offsets = _three(slice_offsets, 0)
    grid = (meta.grid_tiles(ec.block_m), triton.cdiv(max(widths), ec.block_n), num_slices)
    _expand_kernel[grid](
        h, b[0], b[1], b[2], y,
        tile_slot, tile_start, tile_end, meta.token_indices, ranks if ranks is not None else tile_slot, scaling,
        rank,
        *widths, *offsets,
        *(B.stride(0) for B in b), *(B.stride(1) for B in b), *(B.stride(2) for B in b),
        h.stride(0), h.stride(1),
        y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None,
        BLOCK_M=ec.block_m, BLOCK_N=ec.block_n, BLOCK_R=ec.block_r,
        PRECISION=precision, UPCAST=upcast,
        num_warps=ec.num_warps, num_stages=ec.num_stages,
    )  # fmt: skip
