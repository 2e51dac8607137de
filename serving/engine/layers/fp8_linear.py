"""FP8 base weights (``EngineConfig.quantization="fp8"``, opt-in): each base projection's weight
``[out, in]`` is stored as ``float8_e4m3fn`` with one fp32 scale per output channel (its row's
``amax / 448``), half the bytes of bf16, so a decode step, which reads every weight once, reads half.
Embeddings, the LM head and the norms stay in the model's dtype; so do the adapters, whose LoRA path
reads the same activations and row pools as without FP8 (serving.engine.layers.lora_linear).

The forward, per call: each token's activation row is quantized to e4m3 with its own scale
(``kernels.fp8``, one Triton launch on CUDA), or comes quantized already from the kernel that wrote
the activations (below), then

- **native** (CUDA, compute capability 9.x: Hopper): ``torch._scaled_mm(x_fp8, w_fp8.t(),
  scale_a=[M, 1], scale_b=[1, N], out_dtype=bf16, use_fast_accum=True)``, rowwise scaling, one
  rounding to bf16; it launches no host synchronisation, so decode steps capture it in CUDA graphs.
  *Fast accumulation* keeps the partial sums in the tensor cores' FP8 accumulator (narrower than
  fp32) instead of promoting them to fp32 registers every few K blocks: on the H100 it makes the
  mixed steps' GEMMs (256-512 rows) 1.58-1.69 × bf16's where full accumulation gave 1.19-1.49 × (a
  dip to 1.19 × at 319 rows), and it moves the product by at most 1.3 % of its largest magnitude
  on random data, a fifth of what the choice of scaling (rowwise against one scale a tensor) moves
  it (bench/fp8_gemm.py; docs/benchmarks.md, "The FP8 GEMM");
- **emulated** (CPU and other GPUs): the same quantized weights and activations dequantized
  (``q.float() * scale``), multiplied in fp32 and rounded once to the compute dtype. Emulation has
  the native path's numerics up to the GEMM's accumulation order, so CPU tests exercise what the
  H200 runs; it is slower than the unquantized layer (it dequantizes the weight at every call) and
  is there to test, not to serve.

The bias (in the compute dtype) is added after the product, as the unquantized layer does.

**Activations quantized by their producer** (``x_fp8``): where the kernel before a projection is
ours, it writes the FP8 rows and their scales beside its output in the same launch
(``kernels.fused_ops.rms_norm_fp8`` before q/k/v and gate/up, ``silu_mul_fp8`` before down), and the
native path takes them instead of quantizing ``x`` again: three of a layer's four quantizing
launches gone, each with its read of the activations (o_proj's input comes from attention, not ours
to fuse: it still quantizes its own). The rows are bit-equal to ``quantize_rows(x)`` (the fused
kernels round their output to the compute dtype first and quantize those values with the same
code), so the product is exactly what it was. The producer still writes ``x`` in the compute dtype,
which the LoRA path reads as before. The model wires it (serving.engine.models.common, where a
projection ``takes_fp8_rows``). The emulation ignores ``x_fp8`` and quantizes ``x`` with the torch
chain, exactly as before.

Where FP8 is refused (by ``EngineConfig``, and by :func:`quantize_weight` at load): on CUDA any
dtype but bf16 (the rowwise ``_scaled_mm`` writes bf16 only, and fp16/fp32 on a GPU would not be
served for speed anyway); a projection whose input or output width is not a multiple of 16
(``_scaled_mm``'s requirement), on every device so that a CPU run fails where the GPU's would. On
CPU any float dtype works through emulation (fp32, the engine's CPU default, included).

Under tensor parallelism each rank quantizes its own shard after loading: a column-parallel layer's
scales are those of its output rows; a row-parallel layer's weight and activation scales are taken
over its own input columns, each rank's partial product is dequantized by its own scales, and the
all-reduce sums dequantized values, so the shards share no scale (the result differs from one rank's
only in where the rounding falls).

Top-1 agreement with PEFT is a tolerance, never exactness: tests/engine/test_fp8.py measures it
over a fixed prompt set (docs/serving-worker.md, "FP8 base weights").
"""

from __future__ import annotations

import torch

from kernels.fp8 import QuantizedRows, quantize_rows, quantize_rows_triton

# torch._scaled_mm needs the product's inner and output widths to be multiples of this.
WIDTH_MULTIPLE = 16


def native_fp8(device: torch.device) -> bool:
    """Whether FP8 layers on ``device`` run ``torch._scaled_mm`` (Hopper) rather than the emulation."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def quantize_weight(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [out, in] float8_e4m3fn, scale [1, out] float32)`` of ``weight [out, in]``, one scale
    per output channel, laid out as ``_scaled_mm``'s ``scale_b``. Raises ValueError (naming
    ``name``) when a width is not a multiple of 16."""
    out_features, in_features = weight.shape
    if out_features % WIDTH_MULTIPLE or in_features % WIDTH_MULTIPLE:
        raise ValueError(
            f"fp8 quantization needs widths that are multiples of {WIDTH_MULTIPLE} (torch._scaled_mm's); {name} "
            f"is [{out_features}, {in_features}] on this rank: serve this model unquantized"
        )
    # On CUDA the one-launch kernel (bit-equal to the torch chain): the chain's fp32 temporaries,
    # freed between layers, leave the caching allocator's segments split under the FP8 weights, and
    # half the memory quantization frees could not be handed back.
    q, scale = quantize_rows_triton(weight) if weight.is_cuda else quantize_rows(weight)
    return q, scale.view(1, out_features).contiguous()


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, *,
               native: bool, x_fp8: QuantizedRows | None = None) -> torch.Tensor:  # fmt: skip
    """``x [T, in] @ dequant(w_fp8).T (+ bias)`` in ``x``'s dtype, the activations quantized per token.
    ``x_fp8``: ``x`` already quantized (bit-equal to ``quantize_rows(x)``) by the kernel that wrote it;
    the native path uses it, the emulation quantizes ``x`` itself."""
    if native:
        x_q, x_scale = x_fp8 if x_fp8 is not None else quantize_rows_triton(x)
        y = torch._scaled_mm(x_q, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype,
                              use_fast_accum=True)
    else:
        x_q, x_scale = quantize_rows(x)
        y = ((x_q.float() * x_scale) @ (w_fp8.float() * w_scale.t()).t()).to(x.dtype)
    if bias is not None:
        y += bias
    return y
