"""The GPU tier: which adapter sits in each of the ``max_loras`` preallocated slots.

A running sequence pins its adapter's slot (``CachedAdapter.running``); a slot nobody pins keeps its
adapter resident, so the next request for it finds it there, and is reused least-recently-used
when another adapter needs a slot. Filling a slot is a copy (``write``, the model runner's), never
an allocation. The table only places and counts; what may be freed is the cache's rule.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from serving.engine.lora.records import CachedAdapter


class SlotTable:
    def __init__(self, num_slots: int, write: Callable[[int, CachedAdapter], None]) -> None:
        self._write = write
        self._slots: list[CachedAdapter | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # oldest first
        self.loads = 0  # copies into a slot, whatever the reason
        self.evictions = 0
        self.hits = 0  # admissions that found their adapter in a slot
        self.misses = 0  # admissions that had to copy it in first

    def pin(self, adapter: CachedAdapter) -> int | None:
        """Pin a slot holding ``adapter`` for one running sequence, filling one if it has none;
        None when every slot is pinned."""
        slot = adapter.slot
        if slot is None:
            slot = self._free_slot(lambda a: a.running == 0)
            if slot is None:
                return None
            self._fill(slot, adapter)
            self.misses += 1
        else:
            self.hits += 1
        adapter.running += 1
        self._lru.move_to_end(slot)
        return slot

    def unpin(self, adapter: CachedAdapter) -> None:
        """A running sequence of ``adapter`` stopped running (finished or preempted)."""
        adapter.running -= 1

    def place(self, adapter: CachedAdapter, keep: Collection[CachedAdapter] = ()) -> int | None:
        """Put ``adapter`` in a slot ahead of its requests, unpinned: an empty slot, else the least
        recently used one whose adapter is idle (no running sequence, no request waiting for it)
        and not in ``keep`` (what the same prefetch wants in a slot too: one predicted adapter must
        not push out another). None when there is no such slot: a prefetch never takes a pinned
        or busy slot."""
        slot = adapter.slot
        if slot is None:
            slot = self._free_slot(lambda a: a.running == 0 and a.refs == 0 and a not in keep)
            if slot is None:
                return None
            self._fill(slot, adapter)
        self._lru.move_to_end(slot)
        return slot

    def free(self, adapter: CachedAdapter) -> None:
        """Empty ``adapter``'s slot (nothing uses it any more); the slot is the first to be reused."""
        if adapter.slot is None:
            return
        self._slots[adapter.slot] = None
        self._lru.move_to_end(adapter.slot, last=False)
        adapter.slot = None

    def slots(self) -> list[CachedAdapter | None]:
        return list(self._slots)

    def _free_slot(self, reusable: Callable[[CachedAdapter], bool]) -> int | None:
        """An empty slot, else the least recently used one whose adapter is ``reusable``."""
        slot = next((s for s in self._lru if self._slots[s] is None), None)
        if slot is None:
            slot = next((s for s, a in ((s, self._slots[s]) for s in self._lru) if a is not None and reusable(a)), None)
        return slot

    def _fill(self, slot: int, adapter: CachedAdapter) -> None:
        evicted = self._slots[slot]
        if evicted is not None:
            evicted.slot = None
            self.evictions += 1
        assert adapter.weights is not None, "a slot is filled from the adapter's CPU copy"
        self._write(slot, adapter)
        self._slots[slot] = adapter
        adapter.slot = slot
        self.loads += 1
