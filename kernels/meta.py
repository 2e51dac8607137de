"""Per-step multi-LoRA metadata: tokens grouped by adapter slot, built once, read by every layer.

A decode or prefill step carries one adapter slot per token (``-1``: base model only). Every LoRA
layer of the step needs the same grouping (which tokens belong to which slot, in which order), so
it is computed once per step by :meth:`LoRAMeta.prepare` and reused by all layers, as vLLM's LoRA
kernels do.

All buffers are allocated once at construction with fixed sizes (``max_num_tokens``,
``max_slots``) and updated in place with device ops only, so on CUDA neither ``prepare`` nor the
kernels that read it synchronise with the host, and a whole step (``prepare`` included) can be
captured in a CUDA graph and replayed after new slots are copied into the captured input.
"""

from __future__ import annotations

from typing import TypedDict

import torch

# Row-block sizes the kernels may tile tokens with. A tile table is precomputed for each so that a
# kernel launch needs no host knowledge of how many tokens each slot has.
TILE_BLOCK_SIZES: tuple[int, ...] = (16, 64)


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on the number of (slot, row block) tiles of ``num_tokens`` tokens.

    Each active slot with ``c`` tokens needs ``ceil(c / block_m)`` tiles, which is at most
    ``c / block_m + 1``; summed over at most ``min(num_tokens, num_slots)`` active slots this is
    bounded by ``ceil(num_tokens / block_m) + min(num_tokens, num_slots)``.
    """
    if num_tokens == 0:
        return 0
    return -(-num_tokens // block_m) + min(num_tokens, num_slots)


class _Int32On(TypedDict):
    """Factory keywords of the int32 buffers, on the metadata's device."""

    dtype: torch.dtype
    device: torch.device


class LoRAMeta:
    """Tokens of one step grouped by adapter slot, in preallocated fixed-size buffers.

    After ``prepare(token_slots)`` with ``T = token_slots.numel()`` tokens:

    - ``token_slots[:T]``: a copy of the step's slots, in batch order.
    - ``token_indices[:T]``: token ids sorted by slot, stable (tokens of one slot keep their
      order); tokens without an adapter (slot ``-1``) come first. Row ``p`` of this order is the
      token's *sorted position*.
    - ``slot_counts[s]``: number of tokens with slot ``s``.
    - ``slot_starts[s]``: sorted position of slot ``s``'s first token.
    - ``active_slots``: the slots with at least one token, ascending, padded with ``-1``;
      ``num_active`` (a 0-d device tensor) counts them.
    - ``tiles(block_m)``: ``(tile_slot, tile_start, tile_end)``, one entry per block of at most
      ``block_m`` consecutive sorted positions of one active slot, padded with slot ``-1``; a
      kernel launches ``grid_tiles(block_m)`` programs over it.

    ``num_tokens`` is a host int (the shape of ``token_slots``), fixed for a captured graph.
    """

    def __init__(self, max_num_tokens: int, max_slots: int, device: torch.device | str | None = None):
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_num_tokens = max_num_tokens
        self.max_slots = max_slots
        self.num_tokens = 0
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        # The buffers' own device is fully qualified ("cuda:0", not "cuda"), so comparisons hold.
        self.device = self.token_slots.device
        i32 = _Int32On(dtype=torch.int32, device=self.device)
        self.token_indices = torch.zeros(max_num_tokens, **i32)
        self.slot_counts = torch.zeros(max_slots, **i32)
        self.slot_starts = torch.zeros(max_slots, **i32)
        self.active_slots = torch.full((max_slots,), -1, **i32)
        self.num_active = torch.zeros((), **i32)
        self._tiles = {
            bm: (
                torch.full((max_tiles(max_num_tokens, max_slots, bm),), -1, **i32),
                torch.zeros(max_tiles(max_num_tokens, max_slots, bm), **i32),
                torch.zeros(max_tiles(max_num_tokens, max_slots, bm), **i32),
            )
            for bm in TILE_BLOCK_SIZES
        }
        # Constant slot ids, built once rather than on every step.
        self._slot_ids = torch.arange(max_slots, dtype=torch.int64, device=self.device)
        self._host_groups: list[tuple[int, int, int]] | None = []
        # Host-side data that consumers derive from one step's grouping (the torch reference's gather
        # plans), kept for the step's other layers; ``prepare`` empties it.
        self.host_cache: dict[object, object] = {}
        self._tiles_stale = False

    @classmethod
    def build(cls, token_slots: torch.Tensor, max_slots: int) -> LoRAMeta:
        """A metadata object sized exactly for ``token_slots`` (tests, one-off calls)."""
        meta = cls(max(1, token_slots.numel()), max_slots, token_slots.device)
        return meta.prepare(token_slots)

    def prepare(self, token_slots: torch.Tensor) -> LoRAMeta:
        """Regroup the buffers for a new step's ``token_slots`` (int tensor ``[T]``, values in
        ``[-1, max_slots)``), in place and without a host synchronisation on CUDA."""
        self._check_slots(token_slots)
        num_tokens = token_slots.numel()
        self.num_tokens = num_tokens
        self._host_groups = None
        self.host_cache = {}
        slots = token_slots.to(torch.int64)
        self.token_slots[:num_tokens].copy_(slots)

        # Stable sort keeps each slot's tokens in batch order; -1 sorts first.
        sorted_slots, order = torch.sort(slots, stable=True)
        self.token_indices[:num_tokens].copy_(order)

        counts = torch.zeros(self.max_slots + 1, dtype=torch.int64, device=self.device)
        counts.scatter_add_(0, slots + 1, torch.ones_like(slots))
        ends = torch.cumsum(counts, 0)
        slot_counts = counts[1:]
        slot_starts = ends[:-1]
        self.slot_counts.copy_(slot_counts)
        self.slot_starts.copy_(slot_starts)

        # Compact the active slots to the front, ascending: inactive ones get keys past max_slots.
        active = slot_counts > 0
        keys = torch.where(active, self._slot_ids, self._slot_ids + self.max_slots)
        keys = torch.sort(keys).values
        active_slots = torch.where(keys < self.max_slots, keys, torch.full_like(keys, -1))
        self.active_slots.copy_(active_slots)
        self.num_active.copy_(torch.count_nonzero(active))

        # On CUDA the tile tables are built here, inside whatever a graph captures with prepare(), so
        # a replay rebuilds them. On CPU only Triton's interpreter reads them (the torch reference
        # does not): build them on first use, sparing the CPU engine's step a dozen small ops.
        self._tiles_stale = True
        if self.device.type != "cpu":
            self._fill_tiles()
        return self

    def _fill_tiles(self) -> None:
        """Enumerate (slot, row block) tiles of the active slots in order, for every block size."""
        self._tiles_stale = False
        active_slots = self.active_slots.long()
        slot_counts = self.slot_counts.long()
        slot_starts = self.slot_starts.long()
        for block_m, (tile_slot, tile_start, tile_end) in self._tiles.items():
            self._fill_block_tiles(block_m, active_slots, slot_counts, slot_starts, tile_slot, tile_start, tile_end)

    def _fill_block_tiles(
        self,
        block_m: int,
        active_slots: torch.Tensor,
        slot_counts: torch.Tensor,
        slot_starts: torch.Tensor,
        tile_slot: torch.Tensor,
        tile_start: torch.Tensor,
        tile_end: torch.Tensor,
    ) -> None:
        n = max_tiles(self.num_tokens, self.max_slots, block_m)
        if n == 0:
            return
        is_active = active_slots >= 0
        safe = active_slots.clamp(min=0)
        counts = torch.where(is_active, slot_counts[safe], torch.zeros_like(safe))
        starts = slot_starts[safe]
        tiles_per_slot = (counts + block_m - 1) // block_m
        tiles_end = torch.cumsum(tiles_per_slot, 0)
        tile_ids = torch.arange(n, dtype=torch.int64, device=self.device)
        owner = torch.searchsorted(tiles_end, tile_ids, right=True)
        valid = owner < self.max_slots
        owner = owner.clamp(max=self.max_slots - 1)
        first_tile = tiles_end[owner] - tiles_per_slot[owner]
        start = starts[owner] + (tile_ids - first_tile) * block_m
        end = torch.minimum(start + block_m, starts[owner] + counts[owner])
        tile_slot[:n].copy_(torch.where(valid, active_slots[owner], torch.full_like(owner, -1)))
        tile_start[:n].copy_(torch.where(valid, start, torch.zeros_like(start)))
        tile_end[:n].copy_(torch.where(valid, end, torch.zeros_like(end)))

    def _check_slots(self, token_slots: torch.Tensor) -> None:
        if token_slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
        if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool or token_slots.is_complex():
            raise TypeError(f"token_slots must be an integer tensor, got {token_slots.dtype}")
        if token_slots.numel() > self.max_num_tokens:
            raise ValueError(
                f"{token_slots.numel()} tokens exceed this metadata's max_num_tokens={self.max_num_tokens}"
            )
        if token_slots.device != self.device:
            raise ValueError(f"token_slots is on {token_slots.device}, the metadata on {self.device}")
        if token_slots.numel() == 0:
            return
        if self.device.type == "cpu":
            low, high = int(token_slots.min()), int(token_slots.max())
            if low < -1 or high >= self.max_slots:
                raise ValueError(
                    f"token_slots must lie in [-1, {self.max_slots}), got values from {low} to {high}"
                )
        else:
            # A host check would synchronise (and break graph capture): assert on the device.
            in_range = ((token_slots >= -1) & (token_slots < self.max_slots)).all()
            torch._assert_async(in_range, f"token_slots must lie in [-1, {self.max_slots})")

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tile_slot, tile_start, tile_end)`` for row blocks of ``block_m`` sorted positions."""
        if block_m not in self._tiles:
            raise ValueError(f"block_m must be one of {TILE_BLOCK_SIZES}, got {block_m}")
        if self._tiles_stale:
            self._fill_tiles()
        return self._tiles[block_m]

    def grid_tiles(self, block_m: int) -> int:
        """Number of tile programs a kernel launches for the current step (host int)."""
        return max_tiles(self.num_tokens, self.max_slots, block_m)

    def host_groups(self) -> list[tuple[int, int, int]]:
        """``[(slot, start, end), ...]`` of active slots in sorted positions, on the host.

        Used by the torch reference; on CUDA this synchronises (never call it in a captured step).
        """
        if self._host_groups is None:
            counts = self.slot_counts.tolist()
            starts = self.slot_starts.tolist()
            self._host_groups = [(s, starts[s], starts[s] + c) for s, c in enumerate(counts) if c > 0]
        return self._host_groups
