"""Rotary position embeddings, with every RoPE variant transformers knows (default, linear,
dynamic, yarn, llama3, ...) through its own parameter functions, so long-context configs load
with the frequencies they were trained with."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed once in fp32."""

    # Buffers (register_buffer), declared for the type checker: nn.Module's __getattr__ returns
    # Tensor | Module.
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config, head_dim)
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
