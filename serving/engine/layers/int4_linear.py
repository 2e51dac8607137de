"""INT4 base weights from an AWQ checkpoint (its ``config.json``'s ``quantization_config`` says
``quant_method: awq``; the model is built for it, docs/quantized-bases.md): each base projection
keeps the checkpoint's ``qweight``, ``qzeros`` and ``scales`` as they are (kernels.int4 states the
layout), a quarter of bf16's bytes plus one fp16 scale and one 4-bit zero per group, and computes
``x @ dequant(W)`` per call:

- **Triton** (CUDA): ``kernels.int4.matmul``: below ``DEQUANT_MIN_ROWS`` rows (decode) the dequant-GEMM
  that fuses the dequantization into its tiles and reads only the packed weight; from there on
  (prefill) the weight dequantized by one Triton launch and multiplied by cuBLAS;
- **torch** (CPU, or a kernel-less run): the reference, which dequantizes the whole weight and
  multiplies (``kernels.int4.matmul_torch``); it is there to test, not to serve.

Both round the dequantized weight once to the compute dtype, so they multiply the same values.
Embeddings, LM head, norms, biases and adapters stay in the compute dtype; the LoRA path reads the
same activations and adds its delta to the INT4 product as it does to the bf16 one.

Only what AutoAWQ's GEMM checkpoints hold is taken; anything else in ``quantization_config`` is
refused by :func:`awq_spec` with the field named (GPTQ's act-order ``g_idx`` and off-by-one zeros
are another layout: docs/quantized-bases.md says why AWQ was chosen).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kernels.int4 import MIN_GROUP, matmul, matmul_torch

# Modules AWQ checkpoints commonly leave unquantized that the engine never quantizes anyway.
_UNQUANTIZED_OK = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class AWQSpec:
    """What the engine reads of an AWQ ``quantization_config``."""

    group_size: int


def awq_spec(quantization_config: Mapping[str, object] | None) -> AWQSpec | None:
    """The AWQ settings of a checkpoint's ``quantization_config`` (None: not quantized). Raises
    ValueError naming what is not supported: another method, bits, layout or zero-point mode."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method != "awq":
        raise ValueError(
            f"the checkpoint's quantization_config has quant_method {method!r}: the engine loads quantized "
            "checkpoints of quant_method 'awq' only (4-bit, GEMM layout)"
        )
    bits = quantization_config.get("bits", quantization_config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ checkpoints of {bits} bits are not supported: the engine loads 4-bit ones")
    version = str(quantization_config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: the engine loads the 'gemm' layout")
    if quantization_config.get("zero_point", True) is not True:
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    group = quantization_config.get("group_size", quantization_config.get("q_group_size"))
    if not isinstance(group, int) or group <= 0 or group % MIN_GROUP:
        raise ValueError(f"AWQ group_size must be a positive multiple of {MIN_GROUP} (the kernel's K tile), got {group!r}")
    skipped = quantization_config.get("modules_to_not_convert") or []
    if not isinstance(skipped, list):
        raise ValueError(f"AWQ modules_to_not_convert must be a list, got {skipped!r}")
    other = [name for name in skipped if not str(name).endswith(_UNQUANTIZED_OK)]
    if other:
        raise ValueError(
            f"AWQ checkpoints that leave projections unquantized (modules_to_not_convert {other}) are not supported"
        )
    return AWQSpec(group_size=group)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None, *, triton: bool) -> torch.Tensor:  # fmt: skip
    """``x [T, in] @ dequant(W) (+ bias)`` in ``x``'s dtype, by the Triton kernel or the torch reference."""
    if triton:
        y = matmul(x, qweight, qzeros, scales, group_size)
    else:
        y = matmul_torch(x, qweight, qzeros, scales, group_size)
    if bias is not None:
        y += bias
    return y
