"""The CPU tier: adapters' weights in host memory, least recently used first, bounded in bytes (and,
if the operator asks, in entries).

An entry's weights are already as the GPU pool's rows take them (pinned on CUDA), so filling rows
from here is one copy per tensor. Which entries may go is the caller's rule (an entry a waiting
request needs to enter the GPU must stay): ``make_room`` evicts, oldest first, only entries its
predicate allows, and evicting an entry drops its weights (``adapter.weights = None``), so a later
use re-reads it. A read in flight reserves ``entry_bytes`` (the most one adapter can take), since
its size is known only once it is in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from serving.engine.lora.reader import Magnitudes, VocabDelta, Weights
from serving.engine.lora.records import CachedAdapter


class CPUCache:
    def __init__(self, *, capacity_bytes: int, entry_bytes: int, max_entries: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CachedAdapter] = OrderedDict()  # digest -> adapter, LRU first
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, adapter: CachedAdapter) -> bool:
        return adapter.digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, adapter: CachedAdapter, weights: Weights, magnitudes: Magnitudes | None = None,
            vocab: VocabDelta | None = None) -> None:
        """Keep ``weights`` (and a DoRA adapter's ``magnitudes``, a vocabulary adapter's ``vocab``) as
        ``adapter``'s CPU copy unless it has one; either way it is now the newest."""
        if adapter.weights is None:
            adapter.weights = weights
            adapter.magnitudes = magnitudes
            adapter.vocab = vocab
            self._entries[adapter.digest] = adapter
            self.nbytes += adapter.nbytes
        self._entries.move_to_end(adapter.digest)

    def touch(self, adapter: CachedAdapter) -> None:
        """Make ``adapter``'s CPU copy the newest (it is about to be used)."""
        self._entries.move_to_end(adapter.digest)

    def demote(self, adapter: CachedAdapter) -> None:
        """Make ``adapter`` the first to go: once it is resident on the GPU, its CPU copy is only a backup."""
        self._entries.move_to_end(adapter.digest, last=False)

    def make_room(self, pending: int, evictable: Callable[[CachedAdapter], bool]) -> bool:
        """Whether one more entry fits beside ``pending`` reads in flight, evicting what may go."""
        while self._full(pending + 1):
            victim = next((a for a in self._entries.values() if evictable(a)), None)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def evict(self, adapter: CachedAdapter) -> None:
        """Drop ``adapter``'s CPU copy to make room (counted as an eviction)."""
        self._drop(adapter)
        self.evictions += 1

    def discard(self, adapter: CachedAdapter) -> None:
        """Drop ``adapter``'s CPU copy because nothing uses the adapter any more (not an eviction)."""
        if adapter.digest in self._entries:
            self._drop(adapter)

    def resident(self) -> list[CachedAdapter]:
        """The cached adapters, least recently used first."""
        return list(self._entries.values())

    def _full(self, incoming: int) -> bool:
        if self.max_entries is not None and len(self._entries) + incoming > self.max_entries:
            return True
        return bool(self._entries) and self.nbytes + incoming * self.entry_bytes > self.capacity_bytes

    def _drop(self, adapter: CachedAdapter) -> None:
        del self._entries[adapter.digest]
        self.nbytes -= adapter.nbytes
        adapter.weights = None
        adapter.magnitudes = None
        adapter.vocab = None
