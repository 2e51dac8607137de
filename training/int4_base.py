"""The INT4 base of a QLoRA job (`base_quantization: "int4"`): LoRA trained over frozen 4-bit projections.

`load_int4_base` loads the base model as `training.trainer.load_base` does, then quantizes every
linear projection of its decoder layers (q/k/v/o, gate/up/down: those LoRA wraps and the others)
into AWQ's INT4 layout with kernels.int4's quantizer (training.int4_layout picks each group: 128, or
the largest multiple of 16 dividing the input features) and drops the bf16 weight as it goes. The
model is read into host memory whole, as `load_base` reads it; each projection is quantized on the
device, so the device never holds more than one projection in both forms. The embeddings, the LM
head and the norms stay in the compute dtype, as in an AWQ checkpoint.

An `Int4Linear` is an `nn.Linear` without a `weight`, so PEFT wraps it as it wraps any linear layer
(its LoRA path reads the same input and adds its product, in the compute dtype) and the trainer
needs no other change. It computes `x @ dequant(W)` through `Int4Matmul`, an autograd function
whose backward gives the input's gradient only, `dy @ dequant(W)^T`: the base is frozen, so no
weight gradient exists to compute. On CUDA both directions dequantize the layer's weight with
kernels.int4's Triton dequantizer and let cuBLAS multiply, the bf16 weight living for that one
product (`kernels.int4.matmul` does so from `DEQUANT_MIN_ROWS` rows on, which a training batch
always passes: training's row counts are where cuBLAS beats a fused tile loop; bench/qlora.py's
`--kernels` times both, and `kernels.int4.matmul_t_triton`, the fused backward, against it). On the
CPU both are the torch reference, which dequantizes the layer's weight for the one product. They
run as two torch custom ops, so torch.compile captures a decoder layer whole around them
(training.compiled_layers) rather than breaking its graph at each kernel.

The adapter a QLoRA job saves is PEFT's, for the bf16 base: the LoRA weights alone, the same files
and manifest as any job's (docs/quantized-bases.md says what training on the 4-bit base costs them).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kernels.int4 import PACK, dequantize_triton, matmul, matmul_t_torch, matmul_torch, quantize
from training.compiled_layers import decoder_layers
from training.int4_layout import group_size_for, projection_problem
from training.trainer import LoadedBase, TrainingSetupError, load_tokenizer, pick_device


@torch.library.custom_op("loraplex_training::int4_matmul", mutates_args=())
def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:  # fmt: skip
    """``x [M, in] @ dequant(W)``: on CUDA ``kernels.int4.matmul`` (at training's row counts the layer's
    weight dequantized by Triton and multiplied by cuBLAS), the torch reference elsewhere."""
    if x.is_cuda:
        return matmul(x, qweight, qzeros, scales, group_size)
    return matmul_torch(x, qweight, qzeros, scales, group_size)


@int4_matmul.register_fake
def _int4_matmul_shape(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> torch.Tensor:  # fmt: skip
    return x.new_empty((x.shape[0], qweight.shape[1] * PACK))


@torch.library.custom_op("loraplex_training::int4_matmul_t", mutates_args=())
def int4_matmul_t(dy: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> torch.Tensor:  # fmt: skip
    """``dy [M, out] @ dequant(W)^T``: on CUDA the layer's weight dequantized by Triton, multiplied by
    cuBLAS and dropped; the torch reference elsewhere."""
    if dy.is_cuda:
        return dy @ dequantize_triton(qweight, qzeros, scales, group_size, dy.dtype).t()
    return matmul_t_torch(dy, qweight, qzeros, scales, group_size)


@int4_matmul_t.register_fake
def _int4_matmul_t_shape(dy: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int) -> torch.Tensor:  # fmt: skip
    return dy.new_empty((dy.shape[0], qweight.shape[0]))


class Int4Matmul(torch.autograd.Function):
    """``x @ dequant(W)`` with the input's gradient only: W is frozen and has none."""

    @staticmethod
    def forward(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:  # fmt: skip
        return int4_matmul(x, qweight, qzeros, scales, group_size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, qweight, qzeros, scales, group_size = inputs
        # The packed weight only: the input is not needed for the input's gradient.
        ctx.save_for_backward(qweight, qzeros, scales)
        ctx.group_size = group_size

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        qweight, qzeros, scales = ctx.saved_tensors
        return int4_matmul_t(dy, qweight, qzeros, scales, ctx.group_size), None, None, None, None


class Int4Linear(torch.nn.Linear):
    """A frozen linear projection held in AWQ's INT4 layout (buffers `qweight`, `qzeros`, `scales`).

    A subclass of nn.Linear for PEFT's and the trainer's sake (they adapt linear layers), built
    without nn.Linear's init so that no float `weight` is ever allocated (`weight` is None). PEFT
    finds its device through `qweight`, as it does for GPTQ layers."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:  # fmt: skip
        torch.nn.Module.__init__(self)
        self.in_features = qweight.shape[0]
        self.out_features = qweight.shape[1] * PACK
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        # No float weight: None where PEFT and transformers look for one (they then find `qweight`).
        self.register_parameter("weight", None)
        self.register_parameter("bias", None if bias is None else torch.nn.Parameter(bias, requires_grad=False))

    @classmethod
    def quantized(cls, linear: torch.nn.Linear, device: torch.device) -> Int4Linear:
        """`linear`'s weight quantized on `device` (its group: training.int4_layout)."""
        group = group_size_for(linear.in_features)
        if group is None:
            raise ValueError(f"{linear.in_features} input features take no INT4 group")
        qweight, qzeros, scales = quantize(linear.weight.detach().to(device), group)
        bias = None if linear.bias is None else linear.bias.detach().to(device)
        return cls(qweight, qzeros, scales, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast, the dtype nn.Linear would compute in; otherwise the input's.
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        flat = x.reshape(-1, self.in_features).to(dtype)
        y = Int4Matmul.apply(flat, self.qweight, self.qzeros, self.scales, self.group_size)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


def quantize_projections(model: torch.nn.Module, device: torch.device) -> int:
    """Replaces every linear projection of `model`'s decoder layers by its Int4Linear on `device`, one at a
    time (its float weight dropped before the next is quantized); returns how many. TrainingSetupError
    naming the projections INT4 cannot hold, before any is changed."""
    found = [(layer, name, module) for layer in decoder_layers(model) for name, module in layer.named_modules()
             if isinstance(module, torch.nn.Linear) and not isinstance(module, Int4Linear)]
    problems = sorted({problem for _, name, module in found
                       if (problem := projection_problem(name.rsplit(".", 1)[-1], module.out_features,
                                                         module.in_features)) is not None})
    if problems:
        raise TrainingSetupError(f"The base model cannot be trained with base_quantization \"int4\": "
                                 f"{'; '.join(problems)}. Train it on the bf16 base (base_quantization \"none\").")
    for layer, name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, Int4Linear.quantized(module, device))
    return len(found)


@lru_cache(maxsize=1)
def load_int4_base(path: str) -> LoadedBase:
    """The base at `path` with INT4 projections (module docstring), loaded once per process: read on the
    CPU, each projection quantized on the device, then the rest (embeddings, head, norms) moved there."""
    device = pick_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    quantize_projections(model, device)
    # transformers wraps PreTrainedModel.to in a decorator whose stub takes the model, not a device.
    model.to(device)  # type: ignore[arg-type]
    return LoadedBase(model=model, tokenizer=load_tokenizer(path), path=path, device=device)
