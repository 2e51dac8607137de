"""A per-process cache whose entries expire, bounded by entry count and by (estimated) bytes.

The gateway caches what a key and a `model` resolve to, refusals included, for a fraction of a
second (serving.gateway.catalog). Those keys come from callers, so the cache must not grow with
whatever they send: every `put` first frees the entries that have expired, then the oldest ones
until both bounds hold again. All entries of one cache live the same TTL, so insertion order is
expiry order and the expired ones are always at the front: freeing them costs one look at the
front per `put`, not a scan. An expired entry found by `get` is freed at once as well.

An entry past half its life is due for a refresh (`refresh_due`, true once per entry): the caller
reloads it off the request path while `get` still answers with it, so a key or model used at least
once per half-TTL is never waited for; a refreshed entry lives `ttl_s` from when its load began
(`put(..., loaded_at=)`), so no answer is older than the TTL whichever load produced it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# What one entry costs besides the strings in its key and in a refusal's message: the dict slot,
# the key tuple, the entry and the cached object (a Caller or Target is a few small dataclasses).
ENTRY_OVERHEAD_BYTES = 1024


def approx_bytes(key: Hashable, value: object) -> int:
    """An entry's size as the cache counts it: the overhead plus the characters of the key's
    strings and of an exception's message (a 404 repeats the `model` it was asked)."""
    size = ENTRY_OVERHEAD_BYTES
    parts = key if isinstance(key, tuple) else (key,)
    size += sum(len(part) for part in parts if isinstance(part, str))
    if isinstance(value, BaseException):
        size += len(str(value))
    return size


@dataclass
class _Entry(Generic[T]):
    expires_at: float
    refresh_at: float
    value: T | BaseException
    size: int
    refreshing: bool = False


class TtlCache(Generic[T]):
    """A dict whose entries expire after `ttl_s()` seconds; values may be exceptions (refusals),
    which the caller re-raises on every hit. At most `max_entries` entries and `max_bytes` bytes
    (by `approx_bytes`): past either, the oldest entries go first."""

    def __init__(self, ttl_s: Callable[[], float], *, max_entries: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[Hashable, _Entry[T]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> tuple[bool, T | BaseException | None]:
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if entry.expires_at < self._clock():
            self._drop(key)
            return False, None
        return True, entry.value

    def now(self) -> float:
        """The cache's clock (what `put`'s `loaded_at` is read from)."""
        return self._clock()

    def refresh_due(self, key: Hashable) -> bool:
        """True once for a live entry past half its life: the caller reloads it now (and `put`s it)."""
        entry = self._entries.get(key)
        if entry is None or entry.refreshing or self._clock() < entry.refresh_at:
            return False
        entry.refreshing = True
        return True

    def put(self, key: Hashable, value: T | BaseException, *, loaded_at: float | None = None) -> None:
        """Cache `value` for `ttl_s` from `loaded_at` (when its load began; default now)."""
        if key in self._entries:
            self._drop(key)  # re-inserted at the end, so the front stays the oldest
        now = self._clock()
        ttl, start = self._ttl_s(), now if loaded_at is None else min(now, loaded_at)
        entry = _Entry(expires_at=start + ttl, refresh_at=start + ttl / 2, value=value,
                       size=approx_bytes(key, value))
        self._entries[key] = entry
        self.bytes += entry.size
        self._free(now)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: Hashable) -> None:
        self.bytes -= self._entries.pop(key).size

    def _free(self, now: float) -> None:
        """Expired entries, then the oldest while over a bound (an entry over max_bytes by itself
        is not kept at all)."""
        entries = self._entries
        while entries:
            key, oldest = next(iter(entries.items()))
            if oldest.expires_at >= now and len(entries) <= self.max_entries and self.bytes <= self.max_bytes:
                return
            entries.popitem(last=False)
            self.bytes -= oldest.size
