"""QLoRA's quantized projection on CUDA (issue 41, item 3; gpu mark): the Triton dequantizer equals
the reference bit for bit, and the layer's forward and input gradient match the dequantized
weight's, at the 8B gate projection's shape. A file of its own that imports neither Django nor the
training settings, so the GPU machine (which has neither) collects it; test_qlora.py has the rest.
"""

from __future__ import annotations

import pytest
import torch

from kernels import int4
from training.int4_base import Int4Linear


def reference_weight(layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [in, out] by kernels.int4's reference dequantization."""
    return int4.dequantize(layer.qweight, layer.qzeros, layer.scales, layer.group_size, dtype)


def seeded_linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantizer_on_cuda_is_the_reference_bit_for_bit(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    packed = int4.quantize(torch.randn(14336, 4096, device="cuda"), 128)
    assert torch.equal(int4.dequantize_triton(*packed, 128, dtype), int4.dequantize(*packed, 128, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_on_cuda_matches_the_reference(dtype):
    """The Triton forward and the dequantized backward, the 8B gate projection's shape at 200 rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    layer = Int4Linear.quantized(seeded_linear(4096, 14336, False), torch.device("cuda"))
    x = torch.randn(200, 4096, device="cuda", dtype=dtype, requires_grad=True)
    y = layer(x)
    weight = reference_weight(layer, dtype)
    tolerance = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    torch.testing.assert_close(y, x.detach() @ weight, **tolerance)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ weight.t(), **tolerance)
