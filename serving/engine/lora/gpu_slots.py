"""The GPU tier: which adapters are resident, in which rows of the adapter row pool, under which slot.

Adapter memory is a pool of rank rows (docs/adapter-memory.md): a resident adapter owns ``rank``
contiguous rows (``RowPool``, best fit) and one entry of the slot table the kernels index (its
scaling, rank and first row). So a rank-8 adapter costs 8 rows where a rank-64 one costs 64, and
how many adapters fit depends on their ranks; the slot table's size (``max_loras``) is only an upper
bound on how many are resident at once.

A running sequence pins its adapter (``CachedAdapter.running``); an adapter nobody pins stays
resident, so the next request for it finds it there. When an adapter needs rows, resident adapters
are evicted in this order until a run of rows fits: idle ones first (no running sequence and no
waiting request), least recently used first, then ones that only waiting requests use; an adapter
that running sequences pin, or whose copy is in flight, is never evicted. Nothing is evicted for a
placement that could not succeed.

Filling rows is a copy the model runner queues (``write``): on CUDA on a copy stream, so running
sequences keep decoding meanwhile, and the copy's event says when the rows may be read; an
adapter whose copy is in flight is ``filling`` and its requests wait (``pin`` answers
``"filling"``). On CPU the copy is done when ``write`` returns. The table only places and counts;
what may be freed is the cache's rule.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Literal

from serving.engine.lora.records import CachedAdapter, CopyDone

# What pinning answers: the slot, "filling" while the adapter's copy is in flight, None for no room.
Grant = int | Literal["filling"] | None

# write(slot, row, adapter): copy the adapter into its rows and table entry; None once done.
WriteRows = Callable[[int, int, CachedAdapter], CopyDone | None]


class RowPool:
    """Free rows as sorted, disjoint runs ``(start, length)``; best fit, neighbours merged on free.

    Rows below ``floor`` are not the pool's (lent to the KV cache: serving.engine.lora.borrow); the
    floor is 0 unless ``set_floor`` moves it."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.floor = 0
        self._runs: list[tuple[int, int]] = [(0, num_rows)] if num_rows else []
        self.free_rows = num_rows

    @property
    def size(self) -> int:
        """Rows the pool holds now: ``floor .. num_rows - 1``."""
        return self.num_rows - self.floor

    @property
    def lowest_allocated(self) -> int:
        """The first row of the lowest allocated run; ``num_rows`` when none is (the floor may rise to it)."""
        if not self._runs or self._runs[0][0] != self.floor:
            return self.floor if self.free_rows < self.size else self.num_rows
        return self.num_rows if self.free_rows == self.size else sum(self._runs[0])

    def set_floor(self, row: int) -> None:
        """Make rows ``row ..`` the pool's. Lowering frees the rows taken in; raising gives away free
        rows and is refused (ValueError, nothing changed) over an allocated run."""
        if not 0 <= row <= self.num_rows:
            raise ValueError(f"the floor must be in 0 .. {self.num_rows}, got {row}")
        if row < self.floor:
            old, self.floor = self.floor, row
            self.free(row, old - row)
        elif row > self.floor:
            if row > self.lowest_allocated:
                raise ValueError(f"cannot raise the row floor to {row}: row {self.lowest_allocated} is allocated")
            start, length = self._runs[0]
            if start + length == row:
                del self._runs[0]
            else:
                self._runs[0] = (row, start + length - row)
            self.free_rows -= row - self.floor
            self.floor = row

    def alloc(self, length: int) -> int | None:
        """The first row of ``length`` contiguous free rows, taken from the smallest run that fits."""
        best = None
        for i, (_, run) in enumerate(self._runs):
            if run >= length and (best is None or run < self._runs[best][1]):
                best = i
                if run == length:
                    break
        if best is None:
            return None
        start, run = self._runs[best]
        if run == length:
            del self._runs[best]
        else:
            self._runs[best] = (start + length, run - length)
        self.free_rows -= length
        return start

    def free(self, start: int, length: int) -> None:
        self.free_rows += length
        i = bisect.bisect_left(self._runs, (start, 0))
        if i > 0 and sum(self._runs[i - 1]) == start:  # merge with the run before
            i -= 1
            start, length = self._runs[i][0], self._runs[i][1] + length
            del self._runs[i]
        if i < len(self._runs) and self._runs[i][0] == start + length:  # and the run after
            length += self._runs[i][1]
            del self._runs[i]
        self._runs.insert(i, (start, length))


class SlotTable:
    def __init__(self, num_slots: int, num_rows: int, write: WriteRows) -> None:
        self._write = write
        self.num_slots = num_slots
        self.rows = RowPool(num_rows)
        self._slots: list[CachedAdapter | None] = [None] * num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._lru: OrderedDict[CachedAdapter, None] = OrderedDict()  # resident adapters, oldest first
        self.loads = 0  # copies into the pool, whatever the reason
        self.evictions = 0
        self.placement_evictions = 0  # those that made room for another adapter (not a give-back's)
        self.hits = 0  # admissions that found their adapter resident
        self.misses = 0  # admissions that had to copy it in first
        self.bytes_loaded = 0  # host-to-device bytes of those copies
        self.prefetch_hits = 0  # admissions whose adapter the scheduler's look-ahead had placed

    @property
    def rows_used(self) -> int:
        return self.rows.size - self.rows.free_rows

    def pin(self, adapter: CachedAdapter) -> Grant:
        """Pin ``adapter``'s slot for one running sequence, placing it first if it is not resident
        (evicting as the module says). ``"filling"`` while its copy is in flight (ask again next
        step); None when it cannot be placed now (pinned and in-flight adapters hold the rows)."""
        if adapter.slot is None:
            if self._place(adapter, self._victims(adapter, idle_only=False)) is None:
                return None
            self.misses += 1
            adapter.fresh = True
        if not self._filled(adapter):
            return "filling"
        if adapter.fresh:
            adapter.fresh = False  # the admission that placed it was counted as the miss
        else:
            self.hits += 1
        if adapter.prefetched:
            adapter.prefetched = False  # the first admission after the look-ahead's copy is its hit
            self.prefetch_hits += 1
        adapter.running += 1
        self._lru.move_to_end(adapter)
        assert adapter.slot is not None
        return adapter.slot

    def unpin(self, adapter: CachedAdapter) -> None:
        """A running sequence of ``adapter`` stopped running (finished or preempted)."""
        adapter.running -= 1

    def place(self, adapter: CachedAdapter, keep: Collection[CachedAdapter] = ()) -> int | None:
        """Make ``adapter`` resident ahead of its requests, unpinned, evicting only idle adapters
        (no running sequence, no waiting request) that are not in ``keep`` (what the same prefetch
        wants resident too). None when that does not make room: a prefetch never evicts an adapter
        in use."""
        if adapter.slot is None:
            victims = [a for a in self._victims(adapter, idle_only=True) if a not in keep]
            if self._place(adapter, victims) is None:
                return None
        self._lru.move_to_end(adapter)
        return adapter.slot

    def free(self, adapter: CachedAdapter) -> None:
        """Release ``adapter``'s rows and slot (nothing uses it any more)."""
        if adapter.slot is None:
            return
        self._release(adapter)

    def evict_below(self, row: int) -> int:
        """Evict the idle adapters (no running sequence, no waiting request, copy landed) whose rows
        start below ``row`` (a give-back of rows to the KV cache: serving.engine.lora.borrow);
        returns the lowest row still allocated (``num_rows`` for none). Only those below the lowest
        adapter that must stay go: evicting one above it would free no run at the floor."""
        kept = [a.row for a in self._lru if a.row is not None and (a.refs or a.running or not self._filled(a))]
        row = min([row, *kept])
        for adapter in [a for a in self._lru if a.row is not None and a.row < row]:
            self._release(adapter)
            self.evictions += 1
        return self.rows.lowest_allocated

    def slots(self) -> list[CachedAdapter | None]:
        return list(self._slots)

    def landed(self) -> list[CachedAdapter]:
        """Resident adapters whose copy in has landed (what a checksum may be compared against)."""
        return [a for a in self._slots if a is not None and self._filled(a)]

    def _filled(self, adapter: CachedAdapter) -> bool:
        if adapter.filling is not None and adapter.filling.query():
            adapter.filling = None
        return adapter.filling is None

    def _victims(self, adapter: CachedAdapter, *, idle_only: bool) -> list[CachedAdapter]:
        """Resident adapters that may make room for ``adapter``, in eviction order."""
        free = [a for a in self._lru if a is not adapter and a.running == 0 and self._filled(a)]
        idle = [a for a in free if a.refs == 0]
        return idle if idle_only else idle + [a for a in free if a.refs > 0]

    def _place(self, adapter: CachedAdapter, victims: list[CachedAdapter]) -> int | None:
        """Give ``adapter`` a slot and ``rank`` rows, evicting from ``victims`` in order, and start
        its copy; None (nothing evicted) when even evicting them all would not do."""
        need = adapter.rank
        if len(self._free_slots) + len(victims) == 0 or self.rows.free_rows + sum(v.rank for v in victims) < need:
            return None
        while True:
            if self._free_slots:
                row = self.rows.alloc(need)
                if row is not None:
                    break
            if not victims:
                return None  # enough rows in total, but no run long enough: fragmented
            self._release(victims.pop(0))
            self.evictions += 1
            self.placement_evictions += 1
        slot = self._free_slots.pop()
        assert adapter.weights is not None, "rows are filled from the adapter's CPU copy"
        adapter.slot, adapter.row = slot, row
        self._slots[slot] = adapter
        self._lru[adapter] = None
        adapter.filling = self._write(slot, row, adapter)
        self.loads += 1
        self.bytes_loaded += adapter.nbytes
        return slot

    def _release(self, adapter: CachedAdapter) -> None:
        assert adapter.slot is not None and adapter.row is not None
        self.rows.free(adapter.row, adapter.rank)
        self._slots[adapter.slot] = None
        self._free_slots.append(adapter.slot)
        self._lru.pop(adapter, None)
        adapter.slot = adapter.row = None
        adapter.fresh = adapter.prefetched = False
