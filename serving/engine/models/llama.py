"""The Llama family forward (Llama, Qwen2, Qwen3, Mistral: one architecture with small differences):
RMSNorm → attention with RoPE and grouped-query heads → RMSNorm → SwiGLU MLP, residuals around
both (each residual add folded into the next RMSNorm). Qwen2 adds biases to q/k/v; Qwen3 instead
RMSNorms each head of q and k (over head_dim, before RoPE); Mistral (and Qwen2/Qwen3 optionally)
uses a sliding window.

q/k/v and gate/up are fused into one multi-LoRA projection each, so each step runs four matmuls
per layer and four LoRA calls; checkpoint tensors are mapped onto the fused weights at load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TypedDict, Unpack, cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from serving.engine.layers.attention import PagedAttention
from serving.engine.layers.layernorm import RMSNorm
from serving.engine.layers.lora_linear import MultiLoRALinear
from serving.engine.layers.rotary import RotaryEmbedding, apply_rotary

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# Adapter target modules this model serves (PEFT's names), and the fused projection of each.
LORA_TARGETS = {
    "q_proj": "self_attn.qkv_proj",
    "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj",
    "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}
_FUSED_NAME = re.compile(r"^(model\.layers\.\d+\.)(self_attn|mlp)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    window: int | None = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


Rope = tuple[torch.Tensor, torch.Tensor]


class LoRASlots(TypedDict):
    """What every multi-LoRA projection of the model is built with (passed down as keywords); the
    adapter row pools come later (``MultiLoRALinear.allocate_rows``)."""

    device: torch.device
    dtype: torch.dtype


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MultiLoRALinear(
            config.hidden_size,
            [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
            bias=qkv_bias,
            layer_idx=layer_idx,
            **lora,
        )
        self.o_proj = MultiLoRALinear(q_size, [("o_proj", config.hidden_size)], bias=o_bias, layer_idx=layer_idx, **lora)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, _sliding_window(config, layer_idx))
        self.split = (q_size, kv_size, kv_size)
        # Qwen3: one RMSNorm over head_dim for every query head, another for every key head.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":
            device, dtype = lora["device"], lora["dtype"]
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Rows of head_dim (a 2-D input, as the fused kernel takes it), contiguous after the split.
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v))
        return out


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MultiLoRALinear(
            config.hidden_size, [("gate_proj", size), ("up_proj", size)], bias=bias, layer_idx=layer_idx, **lora
        )
        self.down_proj = MultiLoRALinear(size, [("down_proj", config.hidden_size)], bias=bias, layer_idx=layer_idx, **lora)
        self.act = ACT2FN[config.hidden_act]
        self.fused_silu = config.hidden_act == "silu"  # the fused kernel computes SiLU only
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_silu and gate_up.is_cuda:
            from kernels.fused_ops import silu_mul

            fused: torch.Tensor = self.down_proj(silu_mul(gate_up))
            return fused
        gate, up = gate_up.split(self.size, dim=-1)
        out: torch.Tensor = self.down_proj(self.act(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        device, dtype = lora["device"], lora["dtype"]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.self_attn = Attention(config, layer_idx, **lora)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(config, layer_idx, **lora)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this layer's MLP output, the residual stream before it)``: the next layer's norm adds
        them (``x + attn(norm(x))``, then ``+ mlp(norm(...))``, with one fused add+norm each)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        device, dtype = lora["device"], lora["dtype"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(config, head_dim, max_positions, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **lora) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """The layers, typed (an nn.ModuleList holds plain Modules to the type checker)."""
        return (cast(DecoderLayer, layer) for layer in self.layers)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral with multi-LoRA projections and paged attention."""

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; the engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        lora = LoRASlots(device=device, dtype=dtype)
        self.model = Backbone(config, max_positions, **lora)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.lookup(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(rope, hidden, residual)
        normed: torch.Tensor = self.model.norm(hidden, residual)[0]
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return hidden @ weight.T

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder_layers()]

    def lora_layers(self) -> Iterator[MultiLoRALinear]:
        for layer in self.model.decoder_layers():
            yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the model; every weight must appear."""
        params = dict(self.named_parameters())
        expected = set(self.checkpoint_names())
        for name, tensor in tensors:
            if "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name not in expected:
                raise ValueError(f"checkpoint tensor {name!r} has no place in a {self.config.model_type} model")
            dest = self._destination(name, params)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            expected.discard(name)
        if expected:
            raise ValueError(f"the checkpoint lacks {len(expected)} weights, e.g. {sorted(expected)[:3]}")

    def checkpoint_names(self) -> Iterator[str]:
        """The Hugging Face names of every weight this model takes from a checkpoint."""
        for name, _ in self.named_parameters():
            target, _, kind = name.rpartition(".")
            if target.endswith(("qkv_proj", "gate_up_proj")):
                layer = self._fused_layer(target)
                block = target.rpartition(".")[0]
                yield from (f"{block}.{module}.{kind}" for module in layer.slice_names)
            else:
                yield name

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
        fused = _FUSED_NAME.match(name)
        if not fused:
            return params[name]
        prefix, block, module, kind = fused.groups()
        target = f"{prefix}{block}.{'qkv_proj' if block == 'self_attn' else 'gate_up_proj'}"
        offset, width = self._fused_layer(target).slice_of(module)
        return params[f"{target}.{kind}"][offset : offset + width]

    def _fused_layer(self, target: str) -> MultiLoRALinear:
        layer = self.get_submodule(target)
        if not isinstance(layer, MultiLoRALinear):
            raise TypeError(f"{target} is a {type(layer).__name__}, not a fused projection")
        return layer
