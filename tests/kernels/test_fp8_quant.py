"""Per-row FP8 quantization (kernels/fp8.py): the Triton kernel is bit-equal to the torch chain
(interpreted on CPU, compiled on CUDA: gpu mark), and a row comes back within e4m3's rounding of
its own scale, whatever the other rows' magnitudes."""

from __future__ import annotations

import pytest
import torch

import kernels.fp8 as fp8
from kernels.fp8 import FP8_MAX, quantize_rows, quantize_rows_triton

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


def _device(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    elif not fp8.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")


def _rows() -> torch.Tensor:
    """Rows whose magnitudes span 1e-6 to 1e3, one of zeros, one reaching e4m3's subnormals
    (values 1e-4 of the row's largest), one of a single nonzero value, and one with values below
    e4m3's smallest subnormal (1e-6 of the row's largest: the negative ones round to -0, 0x80)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 300, generator=generator) * torch.logspace(-6, 3, 40).unsqueeze(1)
    x[7] = 0.0
    x[11, :150] *= 1e-4
    x[13] = 0.0
    x[13, 5] = -2.5
    x[19, :100] *= 1e-6
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_is_bit_equal_to_the_torch_chain(device: str, dtype: torch.dtype) -> None:
    _device(device)
    x = _rows().to(device=device, dtype=dtype)
    q, scale = quantize_rows_triton(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (40, 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (q_ref[19].view(torch.uint8) == 0x80).any(), "the rows reach -0"


@pytest.mark.parametrize("device", DEVICES)
def test_a_strided_row_view_is_read_in_place(device: str) -> None:
    _device(device)
    packed = _rows().to(device)
    view = packed[:, 100:]  # rows 300 apart, as a slice of a packed projection output is
    q, scale = quantize_rows_triton(view)
    q_ref, scale_ref = quantize_rows(view)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        quantize_rows_triton(packed.t())


def test_each_row_round_trips_within_e4m3_rounding_of_its_own_scale() -> None:
    x = _rows()
    q, scale = quantize_rows(x)
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits (half a step: 2^-4 relative) down to 2^-6, then steps of 2^-9.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # Each row's largest value maps to +-448: the row uses e4m3's whole range.
    nonzero = x.abs().amax(dim=1) > 0
    assert (q.float().abs().amax(dim=1)[nonzero] == FP8_MAX).all()
    # A row 1e-6 of another keeps its own precision (a per-tensor scale would flush it to zero).
    assert (back[0] != 0).all() and torch.allclose(back[0], x[0], rtol=2**-4, atol=0)


def test_a_row_of_zeros_stays_zeros_with_a_finite_scale() -> None:
    x = _rows()
    q, scale = quantize_rows(x)
    assert (q[7].float() == 0).all()
    assert torch.isfinite(scale).all() and (scale > 0).all()
