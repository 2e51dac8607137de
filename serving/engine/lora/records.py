"""The records the adapter cache's parts share: one adapter's content, a request's handle on it,
and a read from storage in flight.

``CachedAdapter`` is one content (one digest) and where it is resident right now; the slot table,
the CPU cache and the model runner read and write its residency fields. ``AdapterHandle`` is what a
request holds from the moment it is queued: it starts out waiting on a first load and is pointed
at its ``CachedAdapter`` when that load finishes, so the sequence and the scheduler see one type for
the whole life of a request, whatever the adapter's state. ``PendingLoad`` is a read the loader
runs for the cache, and ``LoadResult`` what it hands back. They live here, below the loader and the
cache, so that each of those imports the records and neither imports the other's.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from serving.engine.lora.reader import LoadedAdapter, Magnitudes, VocabDelta, Weights


class CopyDone(Protocol):
    """A copy into the GPU pool still in flight (a CUDA event): done once ``query()`` is true."""

    def query(self) -> bool: ...


@dataclass(eq=False)
class CachedAdapter:
    """One adapter's content (one digest) and where it is resident.

    It stays alive while anything holds it: a name (``names``), a request (``handles``) or a
    re-read in flight (``reload``); the cache frees its slot and CPU copy when the last one goes.
    A running sequence pins its slot (``running``) and always holds a handle too.

    ``weights`` is the CPU copy as the GPU pool's rows take it (``A [rank, in]``, ``B`` transposed
    ``[rank, out]``, the model's dtype, pinned on CUDA); ``nbytes`` its size and ``checksum`` the
    sum of its raw bits (slot integrity compares the rows against it). A DoRA adapter's CPU copy
    also holds its ``magnitudes`` (fp32, counted in ``nbytes``, not in ``checksum``: they are not
    pool rows), kept and dropped with ``weights``; ``dora`` says which kind it is even when the copy
    is gone. An adapter on the vocabulary modules likewise holds its ``vocab`` part (LoRA on
    embed_tokens / lm_head, the rows of their copies that differ from the base's; in ``nbytes``, not
    in ``checksum``), which the model runner copies per slot (``layers.vocab_lora``)."""

    digest: str
    path: str
    rank: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: Weights | None
    load_seconds: float
    nbytes: int = 0
    dora: bool = False
    magnitudes: Magnitudes | None = None
    vocab: VocabDelta | None = None
    checksum: int = 0
    names: set[str] = field(default_factory=set)
    slot: int | None = None  # its entry in the kernels' slot table, while resident
    row: int | None = None  # its first row in the GPU pool, while resident
    filling: CopyDone | None = None  # its copy into the pool, while in flight
    fresh: bool = False  # placed for a waiting request that has not been admitted yet
    prefetched: bool = False  # placed by the scheduler's look-ahead, not yet pinned by an admission
    handles: set[AdapterHandle] = field(default_factory=set)  # unfinished requests that use it
    running: int = 0  # running sequences: they pin the slot
    reload: PendingLoad | None = None
    repairing: bool = False  # its slot failed a checksum: the re-read in flight puts it back in one

    @property
    def refs(self) -> int:
        """Unfinished requests that use it."""
        return len(self.handles)

    @property
    def unused(self) -> bool:
        return not self.names and not self.handles and self.running == 0 and self.reload is None


@dataclass(eq=False)
class AdapterHandle:
    """A request's reference to its adapter, stable from queueing to finish.

    ``adapter`` is None while the first load of the request's name is in flight (``load``); the
    cache sets it when that load finishes. ``stalled`` records that the request had to wait for a
    load, so each request counts once in the load-stall counter however many steps it waits."""

    name: str
    adapter: CachedAdapter | None = None
    load: PendingLoad | None = None
    stalled: bool = False


@dataclass(frozen=True)
class LoadResult:
    """A finished read: the validated adapter, its weights ready for the pool's rows (their bytes and
    raw-bit checksum; a DoRA adapter's magnitudes, fp32, and its vocabulary part, in the model's dtype,
    in ``nbytes`` too), and how long it took."""

    loaded: LoadedAdapter
    weights: Weights
    seconds: float
    nbytes: int
    checksum: int
    magnitudes: Magnitudes | None = None
    vocab: VocabDelta | None = None


@dataclass(eq=False)
class PendingLoad:
    """A read from storage in flight (or queued until the CPU cache has room).

    ``reload_of`` is set when this re-reads an adapter whose CPU copy was evicted; ``handles``
    are the requests waiting on a first load (the cache points them at the adapter once loaded);
    ``add_futures`` are ``add_lora`` calls waiting for it (``load_inplace`` each); ``background``
    marks a prefetch's read (the prefetch thread)."""

    name: str
    path: str
    reload_of: CachedAdapter | None = None
    background: bool = False
    future: Future[LoadResult] | None = None
    handles: list[AdapterHandle] = field(default_factory=list)
    add_futures: list[tuple[Future[CachedAdapter], bool]] = field(default_factory=list)
