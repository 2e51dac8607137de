"""The boundary between KV blocks and adapter rank rows in the flex region: its one owner
(docs/adapter-memory.md, "Adapters that borrow idle KV memory"; behind
``EngineConfig.borrow_kv_memory``).

The region (serving.engine.lora.flex) holds KV blocks from its low end and rank rows from its high
end; the block manager's capacity and the row pool's floor say where one ends and the other begins,
and only this class moves them, once a step, before the scheduler admits anything:

- **Grow** the adapter side when admissions wait for rows (an adapter found no room, or was placed
  only by evicting another: its requests waited for a copy that a larger pool would have spared)
  and the KV cache has stayed under ``low_watermark`` of its capacity for ``patience`` steps: the
  floor goes down by the rows wanted since the last growth (each waiting adapter's rank,
  ``max_lora_rank`` for an eviction), as far as leaves the KV cache under the watermark, with the
  free blocks the step needs, and above every block a sequence holds.
- **Give back** when the free KV blocks are fewer than the step needs (the running batch's next
  tokens and the waiting prompts the step's token budget could admit): first the rows no adapter
  owns, then the rows of idle adapters (no running sequence, no waiting request) nearest the
  boundary (evicted; their CPU copies stay where the CPU cache holds them, so they come back
  without a read). An adapter a running sequence pins or a waiting request wants, or whose copy is
  in flight, is never evicted: a give-back stops below it and the KV cache waits for finishes, as a
  request waits for its slot today.

Nothing is taken from a running sequence: the capacity never drops under a block one holds, and
the floor never rises over a row a resident adapter owns. Compaction (moving resident adapters up
to free a run at the boundary) is not built: eviction of idle adapters is the give-back's only lever.
"""

from __future__ import annotations

import math
from typing import Protocol

from serving.engine.lora.cache import LoRACache
from serving.engine.lora.flex import FlexRegion


class KVBlocks(Protocol):
    """What the borrower reads and moves of the KV cache's bookkeeping
    (serving.engine.block_manager.BlockManager; the adapter side never imports the engine's core)."""

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...

    def highest_held_from(self, start: int) -> int: ...

    def set_capacity(self, blocks: int) -> None: ...


# KV use under which rows may borrow blocks, as a fraction of the KV capacity, and for how many steps.
LOW_WATERMARK = 0.5
PATIENCE_STEPS = 64


class Borrower:
    def __init__(self, region: FlexRegion, blocks: KVBlocks, cache: LoRACache, *, start_kv_blocks: int,
                 low_watermark: float = LOW_WATERMARK, patience: int = PATIENCE_STEPS) -> None:
        """Set the boundary where the fixed split has it: ``start_kv_blocks`` KV blocks in all."""
        self.region = region
        self.blocks = blocks
        self.cache = cache
        self.low_watermark = low_watermark
        self.patience = patience
        self.kv_blocks = start_kv_blocks - region.base  # region blocks the KV cache has now
        blocks.set_capacity(region.base + self.kv_blocks)
        cache.row_pool.set_floor(region.floor_for(self.kv_blocks))
        self._quiet_steps = 0  # consecutive steps with KV use under the watermark, since the last growth
        self._rows_wanted = 0  # rank rows admissions waited for since the last growth
        self._evictions_seen = cache.placement_evictions
        self.blocks_lent = 0  # totals since start: region blocks moved to rows, and back
        self.blocks_returned = 0

    def step(self, *, rows_wanted: int, kv_blocks_wanted: int) -> None:
        """Move the boundary for the step about to be scheduled. ``rows_wanted``: the rank of the
        largest adapter that found no room last step (0: none did); ``kv_blocks_wanted``: the free
        blocks this step's running sequences and admissions would take.

        Rows are wanted for each adapter that found no room and each that was placed by evicting
        another (``max_lora_rank`` rows: its rank is not told); a growth takes all the rows wanted
        since the last one, at most once per ``patience`` steps (a growth scans the free blocks)."""
        evictions = self.cache.placement_evictions - self._evictions_seen
        self._evictions_seen += evictions
        self._rows_wanted += rows_wanted + evictions * self.cache.max_lora_rank
        free = self.blocks.num_free_blocks
        if free < kv_blocks_wanted:
            self._quiet_steps = self._rows_wanted = 0
            self._give_back(kv_blocks_wanted - free)
            return
        self._quiet_steps = self._quiet_steps + 1 if self.blocks.usage < self.low_watermark else 0
        if self._rows_wanted and self._quiet_steps >= self.patience:
            self._grow(self._rows_wanted, kv_blocks_wanted)
            self._quiet_steps = self._rows_wanted = 0

    def _grow(self, rows: int, kv_blocks_wanted: int) -> None:
        region, pool = self.region, self.cache.row_pool
        target = region.kv_blocks_below(max(0, pool.floor - rows))
        used = self.blocks.num_used_blocks
        # Keep the KV cache under the watermark, with the step's blocks free and every held block.
        least = max(math.ceil(used / self.low_watermark), used + kv_blocks_wanted, 1) - region.base
        target = max(target, least, 0)
        if target >= self.kv_blocks:
            return
        target = max(target, self.blocks.highest_held_from(region.base + target) + 1 - region.base)
        if target >= self.kv_blocks:
            return
        self.blocks.set_capacity(region.base + target)
        pool.set_floor(region.floor_for(target))
        self.blocks_lent += self.kv_blocks - target
        self.kv_blocks = target

    def _give_back(self, deficit: int) -> None:
        region, pool = self.region, self.cache.row_pool
        target = min(region.blocks, self.kv_blocks + deficit)
        floor = region.floor_for(target)
        if pool.lowest_allocated < floor:
            # The unowned rows are not enough: evict the idle adapters in the way and take all the rows
            # that frees (an eviction for one block would repeat a step later), or those below the
            # lowest adapter that must stay.
            target = region.kv_blocks_below(self.cache.evict_below(floor))
        if target <= self.kv_blocks:
            return
        pool.set_floor(region.floor_for(target))
        self.blocks.set_capacity(region.base + target)
        self.blocks_returned += target - self.kv_blocks
        self.kv_blocks = target
