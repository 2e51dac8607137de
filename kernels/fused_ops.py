"""Fused small ops of the decoder layer in Triton: RMSNorm with the residual add, rotary embedding
in place, SiLU·mul. Each replaces a chain of 3 to 8 elementwise launches (in a decode step these
small launches cost more GPU time than their bytes: ≈ 2–3 µs each, about a thousand a step).

Each kernel rounds where the torch chain it replaces rounds (to the input dtype after each op
that torch runs in that dtype, fp32 inside RMSNorm). Measured on the H200 in bf16: RMSNorm and
SiLU·mul are bit-equal to the torch chain in over 97 % of elements; rotary in about 76 %, the
rest one ulp apart (cause not established). In fp32 all three match to fp32 rounding.

RMSNorm and SiLU·mul also come with their output quantized to FP8 (:func:`rms_norm_fp8`,
:func:`silu_mul_fp8`) for the FP8 projection they feed (serving.engine.layers.fp8_linear): the same
kernel, flag on, writes the rows in the input dtype (still the LoRA path's input) and quantizes each
row it holds with ``kernels.fp8.quantize_row`` from those rounded values, so the FP8 rows are
bit-equal to ``quantize_rows`` of the output, and the projection's own quantizing launch (with its
read of the activations: three of a layer's four, o_proj's input being attention's) is gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX, INTERPRETED, MIN_AMAX, QuantizedRows, quantize_row, row_warps
from kernels.jit import jit


@jit
def _rms_norm_kernel(x_ptr: tl.tensor, res_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor,
                     res_out_ptr: tl.tensor, q_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor, eps: tl.tensor,
                     stride_x: tl.tensor, stride_r: tl.tensor, stride_o: tl.tensor, stride_ro: tl.tensor,
                     stride_q: tl.tensor, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                     QUANTIZE: tl.constexpr, MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        # Gemma: (1 + weight) times the normalised row in fp32, one rounding at the end.
        y = ((1.0 + w) * (h * inv)).to(dtype)
    else:
        y = (w * (h * inv).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if QUANTIZE:
        # From the rounded row just stored (lanes past n are 0: x and w load as 0 there).
        q, scale = quantize_row(y.to(tl.float32), MIN_AMAX_, FP8_MAX_, ROUND_FIRST)
        tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
        tl.store(scale_ptr + row, scale)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight * rmsnorm(x [+ residual])`` over the last dim of ``x [T, N]`` (``(1 + weight) * ...``
    in fp32 with ``unit_offset``, as Gemma computes it); with ``residual`` also returns the sum
    ``x + residual`` (the next residual), rounded to the input dtype."""
    out, res_out, _ = _rms_norm(x, weight, eps, residual, unit_offset=unit_offset, quantize=False)
    return out, res_out


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedRows]:
    """:func:`rms_norm` and its output quantized per row in the same launch, bit-equal to
    ``kernels.fp8.quantize_rows`` of that output: ``(out, x + residual or None, (q, scale))``."""
    out, res_out, rows = _rms_norm(x, weight, eps, residual, unit_offset=unit_offset, quantize=True)
    assert rows is not None
    return out, res_out, rows


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, *, unit_offset: bool,
    quantize: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedRows | None]:
    num_rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    rows = _fp8_rows(num_rows, n, x.device) if quantize else None
    if num_rows == 0:
        return out, res_out, rows
    res = residual if residual is not None else x
    res_o = res_out if res_out is not None else out
    # Without quantize, out stands in for the pointers the kernel never touches then.
    q, scale = rows if rows is not None else (out, out)
    _rms_norm_kernel[(num_rows,)](
        x, res, weight, out, res_o, q, scale, n, eps, x.stride(0), res.stride(0), out.stride(0), res_o.stride(0),
        q.stride(0), HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, QUANTIZE=quantize,
        MIN_AMAX_=MIN_AMAX, FP8_MAX_=FP8_MAX, ROUND_FIRST=INTERPRETED, BLOCK=triton.next_power_of_2(n),
        # The same warps with or without quantize: the row's sum of squares reduces in the same order.
        num_warps=8 if n >= 4096 else 4,
    )  # fmt: skip
    return out, res_out, rows


def _fp8_rows(num_rows: int, n: int, device: torch.device) -> QuantizedRows:
    return QuantizedRows(
        torch.empty((num_rows, n), dtype=FP8_DTYPE, device=device),
        torch.empty((num_rows, 1), dtype=torch.float32, device=device),
    )


@jit
def _rotary_kernel(x_ptr: tl.tensor, cos_ptr: tl.tensor, sin_ptr: tl.tensor, stride_xt: tl.tensor,
                   stride_xh: tl.tensor, stride_c: tl.tensor, HALF: tl.constexpr,
                   BLOCK: tl.constexpr) -> None:  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < 2 * HALF
    base = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(base + offs, mask=mask, other=0.0)
    dtype = x.dtype
    # rotate_half: [-x[HALF:], x[:HALF]]
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    rot = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(offs < HALF, -rot, rot).to(dtype)
    c = tl.load(cos_ptr + token * stride_c + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * stride_c + offs, mask=mask, other=0.0)
    a = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
    b = (rot.to(tl.float32) * s.to(tl.float32)).to(dtype)
    tl.store(base + offs, (a.to(tl.float32) + b.to(tl.float32)).to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x [T, H, D]`` in place by ``cos``/``sin [T, 1, D]`` (``x*cos + rotate_half(x)*sin``)."""
    num_tokens, heads, dim = x.shape
    if num_tokens == 0:
        return
    if x.stride(2) != 1 or cos.stride(2) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary_ needs x, cos and sin contiguous in the last dim, cos and sin alike")
    _rotary_kernel[(num_tokens, heads)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=dim // 2, BLOCK=triton.next_power_of_2(dim),
        num_warps=1,
    )  # fmt: skip


@jit
def _silu_mul_kernel(x_ptr: tl.tensor, out_ptr: tl.tensor, q_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor,
                     stride_x: tl.tensor, stride_o: tl.tensor, stride_q: tl.tensor, QUANTIZE: tl.constexpr,
                     MIN_AMAX_: tl.constexpr, FP8_MAX_: tl.constexpr, ROUND_FIRST: tl.constexpr,
                     BLOCK: tl.constexpr) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if QUANTIZE:
        # One program holds the whole row here (BLOCK >= n); lanes past n are silu(0) * 0 = 0.
        q, scale = quantize_row(y.to(tl.float32), MIN_AMAX_, FP8_MAX_, ROUND_FIRST)
        tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
        tl.store(scale_ptr + row, scale)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[T, 2N]`` gate/up projection → ``[T, N]``."""
    return _silu_mul(gate_up, quantize=False)[0]


def silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, QuantizedRows]:
    """:func:`silu_mul` and its output quantized per row in the same launch, bit-equal to
    ``kernels.fp8.quantize_rows`` of that output: ``(out, (q, scale))``."""
    out, rows = _silu_mul(gate_up, quantize=True)
    assert rows is not None
    return out, rows


def _silu_mul(gate_up: torch.Tensor, *, quantize: bool) -> tuple[torch.Tensor, QuantizedRows | None]:
    num_rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    rows = _fp8_rows(num_rows, n, gate_up.device) if quantize else None
    if num_rows == 0:
        return out, rows
    # Quantizing needs the row's amax: one program a row, holding it whole (as kernels.fp8's kernel);
    # else blocks of 1024 columns. The values are elementwise, alike under either split.
    block = triton.next_power_of_2(n) if quantize else 1024
    warps = row_warps(block) if quantize else 4
    q, scale = rows if rows is not None else (out, out)
    _silu_mul_kernel[(num_rows, triton.cdiv(n, block))](
        gate_up, out, q, scale, n, gate_up.stride(0), out.stride(0), q.stride(0), QUANTIZE=quantize,
        MIN_AMAX_=MIN_AMAX, FP8_MAX_=FP8_MAX, ROUND_FIRST=INTERPRETED, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out, rows
