"""The fused small ops against the torch chains they replace (the engine's CPU path): interpreted
on CPU, compiled on CUDA (gpu mark). Inputs are random; outputs are poisoned first.

The FP8 variants (RMSNorm and SiLU·mul that also write their output quantized) against the unfused
chain, bit for bit: the same op's output, then ``quantize_rows`` of it. That holds in the
interpreter in every dtype too (both sides run the same kernel arithmetic), so bf16 is checked on
CPU here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8 import FP8_MAX, QuantizedRows, quantize_rows
from kernels.fused_ops import rms_norm, rms_norm_fp8, rotary_, silu_mul, silu_mul_fp8

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


def _device(device: str, dtype: torch.dtype) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return
    import kernels.paged_attention as paged

    if not paged.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    if dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates to bf16 where the GPU rounds: bf16 is checked on CUDA")


def _close(actual: torch.Tensor, expected: torch.Tensor, *, bit_equal: bool = True) -> None:
    """Equal up to one rounding of the dtype (fp32 reductions may sum in another order; a bf16 sum
    that nearly cancels can land one ulp of its O(1) operands apart), bf16 results bit-equal nearly
    everywhere."""
    assert not actual.isnan().any()
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=1.6e-2)
        if bit_equal:
            assert (actual == expected).float().mean() > 0.97, "nearly every element must be bit-equal"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm(device: str, dtype: torch.dtype, with_residual: bool, unit_offset: bool) -> None:
    _device(device, dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=generator).to(device=device, dtype=dtype)
    residual = torch.randn(7, 96, generator=generator).to(device=device, dtype=dtype)
    weight = torch.randn(96, generator=generator).to(device=device, dtype=dtype)
    out, summed = rms_norm(x, weight, 1e-5, residual if with_residual else None, unit_offset=unit_offset)
    stream = x + residual if with_residual else x
    h = stream.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    # Gemma multiplies by (1 + weight) in fp32 and rounds once; Llama rounds the normalised row first.
    expected = (normed * (1.0 + weight.float())).to(dtype) if unit_offset else weight * normed.to(dtype)
    _close(out, expected)
    if with_residual:
        assert torch.equal(summed, stream)
    else:
        assert summed is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place(device: str, dtype: torch.dtype) -> None:
    _device(device, dtype)
    generator = torch.Generator().manual_seed(2)
    packed = torch.randn(5, 3 * 4 * 32, generator=generator).to(device=device, dtype=dtype)
    q = packed[:, : 2 * 4 * 32].view(5, 8, 32)  # a strided view, as the engine's q of a fused qkv is
    cos = torch.randn(5, 1, 32, generator=generator).to(device=device, dtype=dtype)
    sin = torch.randn(5, 1, 32, generator=generator).to(device=device, dtype=dtype)
    rotated_half = torch.cat((-q[..., 16:], q[..., :16]), dim=-1)
    expected = q * cos + rotated_half * sin
    untouched = packed[:, 2 * 4 * 32 :].clone()
    rotary_(q, cos, sin)
    # On the H200 about a quarter of the bf16 elements land one ulp from torch's chain (cause not
    # established); the fp32 case holds the arithmetic to fp32 rounding.
    _close(q, expected, bit_equal=False)
    assert torch.equal(packed[:, 2 * 4 * 32 :], untouched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device: str, dtype: torch.dtype) -> None:
    _device(device, dtype)
    gate_up = (torch.randn(6, 2 * 1500, generator=torch.Generator().manual_seed(3)) * 3).to(device=device, dtype=dtype)
    gate, up = gate_up.split(1500, dim=-1)
    _close(silu_mul(gate_up), F.silu(gate) * up)


def _fp8_device(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return
    import kernels.fp8 as fp8

    if not fp8.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")


def _assert_quantized_rows(rows: QuantizedRows, out: torch.Tensor) -> None:
    """``rows`` is ``quantize_rows(out)`` bit for bit (a -0 and a +0 told apart), scales included."""
    expected = quantize_rows(out)
    assert rows.q.dtype == torch.float8_e4m3fn and rows.q.shape == out.shape and rows.q.is_contiguous()
    assert rows.scale.dtype == torch.float32 and rows.scale.shape == (out.shape[0], 1)
    assert torch.equal(rows.scale, expected.scale)
    assert torch.equal(rows.q.view(torch.uint8), expected.q.view(torch.uint8))


FP8_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, width): one row of 16 (the smallest FP8 width), a width short of a power of two, one past
# 4096 (the kernel's 8 warps and a 8192-wide block).
NORM_SHAPES = [(1, 16), (6, 96), (3, 4100)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_fp8_is_the_norm_then_quantize_rows(device: str, dtype: torch.dtype, shape: tuple[int, int],
                                                     with_residual: bool, unit_offset: bool) -> None:  # fmt: skip
    _fp8_device(device)
    rows, n = shape
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, n, generator=generator)
    residual = torch.randn(rows, n, generator=generator)
    # Weights over six decades, of both signs: each row reaches e4m3's subnormals, values that round
    # to zero (negative ones to -0), and -0 itself where a negative weight meets a zero.
    weight = torch.randn(n, generator=generator) * torch.logspace(-5, 1, n)
    x[:, 1] = 0.0
    weight[1] = -1.0
    if rows > 1:
        x[rows - 1] = -residual[rows - 1] if with_residual else 0.0  # a row that norms to zeros
    x, residual, weight = (t.to(device=device, dtype=dtype) for t in (x, residual, weight))
    res = residual if with_residual else None
    out, summed, quantized = rms_norm_fp8(x, weight, 1e-5, res, unit_offset=unit_offset)
    expected, expected_sum = rms_norm(x, weight, 1e-5, res, unit_offset=unit_offset)
    assert torch.equal(out, expected), "the normed rows are the unfused kernel's"
    if with_residual:
        assert summed is not None and expected_sum is not None and torch.equal(summed, expected_sum)
    else:
        assert summed is None
    _assert_quantized_rows(quantized, out)
    back = quantized.q.float()
    assert (back.abs().amax(dim=1)[: max(rows - 1, 1)] == FP8_MAX).all(), "each nonzero row spans e4m3's range"
    if rows > 1:
        assert (back[rows - 1] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 1500), (2, 9000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_silu_mul_fp8_is_silu_mul_then_quantize_rows(device: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    _fp8_device(device)
    rows, n = shape
    generator = torch.Generator().manual_seed(6)
    # Gates over six decades (SiLU of a tiny negative gate is a tiny negative: e4m3 -0 territory).
    gate_up = torch.randn(rows, 2 * n, generator=generator) * torch.logspace(-5, 1, 2 * n)
    if rows > 1:
        gate_up[rows - 1, n:] = 0.0  # up all zeros: a row of zeros
    # A strided view, as a slice of a wider buffer: the kernel reads rows by their stride.
    padded = torch.zeros(rows, 2 * n + 16)
    padded[:, : 2 * n] = gate_up
    gate_up = padded.to(device=device, dtype=dtype)[:, : 2 * n]
    out, quantized = silu_mul_fp8(gate_up)
    assert torch.equal(out, silu_mul(gate_up)), "the product is the unfused kernel's"
    _assert_quantized_rows(quantized, out)
    if rows > 1:
        assert (quantized.q[rows - 1].float() == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_variants_of_no_rows(device: str) -> None:
    _fp8_device(device)
    x = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    out, summed, rows = rms_norm_fp8(x, torch.ones(32, device=device, dtype=torch.bfloat16), 1e-5)
    assert out.shape == (0, 32) and summed is None and rows.q.shape == (0, 32) and rows.scale.shape == (0, 1)
    act, act_rows = silu_mul_fp8(torch.empty(0, 64, device=device, dtype=torch.bfloat16))
    assert act.shape == (0, 32) and act_rows.q.shape == (0, 32)
