"""The decoder layers of a training run compiled with torch.compile, one layer's code for all of them,
and its loss (training.packing.compiled_loss).

A LoRA step is bound by what eager PyTorch runs between the GEMMs: the RMS norms in fp32, the
rotary embedding, SiLU × up, the residual adds, PEFT's A → B → scale → add on every projection and
the casts autocast inserts, each a kernel of its own, forward and backward. Compiling the decoder
layer fuses them. Compiling each layer (PyTorch's "regional compilation") rather than the whole
model costs one compilation, not one per layer: the layers are instances of one class, and
torch.compile treats their parameters as inputs, so they share the compiled code.

The base model is shared by the jobs of a worker process: `compiled_layers` undoes the compilation
(the loss's too) on leaving, so the next job's adapter (other ranks, other target modules) does not
meet the compiled code's guards, and the recompilation limit is not spent across jobs. The trainer
compiles on one CUDA device alone (`compile_wanted`): on the CPU the compilation costs more than a
tiny model's run, a sharded (FSDP) base keeps eager layers, and so does a job with gradient
checkpointing (its reentrant recomputation under compiled layers is not what was measured), and a
DoRA job (`use_dora`): PEFT's DoRA module (peft 0.21.2, `DoraLinearLayer`) breaks Dynamo's graph in
`dequantize_module_weight` (`str.startswith` on the weight's class module, its torchao check) and its
`forward` recompiles per call site until the recompile limit, so a layer compiles as tens of graphs:
the tiny Llama's 6-epoch DoRA job compiled 47 graphs (85 frames, 58 graph breaks) against 4 for
LoRA, which on the H100 took the DoRA parametrization of tests/engine/test_trained_adapter_served.py
past its 45 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from training.packing import compiled_loss


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (transformers marks them as checkpointable layers)."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def compile_wanted(device: torch.device, distributed: bool, checkpointing: bool, dora: bool = False) -> bool:
    """The trainer's default: compiled on one CUDA device, eager elsewhere (module docstring), and
    eager with gradient checkpointing, whose recomputation under compiled layers was not measured,
    and for DoRA, whose PEFT module breaks the compiled graph into tens."""
    return device.type == "cuda" and not distributed and not checkpointing and not dora


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module, *, backend: str = "inductor") -> Iterator[int]:
    """Compiles every decoder layer of `model`, and the loss, while inside; yields how many layers."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend)
    try:
        with compiled_loss(backend):
            yield len(layers)
    finally:
        for layer in layers:
            # nn.Module.compile() keeps the compiled callable here; None restores the plain call.
            layer._compiled_call_impl = None
        # The compiled code guards on this run's modules; later jobs would only fail those guards.
        torch._dynamo.reset()

