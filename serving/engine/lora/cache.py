"""Where each adapter lives — a GPU slot, the CPU cache, or only in storage — and moving it up.

Three tiers, as S-LoRA and vLLM have them, each a part of its own:

- The GPU pool of adapter rows (``gpu_slots.SlotTable``): a resident adapter owns ``rank`` rows
  of every LoRA layer and an entry of the kernels' slot table. It is pinned while any running
  sequence uses it; unpinned ones stay resident and are evicted (idle ones first, least recently
  used first) when another adapter needs rows. On CUDA the copy in runs on a copy stream while the
  batch decodes; its requests are admitted once it has landed.
- A CPU cache bounded in bytes (``cpu_cache.CPUCache``). An entry must stay while a waiting
  request needs it to enter the GPU; loads that would overflow the cache wait for room.
- Storage, read by ``loader.AdapterLoader`` on loader threads, off the decode path. Requests
  for an adapter being loaded wait; everything else keeps running.

This module is what ties them together: it binds names to contents, hands each request a stable
``AdapterHandle``, decides what may be evicted, and frees an adapter when its last holder (a name,
a request, a re-read in flight) lets go. Adapters are keyed by content digest: a name only points
at a digest, so re-publishing a name (``load_inplace``) can never serve old weights to a new
request, and two names with the same content share one copy. Every method runs on the engine's
thread; loader threads only read storage and hand back a future.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import torch

from serving.engine.lora.cpu_cache import CPUCache
from serving.engine.lora.gpu_slots import Grant, RowPool, SlotTable, WriteRows
from serving.engine.lora.loader import AdapterLoader
from serving.engine.lora.reader import MAX_CHANGED_ROWS_DIVISOR, AdapterError, BaseShapes, LoadedAdapter
from serving.engine.lora.records import AdapterHandle, CachedAdapter, LoadResult, PendingLoad
from serving.engine.lora.request import LoRARequest


class AdapterNotFoundError(AdapterError):
    """The name is not a loaded adapter."""


# Where a prefetched adapter ended: in a GPU slot, or in the CPU cache only.
Placement = Literal["gpu", "cpu"]

# Why a cache built without word of the vocabulary modules refuses adapters on them.
NO_VOCAB = "this engine was not set up to serve them"


def max_vocab_bytes(shapes: BaseShapes, max_lora_rank: int, dtype: torch.dtype) -> int:
    """The most an adapter's vocabulary part can take (``reader.VocabDelta``, in ``dtype``): LoRA of
    ``max_lora_rank`` on embed_tokens and on lm_head (``r x (vocab + hidden)`` each) and, of each of
    their copies, the changed rows the reader lets through (``vocab // MAX_CHANGED_ROWS_DIVISOR``
    rows of ``hidden``, each with its int64 token id)."""
    vocab, hidden = shapes.vocab_size, shapes.hidden_size
    rows = vocab // MAX_CHANGED_ROWS_DIVISOR
    return 2 * (max_lora_rank * (vocab + hidden) + rows * hidden) * dtype.itemsize + 2 * rows * 8


@dataclass(frozen=True)
class LoRACacheStats:
    """Totals since start."""

    loads: int
    load_failures: int
    load_seconds_total: float
    last_load_seconds: float
    slot_loads: int
    slot_evictions: int
    cpu_evictions: int
    slot_hits: int  # admissions that found their adapter resident on the GPU
    slot_misses: int  # admissions that had to copy their adapter in first
    bytes_loaded: int  # host-to-device bytes of those copies
    rows_used: int  # GPU pool rows resident adapters own
    cpu_bytes: int  # bytes of the CPU cache's entries
    load_stalls: int  # requests that waited for their adapter to be read from storage
    slot_repairs: int  # slots rewritten from storage after failing their checksum
    prefetches: int  # copies into the GPU pool and reads from storage the scheduler's look-ahead started
    prefetch_hits: int  # admissions whose adapter the look-ahead's copy had put in the GPU pool


class LoRACache:
    def __init__(
        self,
        *,
        num_slots: int,
        num_rows: int,
        cpu_cache_bytes: int,
        max_cpu_loras: int | None,
        row_bytes: int,
        max_lora_rank: int,
        base_config: object,
        base_model_name: str | None,
        dtype: torch.dtype,
        pin_memory: bool,
        write_rows: WriteRows,
        on_load_done: Callable[[], None],
        dora_refusal: str | None = None,
        vocab_refusal: str | None = NO_VOCAB,
        base_vocab: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        """``dora_refusal``: why this engine refuses DoRA adapters (their loads fail saying so); None serves
        them. ``vocab_refusal`` likewise for adapters on embed_tokens / lm_head, which ``base_vocab``
        (the base's matrix of either, by name) lets the reader compare full copies with."""
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.max_lora_rank = max_lora_rank
        self._names: dict[str, CachedAdapter] = {}
        self._by_digest: dict[str, CachedAdapter] = {}
        self._slots = SlotTable(num_slots, num_rows, write_rows)
        # The most one adapter can take: its rows at the largest rank and, served unless refused, a DoRA
        # adapter's fp32 magnitudes (one value per output feature of every module).
        shapes = BaseShapes.from_config(base_config)
        magnitude_bytes = 0 if dora_refusal is not None else (
            4 * shapes.num_layers * sum(out for _, out in shapes.modules.values()))
        vocab_bytes = 0 if vocab_refusal is not None else max_vocab_bytes(shapes, max_lora_rank, dtype)
        self._cpu = CPUCache(capacity_bytes=cpu_cache_bytes,
                             entry_bytes=max_lora_rank * row_bytes + magnitude_bytes + vocab_bytes,
                             max_entries=max_cpu_loras)
        self._loader = AdapterLoader(
            base_config=base_config,
            base_model_name=base_model_name,
            max_lora_rank=max_lora_rank,
            dtype=dtype,
            pin_memory=pin_memory,
            on_done=on_load_done,
            dora_refusal=dora_refusal,
            vocab_refusal=vocab_refusal,
            base_vocab=base_vocab,
        )
        self._loads = 0
        self._load_failures = 0
        self._load_seconds_total = 0.0
        self._last_load_seconds = 0.0
        self._load_stalls = 0
        self._slot_repairs = 0
        self._prefetches = 0

    @property
    def load_fn(self) -> Callable[..., LoadedAdapter]:
        """What reads an adapter from storage (on a loader thread); tests replace it."""
        return self._loader.load_fn

    @load_fn.setter
    def load_fn(self, fn: Callable[..., LoadedAdapter]) -> None:
        self._loader.load_fn = fn

    @property
    def stats(self) -> LoRACacheStats:
        return LoRACacheStats(
            loads=self._loads,
            load_failures=self._load_failures,
            load_seconds_total=self._load_seconds_total,
            last_load_seconds=self._last_load_seconds,
            slot_loads=self._slots.loads,
            slot_evictions=self._slots.evictions,
            cpu_evictions=self._cpu.evictions,
            slot_hits=self._slots.hits,
            slot_misses=self._slots.misses,
            bytes_loaded=self._slots.bytes_loaded,
            rows_used=self._slots.rows_used,
            cpu_bytes=self._cpu.nbytes,
            load_stalls=self._load_stalls,
            slot_repairs=self._slot_repairs,
            prefetches=self._prefetches,
            prefetch_hits=self._slots.prefetch_hits,
        )

    # ---- requests -------------------------------------------------------------------------

    def resolve(self, request: LoRARequest) -> AdapterHandle:
        """The handle a new request runs with, starting the adapter's load if needed."""
        adapter = self._names.get(request.lora_name)
        if adapter is not None:
            if request.lora_path is not None and request.lora_path != adapter.path:
                raise AdapterError(
                    f"adapter '{request.lora_name}' is loaded from {adapter.path}, not {request.lora_path}; "
                    "use another name, or replace it with add_lora(..., load_inplace=True)"
                )
            handle = AdapterHandle(request.lora_name, adapter=adapter)
            adapter.handles.add(handle)
            return handle
        pending = self._loader.first_load(request.lora_name)
        if pending is None:
            if request.lora_path is None:
                raise AdapterNotFoundError(f"adapter '{request.lora_name}' is not loaded and the request gives no path")
            pending = self._start_load(PendingLoad(request.lora_name, request.lora_path))
        elif request.lora_path is not None and request.lora_path != pending.path:
            raise AdapterError(
                f"adapter '{request.lora_name}' is being loaded from {pending.path}, not {request.lora_path}"
            )
        handle = AdapterHandle(request.lora_name, load=pending)
        pending.handles.append(handle)
        return handle

    def release(self, handle: AdapterHandle) -> None:
        """The request holding ``handle`` is finished (or aborted)."""
        adapter = handle.adapter
        if adapter is None:
            if handle.load is not None and handle in handle.load.handles:
                handle.load.handles.remove(handle)
            return
        adapter.handles.discard(handle)
        self._let_go(adapter)

    def share(self, handle: AdapterHandle) -> AdapterHandle:
        """Another reference to ``handle``'s adapter, for a sequence forked from its request (``n``
        > 1): held and released like one from ``resolve``, and bound to the same adapter even if its
        name has been unloaded or replaced meanwhile."""
        adapter = _ready_adapter(handle)
        twin = AdapterHandle(handle.name, adapter=adapter)
        adapter.handles.add(twin)
        return twin

    def ready(self, handle: AdapterHandle) -> bool:
        """Whether a request's adapter can enter a slot now; starts a re-read if it must."""
        adapter = handle.adapter
        if adapter is not None and (adapter.slot is not None or adapter.weights is not None):
            return True
        if adapter is not None and adapter.reload is None:
            self._reread(adapter)
        if not handle.stalled:
            handle.stalled = True
            self._load_stalls += 1
        return False

    def needs_copy(self, handle: AdapterHandle) -> bool:
        """Whether admitting a request of ``handle`` would start a copy into the GPU pool: its adapter
        is in the CPU cache and holds no slot (the scheduler admits resident adapters' requests first)."""
        adapter = handle.adapter
        return adapter is not None and adapter.slot is None and adapter.weights is not None

    def needs_prefetch(self, handle: AdapterHandle) -> bool:
        """Whether ``prefetch_queued`` would start something for ``handle``'s adapter: a copy into the GPU
        pool (in the CPU cache, no slot) or a read from storage (in neither, no read in flight)."""
        adapter = handle.adapter
        return adapter is not None and adapter.slot is None and (adapter.weights is not None or adapter.reload is None)

    def prefetch_queued(self, handles: Iterable[AdapterHandle]) -> int:
        """Bring the adapters of waiting requests up ahead of their admission (the scheduler's
        look-ahead, ``EngineConfig.lora_prefetch_groups``); returns how many copies and reads it started.

        An adapter in the CPU cache is put in a slot, unpinned, as ``prefetch(to_gpu=True)`` puts one:
        only into free rows or those of idle adapters (no running sequence, no waiting request), never
        those of another adapter of ``handles``, so it never evicts what a running sequence or a waiting
        request uses; where that does not make room it stays in the CPU cache and its admission places
        it. One whose CPU copy is gone is read again from storage, as its admission would. The first
        admission that finds it resident counts as a prefetch hit."""
        adapters = [h.adapter for h in handles if h.adapter is not None and self.needs_prefetch(h)]
        started = 0
        for adapter in adapters:
            if adapter.weights is None:
                self._reread(adapter)
                started += 1
            elif self._slots.place(adapter, [a for a in adapters if a is not adapter]) is not None:
                adapter.prefetched = True
                self._cpu.demote(adapter)  # the slot serves it now, as after an admission's copy
                started += 1
        self._prefetches += started
        return started

    # ---- GPU slots ------------------------------------------------------------------------

    def acquire_slot(self, handle: AdapterHandle) -> Grant:
        """Pin the handle's adapter on the GPU for one running sequence: its slot, ``"filling"``
        while its copy in is in flight, None when pinned adapters leave no room. Call only once
        ``ready(handle)``."""
        adapter = _ready_adapter(handle)
        placing = adapter.slot is None
        grant = self._slots.pin(adapter)
        if grant is not None and placing:
            self._cpu.demote(adapter)
        return grant

    @property
    def row_pool(self) -> RowPool:
        """The GPU pool's rows (serving.engine.lora.borrow moves their floor)."""
        return self._slots.rows

    @property
    def placement_evictions(self) -> int:
        """Adapters evicted to make room for another since start: the pool was short of rows."""
        return self._slots.placement_evictions

    def evict_below(self, row: int) -> int:
        """Evict idle adapters (no running sequence, no waiting request, copy landed) whose rows start
        below ``row``; their CPU copies stay where the CPU cache holds them. Returns the lowest row
        still allocated."""
        return self._slots.evict_below(row)

    def release_slot(self, handle: AdapterHandle) -> None:
        """A running sequence stopped running (finished or preempted). It still holds its handle,
        so this never frees the adapter: ``release`` does, when the request ends."""
        self._slots.unpin(_ready_adapter(handle))

    # ---- named adapters (the server's load / unload) ---------------------------------------

    def add(self, request: LoRARequest, *, load_inplace: bool, background: bool = False) -> Future[CachedAdapter]:
        """Load ``request`` into the CPU cache under its name; the future holds the adapter. A
        ``background`` read (a prefetch's) goes to the prefetch thread, not the request threads."""
        if request.lora_path is None:
            raise AdapterError(f"adapter '{request.lora_name}' needs a path to load from")
        done: Future[CachedAdapter] = Future()
        pending = self._loader.first_load(request.lora_name)
        if pending is None or pending.path != request.lora_path:
            pending = self._start_load(PendingLoad(request.lora_name, request.lora_path, background=background))
        pending.add_futures.append((done, load_inplace))
        return done

    def prefetch(self, request: LoRARequest, *, to_gpu: bool, keep: Collection[str] = ()) -> Future[Placement]:
        """Bring an adapter up ahead of its traffic (predictive prewarm); the future says where it ended.

        The adapter is loaded into the CPU cache under its name, as ``add`` does (no read when the
        name already holds that content in the CPU cache or a slot). With ``to_gpu`` it is then put
        in a slot, unpinned, when one is empty or holds an idle adapter (no running sequence and no
        waiting request: the least recently used such one) that is not one of the names in ``keep``
        (the others the same prefetch wants in a slot), so it is ``"gpu"``; a pinned, busy or kept
        slot is never taken, and then it stays ``"cpu"``. Its CPU copy stays the newest rather than
        the first to go, as an on-demand fill's is: a predicted adapter that an on-demand load
        pushes out of its slot is put back by the next prefetch without a read. Raises AdapterError
        as ``add`` does (a name loaded with other content is not replaced: prefetching never
        changes what a name serves)."""
        adapter = self._names.get(request.lora_name)
        if adapter is not None and request.lora_path not in (None, adapter.path):
            raise AdapterError(
                f"adapter '{request.lora_name}' is loaded from {adapter.path}, not {request.lora_path}; "
                "a prefetch does not replace it"
            )
        placed: Future[Placement] = Future()
        if adapter is not None and (adapter.weights is not None or adapter.slot is not None):
            placed.set_result(self._place(adapter, to_gpu=to_gpu, keep=keep))
            return placed
        path = request.lora_path if request.lora_path is not None else adapter.path if adapter is not None else None
        added = self.add(LoRARequest(request.lora_name, path), load_inplace=False, background=True)

        def place(done: Future[CachedAdapter]) -> None:  # on the engine thread, as the load is taken in
            error = done.exception()
            if error is not None:
                placed.set_exception(error)
            else:
                placed.set_result(self._place(done.result(), to_gpu=to_gpu, keep=keep))

        added.add_done_callback(place)
        return placed

    def _place(self, adapter: CachedAdapter, *, to_gpu: bool, keep: Collection[str]) -> Placement:
        if adapter.weights is not None:
            self._cpu.touch(adapter)
        if to_gpu:
            kept = {self._names[name] for name in keep if name in self._names}
            kept.discard(adapter)
            self._slots.place(adapter, kept)
        return "gpu" if adapter.slot is not None else "cpu"

    def repair(self, slot: int) -> CachedAdapter | None:
        """``slot`` no longer holds what was copied in (its checksum failed): bring it back from storage.

        Its adapter is re-read from storage (the digest checked against the one it was loaded
        with, as every re-read is) rather than from the CPU copy, which may be what went bad. The
        caller has stopped every sequence running on the slot (``LLMEngine.verify_slots``), so the
        slot is emptied until the read is in: no request runs on it meanwhile (new ones wait for
        the read, as after a CPU eviction) and nothing reads it while it is refilled. Returns the
        adapter, or None for an empty slot."""
        adapter = self._slots.slots()[slot]
        if adapter is None:
            return None
        assert adapter.running == 0, "a slot is repaired only once nothing runs on it"
        adapter.repairing = True
        self._cpu.discard(adapter)
        self._slots.free(adapter)
        if adapter.reload is None:
            self._reread(adapter)
        return adapter

    def remove(self, name: str) -> CachedAdapter:
        """Forget ``name``; its slot and CPU copy are freed once no request uses them."""
        adapter = self._names.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(f"adapter '{name}' is not loaded")
        adapter.names.discard(name)
        self._let_go(adapter)
        return adapter

    def named(self) -> dict[str, CachedAdapter]:
        return dict(self._names)

    def get(self, name: str) -> CachedAdapter | None:
        """The adapter ``name`` is bound to, None if it is not loaded (no copy of every name: a
        caller about a few names costs the engine thread nothing per adapter loaded)."""
        return self._names.get(name)

    def slots(self) -> list[CachedAdapter | None]:
        return self._slots.slots()

    def landed(self) -> list[CachedAdapter]:
        """Resident adapters whose rows hold their content (copies in flight excluded)."""
        return self._slots.landed()

    def cpu_resident(self) -> list[CachedAdapter]:
        return self._cpu.resident()

    @property
    def num_loading(self) -> int:
        return self._loader.num_loading

    # ---- loading --------------------------------------------------------------------------

    def poll(self) -> list[tuple[AdapterHandle, Exception]]:
        """Take in finished loads; returns the handles whose adapter failed to load, with the error.

        A failed first load fails every request waiting on it; a failed re-read fails the requests
        of that adapter. The engine finishes those requests with the error."""
        self._loader.start_queued(self._cpu_room)
        failed: list[tuple[AdapterHandle, Exception]] = []
        for load in self._loader.finished():
            self._finish_load(load, failed)
        return failed

    def wait(self, timeout: float) -> None:
        """Block until some load finishes (or ``timeout``); for callers with nothing else to do."""
        self._loader.wait(timeout)

    def shutdown(self) -> None:
        self._loader.shutdown()

    def _reread(self, adapter: CachedAdapter) -> None:
        """Read ``adapter`` from storage again (its CPU copy is gone, or its slot went bad)."""
        name = next(iter(adapter.names), adapter.digest)
        adapter.reload = self._start_load(PendingLoad(name, adapter.path, reload_of=adapter))

    def _start_load(self, load: PendingLoad) -> PendingLoad:
        return self._loader.submit(load, start_now=self._cpu_room())

    def _cpu_room(self) -> bool:
        """Whether one more adapter fits in the CPU cache. An entry may go when its adapter is in a
        slot (the copy there serves its requests) or no request uses it (a name alone re-reads it
        on its next use); the entry of an adapter whose waiting requests need it stays."""
        return self._cpu.make_room(self._loader.num_reading, lambda a: a.slot is not None or a.refs == 0)

    def _finish_load(self, load: PendingLoad, failed: list[tuple[AdapterHandle, Exception]]) -> None:
        assert load.future is not None
        error = load.future.exception()
        result: LoadResult | None = None
        if error is None:
            result = load.future.result()
            if load.reload_of is not None and result.loaded.digest != load.reload_of.digest:
                error = AdapterError(
                    f"adapter at {load.path} changed since it was loaded (digest {result.loaded.digest[:12]}, "
                    f"expected {load.reload_of.digest[:12]}); load it again under a name"
                )
        if error is not None or result is None:
            self._load_failures += 1
            if not isinstance(error, Exception):
                error = AdapterError(str(error))
            for done, _ in load.add_futures:
                done.set_exception(error)
            if load.reload_of is not None:
                load.reload_of.reload = None
                load.reload_of.repairing = False
                failed.extend((handle, error) for handle in load.reload_of.handles)
                self._let_go(load.reload_of)
            else:
                failed.extend((handle, error) for handle in load.handles)
            return
        self._loads += 1
        self._load_seconds_total += result.seconds
        self._last_load_seconds = result.seconds
        adapter = self._take_in(result, load.path)
        if load.reload_of is not None:
            load.reload_of.reload = None
        if adapter.repairing:
            # Back in a slot: the one it left, first to be reused, unless another took it meanwhile.
            adapter.repairing = False
            if self._slots.place(adapter) is not None:
                self._slot_repairs += 1
        for done, load_inplace in load.add_futures:
            try:
                self._bind(load.name, adapter, load_inplace=load_inplace)
            except AdapterError as exc:
                done.set_exception(exc)
            else:
                done.set_result(adapter)
        if load.handles:
            if load.name not in self._names:
                self._bind(load.name, adapter, load_inplace=False)
            for handle in load.handles:
                handle.adapter, handle.load = adapter, None
                adapter.handles.add(handle)
        # A load nobody waits for any more (its requests were aborted, its add refused) is freed.
        self._let_go(adapter)

    def _take_in(self, result: LoadResult, path: str) -> CachedAdapter:
        loaded = result.loaded
        adapter = self._by_digest.get(loaded.digest)
        if adapter is None:
            adapter = CachedAdapter(
                digest=loaded.digest,
                path=path,
                rank=loaded.rank,
                lora_alpha=float(loaded.lora_alpha),
                scaling=float(loaded.scaling),
                target_modules=tuple(sorted(loaded.target_modules)),
                weights=None,
                load_seconds=result.seconds,
                nbytes=result.nbytes,
                checksum=result.checksum,
                dora=loaded.use_dora,
            )
            self._by_digest[loaded.digest] = adapter
        self._cpu.put(adapter, result.weights, result.magnitudes, result.vocab)
        return adapter

    def _bind(self, name: str, adapter: CachedAdapter, *, load_inplace: bool) -> None:
        current = self._names.get(name)
        if current is adapter:
            return
        if current is not None:
            if not load_inplace:
                raise AdapterError(
                    f"adapter '{name}' is already loaded with different content (digest {current.digest[:12]}, "
                    f"new {adapter.digest[:12]}); unload it first or pass load_inplace=True"
                )
            current.names.discard(name)
            self._let_go(current)
        self._names[name] = adapter
        adapter.names.add(name)

    def _let_go(self, adapter: CachedAdapter) -> None:
        """One holder of ``adapter`` (a name, a request, a re-read) let go: once nothing holds it,
        free its slot and CPU copy. This is the only place an adapter is freed, and it is called
        only where a holder goes, so no unused adapter ever stays resident."""
        if not adapter.unused:
            return
        self._slots.free(adapter)
        self._cpu.discard(adapter)
        self._by_digest.pop(adapter.digest, None)


def _ready_adapter(handle: AdapterHandle) -> CachedAdapter:
    if handle.adapter is None:
        raise AdapterError(f"adapter '{handle.name}' is still loading")  # a scheduler bug, not a user error
    return handle.adapter
