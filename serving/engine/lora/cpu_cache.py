"""The CPU tier: at most ``capacity`` adapters' weights in host memory, least recently used first.

An entry's weights are already in the model's dtype (pinned on CUDA), so filling a GPU slot from
here is one copy. Which entries may go is the caller's rule (an entry a waiting request needs to
enter a slot must stay): ``make_room`` evicts, oldest first, only entries its predicate allows,
and evicting an entry drops its weights (``adapter.weights = None``), so a later use re-reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from serving.engine.lora.reader import Weights
from serving.engine.lora.records import CachedAdapter


class CPUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, CachedAdapter] = OrderedDict()  # digest -> adapter, LRU first
        self.evictions = 0

    def __contains__(self, adapter: CachedAdapter) -> bool:
        return adapter.digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, adapter: CachedAdapter, weights: Weights) -> None:
        """Keep ``weights`` as ``adapter``'s CPU copy unless it has one; either way it is now the newest."""
        if adapter.weights is None:
            adapter.weights = weights
            self._entries[adapter.digest] = adapter
        self._entries.move_to_end(adapter.digest)

    def touch(self, adapter: CachedAdapter) -> None:
        """Make ``adapter``'s CPU copy the newest (it is about to be used)."""
        self._entries.move_to_end(adapter.digest)

    def demote(self, adapter: CachedAdapter) -> None:
        """Make ``adapter`` the first to go: once it is in a GPU slot, its CPU copy is only a backup."""
        self._entries.move_to_end(adapter.digest, last=False)

    def make_room(self, pending: int, evictable: Callable[[CachedAdapter], bool]) -> bool:
        """Whether one more entry fits beside ``pending`` reads in flight, evicting what may go."""
        while len(self._entries) + pending >= self.capacity:
            victim = next((a for a in self._entries.values() if evictable(a)), None)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def evict(self, adapter: CachedAdapter) -> None:
        """Drop ``adapter``'s CPU copy to make room (counted as an eviction)."""
        del self._entries[adapter.digest]
        adapter.weights = None
        self.evictions += 1

    def discard(self, adapter: CachedAdapter) -> None:
        """Drop ``adapter``'s CPU copy because nothing uses the adapter any more (not an eviction)."""
        self._entries.pop(adapter.digest, None)
        adapter.weights = None

    def resident(self) -> list[CachedAdapter]:
        """The cached adapters, least recently used first."""
        return list(self._entries.values())
