"""The flex region: the adapter row pools laid out inside the KV cache's own tensor, so that KV
blocks and rank rows share one budget (docs/adapter-memory.md, "Adapters that borrow idle KV
memory"; behind ``EngineConfig.borrow_kv_memory``).

The KV cache is one tensor ``[2, layers, blocks, block, kv_heads, head_dim]``; for a fixed (K or V,
layer) its blocks are one contiguous run of elements. The last ``blocks`` blocks of every such run
(before the graphs' scratch page) are the layer's flex region. A layer's rank row ``r`` is one
contiguous run of its row's elements in each of its two regions: every slice's A row, module after
module, in the K region (``a_elements``), and every slice's Bt row in the V region
(``b_elements``). The rows are packed against the region's top on both sides (the two sides'
rows differ in width, so each side's last row ends at the region's end): a slice's pool is a
strided view, ``region[top - rows * width_s :].view(rows, width_s)[:, offset : offset + width]``,
with unit stride along a row, which is all the pooled kernels ask of a pool; the views never move,
so CUDA graphs capture them.

KV blocks are handed out from the region's low end and rank rows from its high end: with KV blocks
``0 .. kv - 1`` of the region in use as KV, rows ``floor_for(kv) ..`` are free of them on both
sides, and rows ``floor ..`` leave ``kv_blocks_below(floor)`` whole blocks. This module is that
arithmetic and the views; serving.engine.lora.borrow moves the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch


class LoRALayer(Protocol):
    """What the layout reads of a LoRA layer (serving.engine.layers.lora_linear.MultiLoRALinear; the
    adapter side never imports the engine's layers)."""

    @property
    def layer_idx(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def slice_widths(self) -> Sequence[int]: ...


Layer = TypeVar("Layer", bound=LoRALayer)


@dataclass(frozen=True)
class FlexRegion:
    base: int  # the region's first block (blocks 0 .. base - 1 are always KV)
    blocks: int  # blocks in the region
    block_elements: int  # one block of one (K or V, layer) range
    a_elements: int  # one rank row's A side of one layer (K range)
    b_elements: int  # one rank row's Bt side of one layer (V range)

    @property
    def elements(self) -> int:
        """One (K or V, layer) range's elements in the region."""
        return self.blocks * self.block_elements

    @property
    def rows(self) -> int:
        """Rank rows the region holds when no block of it is KV."""
        return self.elements // max(self.a_elements, self.b_elements)

    def start(self, side: int) -> int:
        """Where row 0 begins in the region of ``side`` (0: K, A rows; 1: V, Bt rows), in elements."""
        return self.elements - self.rows * (self.a_elements, self.b_elements)[side]

    def floor_for(self, kv_blocks: int) -> int:
        """The lowest row that no element of the region's first ``kv_blocks`` blocks overlaps on either side."""
        room = self.elements - kv_blocks * self.block_elements
        return self.rows - max(0, room) // max(self.a_elements, self.b_elements)

    def kv_blocks_below(self, floor: int) -> int:
        """Whole region blocks below row ``floor`` on both sides (what the KV cache may use)."""
        taken = (self.rows - floor) * max(self.a_elements, self.b_elements)
        return (self.elements - taken) // self.block_elements

    @staticmethod
    def blocks_for_rows(rows: int, block_elements: int, a_elements: int, b_elements: int) -> int:
        """Blocks a region needs to hold ``rows`` rank rows."""
        return -(-rows * max(a_elements, b_elements) // block_elements)


def row_elements(layers: Iterable[LoRALayer]) -> tuple[int, int]:
    """One rank row's A and Bt elements in the widest layer (every layer's rows share one stride)."""
    a: dict[int, int] = {}
    b: dict[int, int] = {}
    for layer in layers:
        a[layer.layer_idx] = a.get(layer.layer_idx, 0) + len(layer.slice_widths) * layer.in_features
        b[layer.layer_idx] = b.get(layer.layer_idx, 0) + sum(layer.slice_widths)
    return max(a.values()), max(b.values())


def pool_views(kv_cache: torch.Tensor, region: FlexRegion,
               layers: Iterable[Layer]) -> dict[Layer, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each layer's A and Bt pools (one per slice, ``[region.rows, width]``) as views of its regions."""
    rows, end = region.rows, region.base + region.blocks
    offsets: dict[int, tuple[int, int]] = {}
    views: dict[Layer, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for layer in layers:
        index = layer.layer_idx
        k_rows = kv_cache[0, index, region.base:end].view(-1)[region.start(0):].view(rows, region.a_elements)
        v_rows = kv_cache[1, index, region.base:end].view(-1)[region.start(1):].view(rows, region.b_elements)
        a_at, b_at = offsets.get(index, (0, 0))
        As, Bs = [], []
        for width in layer.slice_widths:
            As.append(k_rows[:, a_at : a_at + layer.in_features])
            Bs.append(v_rows[:, b_at : b_at + width])
            a_at += layer.in_features
            b_at += width
        offsets[index] = (a_at, b_at)
        views[layer] = (As, Bs)
    return views
