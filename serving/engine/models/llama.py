"""The Llama family forward (Llama, Qwen2, Qwen3, Mistral, Phi-3: one architecture with small
differences): RMSNorm → attention with RoPE and grouped-query heads → RMSNorm → SwiGLU MLP,
residuals around both (each residual add folded into the next RMSNorm). Qwen2 adds biases to
q/k/v; Qwen3 instead RMSNorms each head of q and k (over head_dim, before RoPE); Mistral, Phi-3
(and Qwen2/Qwen3 optionally) use a sliding window; Phi-3's checkpoints and adapters name the fused
projections (``qkv_proj``, ``gate_up_proj``: serving.engine.models.common). Llama 3.x's RoPE scaling
and the other fixed-frequency variants are serving.engine.layers.rotary's.
"""

from __future__ import annotations

from typing import Unpack

import torch
from torch import nn
from transformers import PretrainedConfig

from serving.engine.distributed.parallel import SINGLE, TensorParallel
from serving.engine.layers.layernorm import RMSNorm
from serving.engine.layers.parallel_linear import VocabParallelEmbedding
from serving.engine.layers.rotary import RotaryEmbedding
from serving.engine.models.common import (
    MLP,
    Attention,
    AttentionOptions,
    CausalLM,
    LoRASlots,
    Rope,
    head_dim_of,
    norm_into,
)

LLAMA_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        device, dtype = lora["device"], lora["dtype"]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        options = AttentionOptions(qk_norm=config.model_type == "qwen3")
        self.self_attn = Attention(config, layer_idx, options, **lora)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(config, layer_idx, **lora)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this layer's MLP output, the residual stream before it)``: the next layer's norm adds
        them (``x + attn(norm(x))``, then ``+ mlp(norm(...))``, with one fused add+norm each)."""
        hidden, residual, rows = norm_into(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(rope, hidden, rows)
        hidden, residual, rows = norm_into(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(hidden, rows), residual


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        device, dtype = lora["device"], lora["dtype"]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, lora["tp"], device=device,
                                                   dtype=dtype)  # fmt: skip
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **lora) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Qwen3 / Mistral / Phi-3 with multi-LoRA projections and paged attention."""

    model: Backbone

    def __init__(self, config: PretrainedConfig, *, max_positions: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__(config, device=device, dtype=dtype, tp=tp)
        self.model = Backbone(config, max_positions, device=device, dtype=dtype, tp=tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rope = self.model.rotary.lookup(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(rope, hidden, residual)
        normed: torch.Tensor = self.model.norm(hidden, residual)[0]
        return normed
