"""Weight-only INT4 in AutoAWQ's "GEMM" layout (the layout AWQ checkpoints on the hub use, and
vLLM's ``awq`` loader reads): a linear layer ``y = x @ W`` with ``W [in, out]`` (the transpose of
torch's ``weight [out, in]``) is stored as

- ``qweight [in, out / 8]`` int32: eight 4-bit values per word, in AWQ's interleaved nibble order:
  nibble ``i`` (bits ``4i .. 4i + 3``) of word ``c`` holds column ``8c + AWQ_ORDER[i]``
  (``AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7``), so column ``8c + j`` is nibble ``AWQ_REVERSE_ORDER[j]``;
- ``qzeros [in / group, out / 8]`` int32: the zero points, packed the same way;
- ``scales [in / group, out]`` float16: one scale per group of ``group`` input rows per column.

The dequantized weight is ``W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]``. The
difference is an integer in [-15, 15] and the scale an fp16, so their product is exact in fp32;
:func:`dequantize` computes it there and rounds once to the compute dtype. This is the reference:
the Triton kernel dequantizes each tile the same way (fp32 product, one rounding to ``x``'s dtype)
before its ``tl.dot``, so the weight it multiplies equals :func:`dequantize`'s bit for bit and the
two paths differ only in the GEMM's accumulation order. That order is the kernel's launch
configuration's (:class:`GemmConfig`, chosen by :func:`gemm_config` from the row count): with
split-K (decode's few rows, to give every SM programs) each split accumulates its run of whole
groups in fp32, and the partials are added in fp32 in a fixed order and rounded once to ``x``'s
dtype, so a configuration gives the same result on every run, and two configurations results that
differ by fp32 rounding (before the one rounding to the output's dtype).

:func:`pack` / :func:`quantize` are the writer's side (tests, benchmarks, a converter): AutoAWQ's
packing loop, vectorised.

QLoRA training's backward (training.int4_base) needs the input gradient ``dy @ W^T`` and nothing
else: :func:`dequantize_triton` (the reference's weight, in one launch, for cuBLAS to multiply) and
:func:`matmul_t_triton` (the forward's tiles multiplied transposed; its torch reference
:func:`matmul_t_torch`). They add to the serving side's functions and change none of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.jit import jit

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
# The kernel's K tile must lie within one group (one scale row per tile) and tl.dot needs >= 16.
MIN_GROUP = 16


def pack(values: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` integers in 0..15 -> ``[rows, cols / 8]`` int32 words in AWQ's nibble order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"AWQ packs columns eight to a word: {cols} columns is not a multiple of 8")
    if values.min() < 0 or values.max() > 15:
        raise ValueError("AWQ packs 4-bit values: every value must be in 0..15")
    v = values.to(torch.int64).view(rows, cols // PACK, PACK)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(dim=-1)  # disjoint bits: the sum is the OR
    # As int32 two's complement (nibble 7 at 8..15 sets the sign bit).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """``[rows, cols / 8]`` int32 words -> ``[rows, cols]`` int32 values in 0..15 (inverse of :func:`pack`)."""
    rows, packed = words.shape
    shifts = torch.tensor([4 * AWQ_REVERSE_ORDER[j] for j in range(PACK)], dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, packed * PACK)


def check_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """Raise ValueError unless the three tensors are one AWQ layer's (dtypes and shapes agree)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"AWQ qweight and qzeros are int32, got {qweight.dtype} and {qzeros.dtype}")
    if scales.dtype != torch.float16:
        raise ValueError(f"AWQ scales are float16, got {scales.dtype}")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    groups = in_features // group_size
    if tuple(scales.shape) != (groups, out_features) or tuple(qzeros.shape) != (groups, out_features // PACK):
        raise ValueError(
            f"AWQ layer of qweight {tuple(qweight.shape)}, group {group_size}: scales must be {(groups, out_features)} "
            f"and qzeros {(groups, out_features // PACK)}, got {tuple(scales.shape)} and {tuple(qzeros.shape)}"
        )


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The reference dequantization: ``W [in, out]`` in ``dtype`` (fp32 product, one rounding)."""
    q = unpack(qweight)
    z = unpack(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).to(dtype)


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight, qzeros, scales)`` of a torch ``weight [out, in]``: asymmetric min/max per group
    of ``group_size`` input rows (AWQ's zero-point quantization, without its activation-aware
    search, which only picks different scales)."""
    w = weight.detach().float().t()  # [in, out]
    in_features, out_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    g = w.view(in_features // group_size, group_size, out_features)
    lo = g.amin(dim=1).clamp(max=0)
    hi = g.amax(dim=1).clamp(min=0)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(g / s.unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, 15).view(in_features, out_features)
    return pack(q.to(torch.int32)), pack(zeros.to(torch.int32)), scales


def matmul_torch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int) -> torch.Tensor:  # fmt: skip
    """``x [M, in] @ dequantize(...)`` in ``x``'s dtype (the reference path; any device)."""
    return x @ dequantize(qweight, qzeros, scales, group_size, x.dtype)


# The forward's launch configuration. A K tile must lie within one group (one row of scales and zeros per
# tile) and tl.dot needs >= 16 rows: BLOCK_K is a power of two dividing the group, at most 128.
MAX_BLOCK_K = 128
# Split-K aims at this many programs per SM: a decode GEMM reads the whole weight once and little else, so
# what bounds it is how many loads are in flight, which needs programs on every SM, several deep.
PROGRAMS_PER_SM = 4
CPU_SM_COUNT = 4  # the SM count assumed off CUDA (the interpreter): any value is correct, small is fast


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmConfig:
    """One launch of :func:`matmul_triton`: the program's tile (``block_m`` rows of x by ``block_n``
    output columns, walking K ``block_k`` rows at a time), ``split_k`` (how many programs share one
    tile's K, each reducing a contiguous run of whole groups into an fp32 partial; the launch may
    use fewer, so that every split holds as many groups as the first), Triton's ``num_warps`` and
    ``num_stages``, and ``interleave``: load each packed word once and widen it in registers
    (``tl.interleave``) instead of loading it once per column (a gather the cache absorbs)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    interleave: bool = False

    def __str__(self) -> str:
        unpack = " interleave" if self.interleave else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} split {self.split_k} w{self.num_warps} "
                f"s{self.num_stages}{unpack}")  # fmt: skip


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (:data:`CPU_SM_COUNT` off CUDA)."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def block_k_for(group_size: int, block_k: int = MAX_BLOCK_K) -> int:
    """``block_k`` lowered to the largest power of two dividing the group (>= 16: groups are multiples of 16)."""
    return min(block_k, group_size & -group_size, MAX_BLOCK_K)


def split_plan(K: int, group_size: int, split_k: int) -> tuple[int, int]:
    """``(k_per_split, splits)`` for a requested ``split_k``: contiguous runs of whole groups, all of
    one length but the last (shorter where the groups do not divide evenly), none empty."""
    groups = K // group_size
    per_split = _cdiv(groups, min(max(split_k, 1), max(groups, 1)))
    return per_split * group_size, _cdiv(groups, per_split) if groups else 1


def auto_split_k(M: int, N: int, K: int, group_size: int, block_m: int, block_n: int, sms: int) -> int:
    """The split that brings the launch to :data:`PROGRAMS_PER_SM` programs per SM, bounded so
    the fp32 partials (written, then read back by the sum) never move more bytes than the packed
    weight (``2 * splits * M * N * 4 <= K * N / 2``), and by the number of groups."""
    tiles = _cdiv(M, block_m) * _cdiv(N, block_n)
    wanted = _cdiv(PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(wanted, K // (16 * M), K // group_size))


def gemm_config(M: int, N: int, K: int, group_size: int, device: torch.device) -> GemmConfig:
    """The launch :func:`matmul_triton` takes for ``x [M, K] @ W [K, N]``. Chosen on paper, NOT yet
    timed on a GPU (``python3 bench/int4_gemm.py --configs`` times the candidates to choose from);
    checked only by compiling every row for sm_90 with Triton's own ptxas (no GPU), where none of
    them spills registers at group 128.

    - decode, M <= 16: the smallest tile tl.dot takes in M, 64 output columns, the whole group
      (128) in K per step, split-K to fill the SMs: a memory-bound read of the packed weight;
    - M <= 64: the same tile 32 rows high, then 64 x 64 x 64 with 4 stages (64 x 64 x 128 spills);
    - up to 256 rows: 64 x 128 tiles, K 64 a step, 4 warps, 4 stages (more programs than 128-row
      tiles would give: 192 for the 8B shape's q/k/v at 256 rows);
    - larger M (prefill): 128 x 128 tiles, K 64 a step, 8 warps, 3 stages: the Triton matmul
      tutorial's Hopper-sized tiles, which amortise each dequantized weight tile over 128 rows.

    Split-K applies wherever the tiles alone leave SMs idle (in practice decode and small batches).
    Every row unpacks interleaved: gathering each word once per column makes Triton's pipeline
    stage the eight-times-wider int32 tile in shared memory (decode's tile: 84 KB and 255 registers
    a program gathered, 28 KB and 128 interleaved, so two programs an SM against four).
    """
    if M <= 32:
        block_m = 16 if M <= 16 else 32
        block_n, block_k, warps, stages = 64, block_k_for(group_size, 128), 4, 3
    elif M <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, block_k_for(group_size, 64), 4, 4
    elif M <= 256:
        block_m, block_n, block_k, warps, stages = 64, 128, block_k_for(group_size, 64), 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, block_k_for(group_size, 64), 8, 3
    split = auto_split_k(M, N, K, group_size, block_m, block_n, sm_count(device))
    return GemmConfig(block_m, block_n, block_k, split, warps, stages, interleave=True)


def check_config(config: GemmConfig, group_size: int) -> None:
    """Raise ValueError unless ``config`` can run at ``group_size``: tiles powers of two of at least
    16 (tl.dot's least), ``block_k`` dividing the group (a K tile lies in one group) and at most
    :data:`MAX_BLOCK_K`, ``split_k`` and the launch's counts positive."""
    def power_of_two(value: int) -> bool:
        return value >= 16 and value & (value - 1) == 0

    if not (power_of_two(config.block_m) and power_of_two(config.block_n) and power_of_two(config.block_k)):
        raise ValueError(f"{config}: block_m, block_n and block_k must be powers of two of at least 16")
    fits = block_k_for(group_size, config.block_k)
    if config.block_k != fits:
        raise ValueError(f"{config}: block_k must divide the group size {group_size} and be at most {MAX_BLOCK_K} "
                         f"(a K tile lies in one group): {fits} would do")  # fmt: skip
    if config.split_k < 1 or config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"{config}: split_k, num_warps and num_stages must be positive")


@jit
def _awq_gemm_kernel(x_ptr: tl.tensor, qw_ptr: tl.tensor, qz_ptr: tl.tensor, s_ptr: tl.tensor, y_ptr: tl.tensor,
                     M: tl.tensor, N: tl.tensor, K: tl.tensor, K_SPLIT: tl.tensor, stride_xm: tl.tensor,
                     stride_qw: tl.tensor, stride_qz: tl.tensor, stride_s: tl.tensor, stride_ys: tl.tensor,
                     stride_ym: tl.tensor, GROUP: tl.constexpr, IEEE: tl.constexpr, INTERLEAVE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr) -> None:  # fmt: skip
    # Program (m, n, s) owns the [BLOCK_M, BLOCK_N] tile (m, n) over K's rows [s K_SPLIT, (s + 1) K_SPLIT):
    # whole groups, so every K tile lies in one group. It writes y's tile (one split) or its fp32 partial
    # at y_ptr + s stride_ys (several; _sum_splits_kernel adds them).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    word = offs_n // 8
    # The tile's packed words, each once (N is a multiple of 8, and so is the tile's first column).
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    mask_w = offs_w < N // 8
    j = offs_n % 8
    # Column j of its eight sits in nibble AWQ_REVERSE_ORDER[j] = j // 2 + 4 (j % 2).
    shift = ((j // 2) + (j % 2) * 4) * 4
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None], other=0.0)
        if INTERLEAVE:
            # Each word loaded once, then repeated eight times in a row: column c of the tile holds word c // 8.
            q = tl.load(qw_ptr + kk[:, None] * stride_qw + offs_w[None, :], mask=mask_w[None, :], other=0)
            q = tl.interleave(q, q)
            q = tl.interleave(q, q)
            q = tl.interleave(q, q)
        else:
            # Each word read by its eight columns: the repeats hit the cache, and the tile needs no shuffle.
            q = tl.load(qw_ptr + kk[:, None] * stride_qw + word[None, :], mask=mask_n[None, :], other=0)
        q = (q >> shift[None, :]) & 0xF
        group = k0 // GROUP  # BLOCK_K divides GROUP and K_SPLIT is whole groups: the tile lies in one group
        z = (tl.load(qz_ptr + group * stride_qz + word, mask=mask_n, other=0) >> shift) & 0xF
        s = tl.load(s_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # The reference's rounding: an exact fp32 product, rounded once to x's dtype.
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    y = acc.to(y_ptr.dtype.element_ty)  # fp32 partials stay fp32
    y_ptrs = y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y, mask=mask_m[:, None] & mask_n[None, :])


@jit
def _sum_splits_kernel(p_ptr: tl.tensor, y_ptr: tl.tensor, MN: tl.tensor, SPLITS: tl.tensor,
                       BLOCK: tl.constexpr) -> None:  # fmt: skip
    # y = p[0] + p[1] + ... + p[SPLITS - 1] in fp32, in that order (the same sum on every run), rounded once.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for split in range(1, SPLITS):
        acc += tl.load(p_ptr + split * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_SUM_BLOCK = 1024


def matmul_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, config: GemmConfig | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`matmul_torch` in Triton: each program dequantizes its ``[BLOCK_K, BLOCK_N]`` weight tiles
    in registers and multiplies them with fp32 accumulation (the INT4 weight is read, never a
    dequantized copy). ``config`` (default :func:`gemm_config`'s) sets the tiles and the split-K:
    with several splits, each program reduces a contiguous run of whole groups into an fp32 partial
    ``[splits, M, N]`` and a second launch adds the partials in a fixed order and rounds once."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("matmul_triton needs a 2-D x, contiguous in its last dim")
    if group_size % MIN_GROUP:
        raise ValueError(f"the INT4 kernel needs a group size that is a multiple of {MIN_GROUP}, got {group_size}")
    M, K = x.shape
    N = qweight.shape[1] * PACK
    if qweight.shape[0] != K:
        raise ValueError(f"x has {K} columns, the INT4 weight {qweight.shape[0]} rows")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    if config is None:
        config = gemm_config(M, N, K, group_size, x.device)
    check_config(config, group_size)
    k_split, splits = split_plan(K, group_size, config.split_k)
    if splits * M * N >= 2**31:
        raise ValueError(f"split_k {config.split_k} at {M} x {N}: the partials would pass int32 offsets")
    out = y if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    grid = (_cdiv(M, config.block_m), _cdiv(N, config.block_n), splits)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out, M, N, K, k_split, x.stride(0), qweight.stride(0), qzeros.stride(0),
        scales.stride(0), M * N, N, GROUP=group_size, IEEE=x.dtype == torch.float32, INTERLEAVE=config.interleave,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(_cdiv(M * N, _SUM_BLOCK),)](out, y, M * N, splits, BLOCK=_SUM_BLOCK, num_warps=4)
    return y


# From this many rows on, :func:`matmul` dequantizes the whole weight once (one bandwidth-bound launch
# writing it in x's dtype) and lets cuBLAS multiply: the fused kernel's tl.dot tiles reach a fraction
# of cuBLAS's tensor-core rate once the rows make the GEMM more than a read of the weight. Measured on
# the H100 at the 8B projections (bench/int4_gemm.py, docs/benchmarks.md): at 64 rows the fused kernel
# is 1.2-1.3 x bf16 and the other path 1.5-2.1 x; at 128 rows the fused one is 2.2-2.5 x and the other
# 1.6-2.1 x; at 2,048 rows 5.2-5.5 x against 1.1-1.2 x. (vLLM's AWQ path switches at 256.)
DEQUANT_MIN_ROWS = 128


def matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           group_size: int) -> torch.Tensor:  # fmt: skip
    """``x [M, in] @ dequant(W)`` on CUDA by the faster path for ``M``: the fused dequant-GEMM
    (:func:`matmul_triton`, reading only the packed weight) below :data:`DEQUANT_MIN_ROWS` rows, the
    weight dequantized by :func:`dequantize_triton` (bit for bit the reference's) and multiplied by
    cuBLAS from there on. The dequantized copy lives for this call only."""
    if x.shape[0] >= DEQUANT_MIN_ROWS:
        return x @ dequantize_triton(qweight, qzeros, scales, group_size, x.dtype)
    return matmul_triton(x.contiguous(), qweight, qzeros, scales, group_size)


# The input gradient of ``y = x @ W`` through a frozen INT4 weight (QLoRA training, training.int4_base):
# ``dx = dy @ W^T``. No weight gradient is ever taken (the base is frozen), so this is all a backward needs.


def matmul_t_torch(dy: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:  # fmt: skip
    """``dy [M, out] @ dequantize(...)^T`` in ``dy``'s dtype (the reference path; any device)."""
    return dy @ dequantize(qweight, qzeros, scales, group_size, dy.dtype).t()


@jit
def _awq_gemm_t_kernel(dy_ptr: tl.tensor, qw_ptr: tl.tensor, qz_ptr: tl.tensor, s_ptr: tl.tensor, dx_ptr: tl.tensor,
                       M: tl.tensor, N: tl.tensor, stride_dym: tl.tensor, stride_qw: tl.tensor, stride_qz: tl.tensor,
                       stride_s: tl.tensor, stride_dxm: tl.tensor, GROUP: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr) -> None:  # fmt: skip
    # Each program owns a [BLOCK_M, BLOCK_K] tile of dx and walks the output columns N: the weight
    # tile it dequantizes is the forward kernel's [BLOCK_K, BLOCK_N] tile, multiplied transposed.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    group = (pid_k * BLOCK_K) // GROUP  # BLOCK_K divides GROUP: the program's rows lie in one group
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        word = offs_n // 8
        j = offs_n % 8
        shift = ((j // 2) + (j % 2) * 4) * 4  # column j's nibble, AWQ_REVERSE_ORDER[j]
        dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :],
                     other=0.0)  # fmt: skip
        q = tl.load(qw_ptr + kk[:, None] * stride_qw + word[None, :], mask=mask_n[None, :], other=0)
        q = (q >> shift[None, :]) & 0xF
        z = (tl.load(qz_ptr + group * stride_qz + word, mask=mask_n, other=0) >> shift) & 0xF
        s = tl.load(s_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # The same rounding as the forward's and the reference's: exact fp32 product, rounded once.
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(dy.dtype)
        if IEEE:
            acc = tl.dot(dy, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(dy, tl.trans(w), acc)
    dx = acc.to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + kk[None, :], dx, mask=mask_m[:, None])


def matmul_t_triton(dy: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:  # fmt: skip
    """:func:`matmul_t_torch` in one Triton launch, the weight dequantized tile by tile in registers
    as :func:`matmul_triton` does (no dequantized copy of the weight is made)."""
    if dy.dim() != 2 or dy.stride(1) != 1:
        raise ValueError("matmul_t_triton needs a 2-D dy, contiguous in its last dim")
    if group_size % MIN_GROUP:
        raise ValueError(f"the INT4 kernel needs a group size that is a multiple of {MIN_GROUP}, got {group_size}")
    M, N = dy.shape
    K = qweight.shape[0]
    if qweight.shape[1] * PACK != N:
        raise ValueError(f"dy has {N} columns, the INT4 weight {qweight.shape[1] * PACK} output columns")
    dx = torch.empty((M, K), dtype=dy.dtype, device=dy.device)
    if M == 0:
        return dx
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64
    block_k = min(64, group_size & -group_size)  # a power of two dividing the group, so K's tiles are whole
    grid = (triton.cdiv(M, block_m), K // block_k)
    _awq_gemm_t_kernel[grid](
        dy, qweight, qzeros, scales, dx, M, N, dy.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
        dx.stride(0), GROUP=group_size, IEEE=dy.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return dx


@jit
def _awq_dequantize_kernel(qw_ptr: tl.tensor, qz_ptr: tl.tensor, s_ptr: tl.tensor, w_ptr: tl.tensor, N: tl.tensor,
                           stride_qw: tl.tensor, stride_qz: tl.tensor, stride_s: tl.tensor, stride_w: tl.tensor,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr) -> None:  # fmt: skip
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    word = offs_n // 8
    j = offs_n % 8
    shift = ((j // 2) + (j % 2) * 4) * 4  # column j's nibble, AWQ_REVERSE_ORDER[j]
    group = (pid_k * BLOCK_K) // GROUP  # BLOCK_K divides GROUP: the tile's rows lie in one group
    # Each packed word loaded once and repeated eight times in a row (column c of the tile holds word
    # c // 8), as the GEMM's interleaved unpacking does: a pure copy, so the load is all it costs.
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    q = tl.load(qw_ptr + kk[:, None] * stride_qw + offs_w[None, :], mask=(offs_w < N // 8)[None, :], other=0)
    q = tl.interleave(q, q)
    q = tl.interleave(q, q)
    q = tl.interleave(q, q)
    q = (q >> shift[None, :]) & 0xF
    z = (tl.load(qz_ptr + group * stride_qz + word, mask=mask_n, other=0) >> shift) & 0xF
    s = tl.load(s_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    # The reference's rounding: an exact fp32 product, rounded once to the output's dtype.
    w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + kk[:, None] * stride_w + offs_n[None, :], w, mask=mask_n[None, :])


def dequantize_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """:func:`dequantize` in one Triton launch: ``W [in, out]`` in ``dtype``, equal to the reference bit
    for bit (the same fp32 product, one rounding). For a product cuBLAS then takes whole, e.g. QLoRA's
    input gradient at training's row counts; the caller lets it go after that product."""
    if group_size % MIN_GROUP:
        raise ValueError(f"the INT4 kernel needs a group size that is a multiple of {MIN_GROUP}, got {group_size}")
    K, N = qweight.shape[0], qweight.shape[1] * PACK
    w = torch.empty((K, N), dtype=dtype, device=qweight.device)
    block_n = 128
    block_k = min(32, group_size & -group_size)  # a power of two dividing the group, so K's tiles are whole
    grid = (K // block_k, triton.cdiv(N, block_n))
    _awq_dequantize_kernel[grid](
        qweight, qzeros, scales, w, N, qweight.stride(0), qzeros.stride(0), scales.stride(0), w.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return w
