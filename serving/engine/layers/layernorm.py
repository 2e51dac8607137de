"""RMSNorm as Llama, Qwen2 and Mistral compute it (in fp32, then back to the input dtype), with the
residual add folded in: ``norm(x, residual)`` returns ``(rmsnorm(x + residual), x + residual)``, so
the decoder passes the residual stream along as vLLM's does. On CUDA one Triton kernel does both
(``kernels.fused_ops``); on CPU the torch ops below, which round at the same places.

Gemma's variant (``unit_offset``) stores the weight as an offset from one and multiplies by
``1 + weight`` in fp32 before rounding once, where Llama rounds the normalised row first.

``forward_fp8`` also returns the normed rows quantized to FP8 for the native FP8 projection after
the norm (serving.engine.layers.fp8_linear): on CUDA the same kernel writes them; on CPU (where FP8
runs natively only in tests) ``kernels.fp8.quantize_rows`` of the torch path's output, which the
kernel's rows equal bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8 import QuantizedRows, quantize_rows


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, *, device: torch.device, dtype: torch.dtype, unit_offset: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, residual stream)``: the stream is ``x + residual``, or ``x`` without one."""
        if x.is_cuda:
            from kernels.fused_ops import rms_norm

            out, summed = rms_norm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)
            return out, summed if summed is not None else x
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype), x
        return self.weight * h.to(dtype), x

    def forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows]:
        """``forward``'s ``(normed, residual stream)`` and the normed rows quantized per row."""
        if x.is_cuda:
            from kernels.fused_ops import rms_norm_fp8

            out, summed, rows = rms_norm_fp8(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)
            return out, summed if summed is not None else x, rows
        out, stream = self(x, residual)
        return out, stream, quantize_rows(out)
