"""The Gemma 2 and Gemma 3 (text) forward, on the shared attention and MLP blocks
(serving.engine.models.common) with Gemma's differences:

- every RMSNorm multiplies by ``1 + weight`` in fp32 (the checkpoint stores the offset from one);
- the embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the model's dtype first, as
  transformers does), and the LM head shares the embedding matrix;
- four norms per layer: after attention and after the MLP as well as before each, the residual
  add after the post-norm (``x + post(attn(pre(x)))``);
- GeGLU (``gelu_pytorch_tanh``) in the MLP; scores scaled by ``query_pre_attn_scalar ** -0.5``;
- layers alternate sliding-window and full attention (``layer_types``);
- Gemma 2 soft-caps the attention scores and the final logits (``cap * tanh(x / cap)``); Gemma 3
  RMSNorms each query and key head instead, and its local (windowed) and global layers rotate with
  RoPE bases of their own (``rope_parameters`` per layer type). transformers' Gemma 3 applies no
  attention soft-cap whatever the config says; neither does the engine.
"""

from __future__ import annotations

from typing import Unpack, cast

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

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


def _norm(config: PretrainedConfig, lora: LoRASlots) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, device=lora["device"], dtype=lora["dtype"], unit_offset=True)


def _layer_types(config: PretrainedConfig) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        gemma3 = config.model_type == "gemma3_text"
        options = AttentionOptions(
            qk_norm=gemma3,
            unit_offset_norms=True,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            softcap=None if gemma3 else getattr(config, "attn_logit_softcapping", None),
        )
        self.layer_type = _layer_types(config)[layer_idx]
        self.input_layernorm = _norm(config, lora)
        self.self_attn = Attention(config, layer_idx, options, **lora)
        self.post_attention_layernorm = _norm(config, lora)
        self.pre_feedforward_layernorm = _norm(config, lora)
        self.mlp = MLP(config, layer_idx, **lora)
        self.post_feedforward_layernorm = _norm(config, lora)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(post-norm of this layer's MLP output, the residual stream before it)``, as the Llama
        layer returns them: the next layer's input norm (or the final one) adds the two."""
        hidden, residual, rows = norm_into(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, rows))[0]
        hidden, residual, rows = norm_into(self.pre_feedforward_layernorm, self.mlp.gate_up_proj, hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, rows))[0], residual


class GemmaBackbone(nn.Module):
    # A buffer (register_buffer), declared for the type checker.
    embed_scale: torch.Tensor

    def __init__(self, config: PretrainedConfig, max_positions: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        device, dtype = lora["device"], lora["dtype"]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, lora["tp"], device=device,
                                                   dtype=dtype)  # fmt: skip
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device),
                             persistent=False)  # fmt: skip
        # One table per layer type where the RoPE parameters differ per type (Gemma 3), else one.
        per_type = isinstance((getattr(config, "rope_parameters", None) or {}).get("full_attention"), dict)
        types = sorted(set(_layer_types(config))) if per_type else [None]
        self.rotary = nn.ModuleDict({
            str(layer_type): RotaryEmbedding(config, head_dim_of(config), max_positions, device=device, dtype=dtype,
                                             layer_type=layer_type)
            for layer_type in types
        })  # fmt: skip
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, **lora) for i in range(config.num_hidden_layers))
        self.norm = _norm(config, lora)
        self.rope_keys = [layer_type if per_type else "None" for layer_type in _layer_types(config)]


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 text with multi-LoRA projections and paged attention."""

    model: GemmaBackbone

    def __init__(self, config: PretrainedConfig, *, max_positions: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported: the engine generates, causally")
        super().__init__(config, device=device, dtype=dtype, tp=tp)
        self.model = GemmaBackbone(config, max_positions, device=device, dtype=dtype, tp=tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        backbone = self.model
        hidden = self.embed(input_ids) * backbone.embed_scale
        ropes = {key: cast(RotaryEmbedding, table).lookup(positions) for key, table in backbone.rotary.items()}
        residual = None
        for layer, key in zip(backbone.layers, backbone.rope_keys):
            hidden, residual = layer(ropes[key], hidden, residual)
        normed: torch.Tensor = backbone.norm(hidden, residual)[0]
        return normed
