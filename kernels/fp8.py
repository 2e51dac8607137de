"""Per-row FP8 (e4m3) quantization: each row of ``x [M, K]`` scaled by its own ``amax / 448`` and
cast to ``float8_e4m3fn``, so that ``q.float() * scale`` gives the row back within e4m3's rounding
(3 mantissa bits: a relative error of at most 2^-4 for normal values, ``scale * 2^-10`` below them).

The serving engine quantizes its base weights once this way (a row is an output channel) and each
projection's input activations at every call (a row is a token), for ``torch._scaled_mm``'s rowwise
scaling. :func:`quantize_rows` is the torch chain (any device; the CPU path and the reference);
:func:`quantize_rows_triton` does the same in one launch (amax, scale, divide, clamp, cast), since a
decode step runs it once per projection: 128 calls in a 32-layer model, where the four launches of
the torch chain would cost more than their bytes.

Both compute in fp32 and round alike (IEEE division, round to nearest even), so their outputs are
bit-equal. A row of zeros gets the scale ``MIN_AMAX / 448`` and quantizes to zeros.

:func:`quantize_row` is the kernel's rounding as a device function: the fused producers of
``kernels.fused_ops`` (RMSNorm, SiLU·mul) quantize the row they have just written with it, so a
projection after them gets its FP8 input without a launch of its own, bit-equal to
:func:`quantize_rows` of their output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.jit import jit

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The smallest amax a row is scaled by: an all-zero row would otherwise divide by zero.
MIN_AMAX = 1e-12


class QuantizedRows(NamedTuple):
    """Rows quantized per row: ``q [M, K] float8_e4m3fn`` and ``scale [M, 1] float32``, ``q.float() * scale ≈ x``."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """``(q [M, K] float8_e4m3fn, scale [M, 1] float32)`` with ``q.float() * scale ≈ x``, row by row."""
    h = x.float()
    amax = h.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX)
    # Divided by a tensor, not the Python float: on CUDA torch turns division by a CPU scalar into a
    # multiplication by its reciprocal, which rounds differently from the kernel's IEEE division.
    scale = amax / torch.full_like(amax, FP8_MAX)
    return QuantizedRows((h / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


@jit
def quantize_row(x: tl.tensor, MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr,
                 ROUND_FIRST: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:  # fmt: skip
    """``(q, scale)`` of one fp32 row held whole by the program (lanes past its end zero, so they
    leave amax alone): :func:`quantize_rows`' rounding, for this file's kernel and the fused ones."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_)
    # IEEE division, as torch's: Triton's plain `/` on fp32 may be the approximate one.
    scale = tl.div_rn(amax, FP8_MAX_)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_), FP8_MAX_)
    if ROUND_FIRST:
        # Triton 3.9's interpreter drops the carry when a value rounds up into the next binade
        # (124.3 -> 64, not 128), so there each value is first rounded to the e4m3 grid in fp32
        # (nearest even) and the cast is exact. Normal e4m3 values keep 3 of fp32's 23 mantissa bits:
        bits = q.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # below 2^-6 e4m3 is subnormal, spaced 2^-9: adding 1.5 * 2^14 makes fp32 round to that spacing.
        # On the magnitude, the sign put back from the bits: a negative value that rounds to zero is
        # -0 (0x80) in e4m3, as torch's cast gives it, where the sum would give +0.
        magnitude = (tl.abs(q) + 24576.0) - 24576.0
        subnormal = tl.where(bits < 0, -magnitude, magnitude)
        q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    return q.to(tl.float8e4nv), scale


@jit
def _quantize_rows_kernel(x_ptr: tl.tensor, q_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor,
                          stride_x: tl.tensor, stride_q: tl.tensor, MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr,
                          ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_row(x, MIN_AMAX_, FP8_MAX_, ROUND_FIRST)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


# True when TRITON_INTERPRET=1 was set before Triton was imported (the CPU tests).
INTERPRETED = isinstance(_quantize_rows_kernel, InterpretedFunction)


def quantize_rows_triton(x: torch.Tensor) -> QuantizedRows:
    """:func:`quantize_rows` of a 2-D ``x`` (last dim contiguous) in one Triton launch."""
    num_rows, n = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows_triton needs x contiguous in its last dim")
    q = torch.empty((num_rows, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return QuantizedRows(q, scale)
    block = triton.next_power_of_2(n)
    _quantize_rows_kernel[(num_rows,)](
        x, q, scale, n, x.stride(0), q.stride(0), MIN_AMAX_=MIN_AMAX, FP8_MAX_=FP8_MAX, ROUND_FIRST=INTERPRETED,
        BLOCK=block, num_warps=row_warps(block),
    )  # fmt: skip
    return QuantizedRows(q, scale)


def row_warps(block: int) -> int:
    """Warps for a program that holds a whole row of ``block`` values (up to 16384 for an MLP's down
    projection), as the quantizing kernels do."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4
