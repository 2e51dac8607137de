"""Attention over packed rows sequence by sequence, instead of through a dense block-diagonal mask.

With packing (training.packing), transformers' SDPA path derives a (rows, 1, width, width) mask
from the restarting position ids and hands it to `scaled_dot_product_attention`. With a mask,
SDPA cannot use its flash kernel: every row computes the whole width × width score matrix, four
times the work of four sequences of a quarter of the width each, on a slower kernel. This
implementation reads the sequences' bounds instead (`cu_seq_lens_q`, the cumulative lengths that
training.packing passes with packed rows, the name transformers' flash-attention path uses) and
attends within each sequence only, causally:
- on CUDA through PyTorch's variable-length flash kernel (`torch.nn.attention.varlen.varlen_attn`),
  one launch for all the sequences of the micro-batch;
- elsewhere (the CPU, or a PyTorch without that kernel) one causal SDPA call per sequence.

Rows without bounds (padded, unpacked rows; evaluation) and anything this path does not cover
(attention dropout, logit soft-capping, sliding windows) go to transformers' own SDPA function with
its mask, which is why the mask function registered under this name is SDPA's. The trainer turns
it on only for a base that runs SDPA (`use_packed_attention`): a model on eager attention (Gemma 2's
soft-capping) keeps it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import functional
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "loraplex_packed"


def _flash_varlen() -> Any | None:
    """PyTorch's variable-length flash attention, where this version has it (2.9 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN = _flash_varlen()
# Its keywords moved between versions: causality is `is_causal` in the first ones and a
# (left, right) window in later ones; grouped-query heads came later still.
_VARLEN_PARAMETERS = frozenset(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else frozenset()


def _causal_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
                   longest: int, scale: float | None) -> torch.Tensor:
    """Causal attention within each [bounds[i], bounds[i + 1]) token range; (tokens, heads, dim) in and out."""
    groups = query.shape[1] // key.shape[1]
    if _VARLEN is not None and query.is_cuda:
        options: dict[str, Any] = {"scale": scale}
        if "is_causal" in _VARLEN_PARAMETERS:
            options["is_causal"] = True
        else:
            options["window_size"] = (-1, 0)
        if groups > 1:
            if "enable_gqa" in _VARLEN_PARAMETERS:
                options["enable_gqa"] = True
            else:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        bounds = bounds.to(torch.int32)
        return _VARLEN(query, key, value, bounds, bounds, longest, longest, **options)
    edges = bounds.tolist()
    parts = [
        functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), key[start:end].transpose(0, 1), value[start:end].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=groups > 1).transpose(0, 1)
        for start, end in zip(edges, edges[1:])
    ]
    return torch.cat(parts)


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (rows, heads, width, dim) in, (rows, width, heads, dim) out."""
    bounds = kwargs.get("cu_seq_lens_q")
    covered = not dropout and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
    if bounds is None or not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, width, dim = query.shape
    out = _causal_varlen(query.transpose(1, 2).reshape(rows * width, heads, dim),
                         key.transpose(1, 2).reshape(rows * width, key.shape[1], dim),
                         value.transpose(1, 2).reshape(rows * width, value.shape[1], dim),
                         bounds, int(kwargs["max_length_q"]), scaling)
    return out.view(rows, width, heads, dim), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def use_packed_attention(model: Any) -> Iterator[bool]:
    """Runs `model` (a transformers model) on this implementation while inside, where it ran SDPA;
    yields whether it switched."""
    previous = model.config._attn_implementation
    if previous != "sdpa":
        yield False
        return
    model.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield True
    finally:
        model.set_attn_implementation(previous)
