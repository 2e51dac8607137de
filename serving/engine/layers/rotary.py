"""Rotary position embeddings: the plain one and the scaled variants whose frequencies are fixed
once for all positions (linear, llama3, yarn), through transformers' own parameter functions, so
long-context configs load with the frequencies they were trained with.

Refused, by name: ``dynamic`` (NTK) and ``longrope`` (Phi-3's ``su``), whose frequencies change with
the length of the sequence being run (transformers recomputes them every forward past
``original_max_position_embeddings``, so one cached key would need two rotations), any rope_type
transformers does not know, and a ``partial_rotary_factor`` below 1 (every kernel rotates the whole
head). A config with RoPE per layer type (Gemma 3: local and global bases) gets one table per type.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT = {"dynamic": "dynamic NTK scaling", "longrope": "LongRoPE (Phi-3's su)"}


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, object]:
    """The config's RoPE parameters (of ``layer_type``'s layers where they differ per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    return dict(params)


def check_rope(config: PretrainedConfig, layer_type: str | None = None) -> str:
    """The rope_type, once it is one the engine computes exactly; a ValueError naming it otherwise."""
    params = rope_parameters(config, layer_type)
    rope_type = str(params.get("rope_type", "default"))
    where = f" ({layer_type} layers)" if layer_type else ""
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(
            f"rope_type {rope_type!r}{where} is not supported: {_LENGTH_DEPENDENT[rope_type]} changes the "
            f"frequencies with the sequence's length; the engine serves {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}{where}; the engine serves {', '.join(STATIC_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", 1.0))  # type: ignore[arg-type]
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial}{where} is not supported: the engine rotates whole heads")
    return rope_type


def _inv_freq(config: PretrainedConfig, head_dim: int, layer_type: str | None) -> tuple[torch.Tensor, float]:
    rope_type = check_rope(config, layer_type)
    if rope_type == "default":
        params = rope_parameters(config, layer_type)
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))  # type: ignore[arg-type]
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
    return inv_freq, float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed once in fp32."""

    # Buffers (register_buffer), declared for the type checker: nn.Module's __getattr__ returns
    # Tensor | Module.
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config, head_dim, layer_type)
        freqs = torch.arange(max_positions, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of each token, ``[T, 1, D]``: looked up once per step for all layers."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by each token's position (on CUDA in place,
    one Triton launch each; on CPU into new tensors)."""
    if q.is_cuda:
        from kernels.fused_ops import rotary_

        rotary_(q, cos, sin)
        rotary_(k, cos, sin)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
