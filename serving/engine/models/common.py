"""What every model family shares: the attention block and the gated MLP with multi-LoRA
projections, and the causal LM around a family's layers (loading Hugging Face checkpoints onto
the fused projections, the LM head, the layer iterators the model runner reads).

q/k/v and gate/up are fused into one multi-LoRA projection each, so each step runs four matmuls
per layer and four LoRA calls. Most checkpoints store the slices apart (``q_proj`` ...), mapped onto
the fused weight at load, and adapters target each slice by its name. Phi-3 stores them fused
(``qkv_proj``, ``gate_up_proj``) and PEFT adapts those whole (one A for the three slices), so
there the fused projection is one slice under the checkpoint's own name.

An AWQ checkpoint (serving.engine.layers.int4_linear) stores each projection as ``qweight``,
``qzeros`` and ``scales`` with the output features along columns: a slice of a fused projection
lands in its columns (eight to a packed word), where a bf16 weight's slice lands in its rows.

Under tensor parallelism each rank builds its share (serving.engine.layers.parallel_linear): its
heads, its MLP columns, its vocabulary rows; checkpoint tensors are cut to it as they are loaded.

FP8 (serving.engine.layers.fp8_linear): where a projection ``takes_fp8_rows``, the kernel before it
quantizes its input in the same launch: the norms before q/k/v and gate/up (:func:`norm_into`,
which the families' layers call) and SiLU·mul before down (``MLP``). Attention and the MLP take
those rows beside their bf16 input, which the LoRA path still reads.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, Unpack, cast

import torch
from torch import nn
from torch.nn import functional
from transformers import PretrainedConfig

from kernels.fp8 import QuantizedRows, quantize_rows
from serving.engine.context import get_context
from serving.engine.distributed.parallel import TensorParallel
from serving.engine.layers.attention import PagedAttention
from serving.engine.layers.int4_linear import awq_spec
from serving.engine.layers.layernorm import RMSNorm
from serving.engine.layers.lora_linear import MultiLoRALinear
from serving.engine.layers.parallel_linear import (
    ParallelLMHead,
    Split,
    VocabParallelEmbedding,
    even_share,
    rows,
    split_heads,
)
from serving.engine.layers.rotary import apply_rotary
from serving.engine.layers.vocab_lora import VocabAdapters

_FUSED_NAME = re.compile(r"^(model\.layers\.\d+\.)(self_attn|mlp)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|qweight|qzeros|scales)$")
# AWQ tensors, whose output features run along dim 1, packed eight to an int32 in qweight and qzeros.
_AWQ_PACKED = {"qweight": 8, "qzeros": 8, "scales": 1}
# Checkpoints that store q/k/v and gate/up fused, under these names.
FUSED_CHECKPOINT_MODEL_TYPES = ("phi3",)

Rope = tuple[torch.Tensor, torch.Tensor]


class LoRASlots(TypedDict):
    """What every multi-LoRA projection of the model is built with (passed down as keywords); the
    adapter row pools come later (``MultiLoRALinear.allocate_rows``)."""

    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel  # this rank's place in the engine's tensor-parallel group


@dataclass(frozen=True)
class AttentionOptions:
    """How a family's attention differs from Llama's."""

    qk_norm: bool = False  # an RMSNorm over head_dim on each query and key head, before RoPE (Qwen3, Gemma 3)
    unit_offset_norms: bool = False  # Gemma's (1 + weight) RMSNorm
    scale: float | None = None  # the score scale; None: head_dim ** -0.5
    softcap: float | None = None  # cap * tanh(score / cap) (Gemma 2)


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    window: int | None = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, options: AttentionOptions,
                 **lora: Unpack[LoRASlots]) -> None:  # fmt: skip
        super().__init__()
        tp = lora["tp"]
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads or total_heads
        heads = split_heads(total_heads, total_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.head_dim = dim = head_dim_of(config)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * dim, self.num_kv_heads * dim
        q_rows, kv_rows = rows(heads.first_head, heads.num_heads, dim), rows(heads.first_kv_head, heads.num_kv_heads, dim)
        slices = [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)]
        keep = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        if config.model_type in FUSED_CHECKPOINT_MODEL_TYPES:
            slices = [("qkv_proj", q_size + 2 * kv_size)]
            k_base, v_base = total_heads * dim, (total_heads + total_kv_heads) * dim
            keep = {"qkv_proj": torch.cat([q_rows, kv_rows + k_base, kv_rows + v_base])}
        column = Split(keep=keep) if tp.size > 1 else None
        row = Split(inputs=slice(heads.first_head * dim, (heads.first_head + heads.num_heads) * dim)) if tp.size > 1 else None
        awq = awq_spec(getattr(config, "quantization_config", None))
        self.qkv_proj = MultiLoRALinear(config.hidden_size, slices, bias=qkv_bias, layer_idx=layer_idx, split=column,
                                        awq=awq, **lora)  # fmt: skip
        self.o_proj = MultiLoRALinear(q_size, [("o_proj", config.hidden_size)], bias=o_bias, layer_idx=layer_idx,
                                      split=row, awq=awq, **lora)  # fmt: skip
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window(config, layer_idx),
                                   scale=options.scale, softcap=options.softcap)  # fmt: skip
        self.split = (q_size, kv_size, kv_size)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            norm = dict(device=lora["device"], dtype=lora["dtype"], unit_offset=options.unit_offset_norms)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **norm)  # type: ignore[arg-type]
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **norm)  # type: ignore[arg-type]

    def forward(self, rope: Rope, x: torch.Tensor, x_fp8: QuantizedRows | None = None) -> torch.Tensor:
        """``x_fp8``: ``x`` quantized by the norm before, for an FP8 qkv_proj (:func:`norm_into`)."""
        q, k, v = self.qkv_proj(x, x_fp8).split(self.split, dim=-1)
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



# The MLP activations of the supported families by their configs' names (transformers' ACT2FN
# entries of the same names compute the same functions). Our own table: importing
# transformers.activations pulls in its kernel hub and distributed-tensor modules, 1.5 s of CPU at
# every worker start.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": functional.silu,
    "swish": functional.silu,
    "gelu": functional.gelu,
    "gelu_pytorch_tanh": functools.partial(functional.gelu, approximate="tanh"),
}

class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU for most families, GeGLU (tanh GELU) for Gemma."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, **lora: Unpack[LoRASlots]) -> None:
        super().__init__()
        tp = lora["tp"]
        first, size = even_share(config.intermediate_size, tp, "intermediate_size")  # this rank's columns
        bias = bool(getattr(config, "mlp_bias", False))
        columns = rows(first, size, 1)
        slices = [("gate_proj", size), ("up_proj", size)]
        keep = {"gate_proj": columns, "up_proj": columns}
        if config.model_type in FUSED_CHECKPOINT_MODEL_TYPES:
            slices = [("gate_up_proj", 2 * size)]
            keep = {"gate_up_proj": torch.cat([columns, columns + config.intermediate_size])}
        column = Split(keep=keep) if tp.size > 1 else None
        row = Split(inputs=slice(first, first + size)) if tp.size > 1 else None
        awq = awq_spec(getattr(config, "quantization_config", None))
        self.gate_up_proj = MultiLoRALinear(config.hidden_size, slices, bias=bias, layer_idx=layer_idx, split=column,
                                            awq=awq, **lora)  # fmt: skip
        self.down_proj = MultiLoRALinear(size, [("down_proj", config.hidden_size)], bias=bias, layer_idx=layer_idx,
                                         split=row, awq=awq, **lora)  # fmt: skip
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}: the engine runs {', '.join(sorted(ACTIVATIONS))}")
        self.act = ACTIVATIONS[activation]
        self.fused_silu = activation == "silu"  # the fused kernel computes SiLU only
        self.size = size

    def forward(self, x: torch.Tensor, x_fp8: QuantizedRows | None = None) -> torch.Tensor:
        """``x_fp8``: ``x`` quantized by the norm before, for an FP8 gate_up_proj (:func:`norm_into`)."""
        gate_up = self.gate_up_proj(x, x_fp8)
        fp8 = self.down_proj.takes_fp8_rows
        act_fp8: QuantizedRows | None = None
        if self.fused_silu and gate_up.is_cuda:
            from kernels.fused_ops import silu_mul, silu_mul_fp8

            if fp8:
                act, act_fp8 = silu_mul_fp8(gate_up)
            else:
                act = silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.size, dim=-1)
            act = self.act(gate) * up
            # No kernel of ours writes this product on CUDA (Gemma's GELU): down_proj quantizes it in
            # its own launch. On CPU (native FP8 there only in tests) the torch chain stands in for the
            # fused kernel, as RMSNorm.forward_fp8's does.
            if fp8 and not act.is_cuda:
                act_fp8 = quantize_rows(act)
        out: torch.Tensor = self.down_proj(act, act_fp8)
        return out


def norm_into(norm: RMSNorm, projection: MultiLoRALinear, x: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows | None]:  # fmt: skip
    """``norm(x, residual)``'s ``(normed, residual stream)`` and, where ``projection`` (the one the
    normed rows feed) ``takes_fp8_rows``, those rows quantized by the norm's own kernel; else None."""
    if projection.takes_fp8_rows:
        return norm.forward_fp8(x, residual)
    normed, stream = norm(x, residual)
    return normed, stream, None


class DecoderLayer(Protocol):
    """What the causal LM reads of a family's decoder layer."""

    self_attn: Attention
    mlp: MLP


class CausalLM(nn.Module):
    """A family's model: ``self.model`` holds ``embed_tokens``, ``layers`` and the final ``norm``
    under the checkpoint's names; the family writes ``forward``."""

    model: nn.Module

    def __init__(self, config: PretrainedConfig, *, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, device=device, dtype=dtype)
        # Gemma 2 caps the logits: cap * tanh(logit / cap).
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        # Adapters' parts on embed_tokens / lm_head, per slot; set by the model runner where served.
        self.vocab_adapters: VocabAdapters | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden state (after the last norm) of each token."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``, with the step's vocabulary adapters' parts (serving.engine.
        layers.vocab_lora) on their rows: before any family's scaling, as PEFT applies them."""
        embed = cast(VocabParallelEmbedding, self.model.get_submodule("embed_tokens"))
        hidden: torch.Tensor = embed(input_ids)
        if self.vocab_adapters is not None and get_context().lora is not None:
            self.vocab_adapters.embed(hidden, input_ids)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, *, every_rank: bool = False,
                       row_slots: Sequence[int] | None = None) -> torch.Tensor:
        """The logits of ``hidden``'s rows, on rank 0. ``every_rank``: every rank calls this for the
        same rows (a flat step's sampled rows, known to all), and its shard is gathered to rank 0;
        otherwise rank 0 alone calls it and the others give their share when it asks
        (``TensorParallel.serve_logits``). Ranks 1..N-1 get a tensor nobody reads. ``row_slots``:
        each row's adapter slot (host-side), where a vocabulary adapter's head part may apply."""
        if every_rank:
            logits = self.tp.gather_logits(self.logits_shard(hidden), self.config.vocab_size)
        elif not self.tp.is_driver:
            return hidden.new_empty(hidden.shape[0], 0)
        else:
            logits = self.tp.logits(hidden, self.logits_shard, self.config.vocab_size)
        if row_slots is not None and self.vocab_adapters is not None:
            self.vocab_adapters.logits(logits, hidden, row_slots)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits of ``hidden``."""
        embed = cast(VocabParallelEmbedding, self.model.get_submodule("embed_tokens"))
        weight = embed.weight if self.tie_word_embeddings else self.lm_head.weight
        return hidden @ weight.T

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """The layers, typed (an nn.ModuleList holds plain Modules to the type checker)."""
        return (cast(DecoderLayer, layer) for layer in cast(nn.ModuleList, self.model.get_submodule("layers")))

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def lora_layers(self) -> Iterator[MultiLoRALinear]:
        for layer in self.decoder_layers():
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
            tensor = self._part(name, tensor)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            if name.rpartition(".")[2] in _AWQ_PACKED and tensor.dtype != dest.dtype:
                # Packed words and fp16 scales are taken as they are, never converted.
                raise ValueError(f"AWQ tensor {name!r} is {tensor.dtype}, the layout's is {dest.dtype}")
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
        fused = _fused_target(name)
        if fused is None:
            return params[name]
        target, module, kind = fused
        offset, width = self._fused_layer(target).slice_of(module)
        if kind in _AWQ_PACKED:
            per = _AWQ_PACKED[kind]
            return params[f"{target}.{kind}"][:, offset // per : (offset + width) // per]
        return params[f"{target}.{kind}"][offset : offset + width]

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (all of it at tensor-parallel size 1)."""
        if self.tp.size == 1:
            return tensor
        fused = _fused_target(name)
        if fused is not None:
            target, module, kind = fused
            return self._fused_layer(target).checkpoint(module, kind, tensor)
        owner_name, _, kind = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if isinstance(owner, MultiLoRALinear):
            return owner.checkpoint(owner.slice_names[0], kind, tensor)
        if isinstance(owner, (VocabParallelEmbedding, ParallelLMHead)):
            return owner.checkpoint(tensor)
        return tensor  # norms: every rank holds them whole

    def _fused_layer(self, target: str) -> MultiLoRALinear:
        layer = self.get_submodule(target)
        if not isinstance(layer, MultiLoRALinear):
            raise TypeError(f"{target} is a {type(layer).__name__}, not a fused projection")
        return layer


def _fused_target(name: str) -> tuple[str, str, str] | None:
    """``(fused projection, slice, weight or bias)`` of a checkpoint tensor stored apart (``q_proj``
    ...) that the model holds fused; None for any other."""
    fused = _FUSED_NAME.match(name)
    if not fused:
        return None
    prefix, block, module, kind = fused.groups()
    return f"{prefix}{block}.{'qkv_proj' if block == 'self_attn' else 'gate_up_proj'}", module, kind
