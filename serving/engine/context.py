"""The per-step context: built once by the model runner before a forward, read by the layers.

Attention reads where each token's keys and values go in the paged cache and which blocks each
sequence's context sits in; LoRA layers read the step's adapter metadata (each token's slot,
grouped once for all layers). Tokens are ordered decodes first (one per sequence), then each
prefill chunk in turn. ``attention`` names the backend decode tokens attend with (``"triton"``:
the paged kernel, reading ``decode_splits`` programs per sequence and KV head; ``"torch"``: a page
gather and SDPA).

A step may also be *flat*: every token, a prompt chunk's too, is a decode row at its own position
(``decode_context_lens`` = position + 1, the chunk's keys already written to the cache), with
``decode_row_seq`` naming each row's sequence in the per-sequence ``decode_block_tables``; there
are no ``prefills`` then, and one attention call serves decodes and chunks alike (what a CUDA
graph of a mixed step captures). The context is thread-local: an engine's forward runs on one thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kernels import LoRAMeta


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens: ``length`` tokens at ``start`` in the batch, after
    ``num_computed`` tokens already in the cache (``block_table`` covers them all; None when there
    are none, a first chunk attending to its own keys only)."""

    start: int
    length: int
    num_computed: int
    block_table: torch.Tensor | None


@dataclass
class StepContext:
    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_row_seq: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    lora: LoRAMeta | None = None
    attention: str = "torch"
    decode_splits: int = 1
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, context_len: int, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, 1, L]`` keys each decode token sees; built by the first layer, reused by the rest."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            assert self.decode_context_lens is not None
            positions = torch.arange(context_len, device=self.decode_context_lens.device).unsqueeze(0)
            lens = self.decode_context_lens.unsqueeze(1)
            mask = positions < lens
            if sliding_window is not None:
                mask &= positions >= lens - sliding_window
            mask = self._decode_masks[sliding_window] = mask[:, None, None, :]
        return mask


_local = threading.local()


def set_context(context: StepContext) -> None:
    _local.context = context


def get_context() -> StepContext:
    context: StepContext | None = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no step context is set: layers run only inside ModelRunner.execute")
    return context


def reset_context() -> None:
    _local.context = None
