"""Where each adapter lives: a GPU slot, the CPU cache, or only in storage — and moving it up.

Three tiers, as S-LoRA and vLLM have them:

- ``max_loras`` GPU slots, preallocated at ``max_lora_rank`` in every LoRA layer. An adapter in a
  slot is pinned while any running sequence uses it; unpinned ones stay resident and are evicted
  least-recently-used when another adapter needs the slot. Filling a slot is a copy, not an
  allocation.
- A CPU cache of at most ``max_cpu_loras`` adapters (weights already in the model's dtype, pinned
  on CUDA, so the copy into a slot is one transfer). An entry is pinned while a waiting request
  needs it to enter a slot; loads that would overflow the cache wait for room.
- Storage: ``load_adapter`` reads, validates and digests an adapter (a local directory or
  ``s3://``) on a loader thread, off the decode path. Requests for an adapter being loaded wait;
  everything else keeps running.

Adapters are keyed by content digest: a name only points at a digest, so re-publishing a name
(``load_inplace``) can never serve old weights to a new request, and two names with the same
content share one copy. Every method runs on the engine's thread; loader threads only run
``load_adapter`` and hand back a future.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from serving.engine.adapter_loader import AdapterError, LoadedAdapter, load_adapter
from serving.engine.lora_request import LoRARequest

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class AdapterNotFoundError(AdapterError):
    """The name is not a loaded adapter."""


@dataclass(eq=False)
class Adapter:
    """One adapter's content (one digest) and where it is resident."""

    digest: str
    path: str
    rank: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: Weights | None
    load_seconds: float
    names: set[str] = field(default_factory=set)
    slot: int | None = None
    refs: int = 0  # unfinished requests that use it
    running: int = 0  # running sequences: they pin the slot
    reload: PendingLoad | None = None


@dataclass(eq=False)
class PendingLoad:
    """A read from storage in flight (or queued until the CPU cache has room).

    ``reload_of`` is set when this re-reads an adapter whose CPU copy was evicted; ``result`` is
    the adapter once loaded; ``waiters`` counts requests waiting on a first load;
    ``add_futures`` are ``add_lora`` calls waiting for it (``load_inplace`` each)."""

    name: str
    path: str
    reload_of: Adapter | None = None
    result: Adapter | None = None
    future: Future[tuple[LoadedAdapter, Weights, float]] | None = None
    waiters: int = 0
    add_futures: list[tuple[Future[Adapter], bool]] = field(default_factory=list)


AdapterRef = Adapter | PendingLoad


@dataclass
class LoRACacheStats:
    loads: int = 0
    load_failures: int = 0
    load_seconds_total: float = 0.0
    last_load_seconds: float = 0.0
    slot_loads: int = 0
    slot_evictions: int = 0
    cpu_evictions: int = 0


class LoRACache:
    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        base_config: object,
        base_model_name: str | None,
        dtype: torch.dtype,
        pin_memory: bool,
        write_slot: Callable[[int, Adapter], None],
        on_load_done: Callable[[], None],
    ) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self._base_config = base_config
        self._base_model_name = base_model_name
        self._dtype = dtype
        self._pin = pin_memory
        self._write_slot = write_slot
        self._on_load_done = on_load_done
        self._names: dict[str, Adapter] = {}
        self._by_digest: dict[str, Adapter] = {}
        self._cpu: OrderedDict[str, Adapter] = OrderedDict()  # digest -> adapter, LRU first
        self._slots: list[Adapter | None] = [None] * max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._pending: dict[str, PendingLoad] = {}  # first loads, by name
        self._other_loads: list[PendingLoad] = []  # re-reads, and adds beside a first load
        self._queued: list[PendingLoad] = []  # waiting for room in the CPU cache
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-load")
        # What reads an adapter from storage (runs on a loader thread). Tests wrap it to hold a
        # load in flight while they watch the engine keep decoding.
        self.load_fn: Callable[..., LoadedAdapter] = load_adapter
        self.stats = LoRACacheStats()

    # ---- requests -------------------------------------------------------------------------

    def resolve(self, request: LoRARequest) -> AdapterRef:
        """The adapter a new request runs with, loading it if needed; counts the request's ref."""
        if self.max_loras == 0:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        adapter = self._names.get(request.lora_name)
        if adapter is not None:
            if request.lora_path is not None and request.lora_path != adapter.path:
                raise AdapterError(
                    f"adapter '{request.lora_name}' is loaded from {adapter.path}, not {request.lora_path}; "
                    "use another name, or replace it with add_lora(..., load_inplace=True)"
                )
            adapter.refs += 1
            return adapter
        pending = self._pending.get(request.lora_name)
        if pending is None:
            if request.lora_path is None:
                raise AdapterNotFoundError(f"adapter '{request.lora_name}' is not loaded and the request gives no path")
            pending = self._start_load(PendingLoad(request.lora_name, request.lora_path))
            self._pending[request.lora_name] = pending
        elif request.lora_path is not None and request.lora_path != pending.path:
            raise AdapterError(
                f"adapter '{request.lora_name}' is being loaded from {pending.path}, not {request.lora_path}"
            )
        pending.waiters += 1
        return pending

    def release(self, ref: AdapterRef) -> None:
        """A request that resolved ``ref`` is finished (or aborted)."""
        ref = self.resolved(ref)
        if isinstance(ref, PendingLoad):
            ref.waiters -= 1
            return
        ref.refs -= 1
        self._drop_if_unused(ref)

    def ready(self, ref: AdapterRef) -> bool:
        """Whether a request's adapter can enter a slot now; starts a re-read if it must."""
        if isinstance(ref, PendingLoad):
            return False
        if ref.slot is not None or ref.weights is not None:
            return True
        if ref.reload is None:
            ref.reload = self._start_load(PendingLoad(next(iter(ref.names), ref.digest), ref.path, reload_of=ref))
            self._other_loads.append(ref.reload)
        return False

    # ---- GPU slots ------------------------------------------------------------------------

    def acquire_slot(self, adapter: Adapter) -> int | None:
        """Pin a slot holding ``adapter`` for one running sequence; None if every slot is pinned."""
        if adapter.slot is None:
            slot = next((s for s in self._slot_lru if self._slots[s] is None), None)
            if slot is None:
                slot = next((s for s in self._slot_lru if self._slots[s].running == 0), None)  # type: ignore[union-attr]
            if slot is None:
                return None
            evicted = self._slots[slot]
            if evicted is not None:
                evicted.slot = None
                self.stats.slot_evictions += 1
                self._drop_if_unused(evicted)
            assert adapter.weights is not None, "acquire_slot needs a ready adapter"
            self._write_slot(slot, adapter)
            self._slots[slot] = adapter
            adapter.slot = slot
            self.stats.slot_loads += 1
            # Once in a slot its CPU copy is only a backup: it may now be evicted first.
            self._cpu.move_to_end(adapter.digest, last=False)
        adapter.running += 1
        self._slot_lru.move_to_end(adapter.slot)
        return adapter.slot

    def release_slot(self, adapter: Adapter) -> None:
        """A running sequence of ``adapter`` stopped running (finished or preempted)."""
        adapter.running -= 1
        self._drop_if_unused(adapter)

    # ---- named adapters (the server's load / unload) ---------------------------------------

    def add(self, request: LoRARequest, *, load_inplace: bool) -> Future[Adapter]:
        """Load ``request`` into the CPU cache under its name; the future holds the adapter."""
        if self.max_loras == 0:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        if request.lora_path is None:
            raise AdapterError(f"adapter '{request.lora_name}' needs a path to load from")
        done: Future[Adapter] = Future()
        pending = self._pending.get(request.lora_name)
        if pending is None or pending.path != request.lora_path:
            pending = self._start_load(PendingLoad(request.lora_name, request.lora_path))
            if request.lora_name not in self._pending:
                self._pending[request.lora_name] = pending
            else:
                self._other_loads.append(pending)
        pending.add_futures.append((done, load_inplace))
        return done

    def remove(self, name: str) -> Adapter:
        """Forget ``name``; its slot and CPU copy are freed once no request uses them."""
        adapter = self._names.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(f"adapter '{name}' is not loaded")
        adapter.names.discard(name)
        self._drop_if_unused(adapter)
        return adapter

    def named(self) -> dict[str, Adapter]:
        return dict(self._names)

    def slots(self) -> list[Adapter | None]:
        return list(self._slots)

    def cpu_resident(self) -> list[Adapter]:
        return list(self._cpu.values())

    @property
    def num_loading(self) -> int:
        return len(self._pending) + len(self._other_loads)

    # ---- loading --------------------------------------------------------------------------

    def poll(self) -> list[tuple[AdapterRef, Exception]]:
        """Take in finished loads; returns the refs whose load failed, with the error.

        A failed first load fails every request waiting on it; a failed re-read fails the requests
        of that adapter. The engine finishes those requests with the error."""
        self._start_queued()
        failed: list[tuple[AdapterRef, Exception]] = []
        for name, pending in list(self._pending.items()):
            if pending.future is not None and pending.future.done():
                del self._pending[name]
                self._finish_load(pending, failed)
        for pending in list(self._other_loads):
            if pending.future is not None and pending.future.done():
                self._other_loads.remove(pending)
                self._finish_load(pending, failed)
        return failed

    def resolved(self, ref: AdapterRef) -> AdapterRef:
        """What a pending ref became once its load finished (the ref itself otherwise)."""
        if isinstance(ref, PendingLoad) and ref.result is not None:
            return ref.result
        return ref

    def wait(self, timeout: float) -> None:
        """Block until some load finishes (or ``timeout``); for callers with nothing else to do."""
        futures = [p.future for p in [*self._pending.values(), *self._other_loads] if p.future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_load(self, pending: PendingLoad) -> PendingLoad:
        if self._cpu_room():
            pending.future = self._executor.submit(self._load, pending.path)
            pending.future.add_done_callback(lambda _: self._on_load_done())
        else:
            self._queued.append(pending)
        return pending

    def _start_queued(self) -> None:
        while self._queued and self._cpu_room():
            pending = self._queued.pop(0)
            pending.future = self._executor.submit(self._load, pending.path)
            pending.future.add_done_callback(lambda _: self._on_load_done())

    def _cpu_room(self) -> bool:
        """Whether one more adapter fits in the CPU cache (evicting an unpinned entry if needed)."""
        in_flight = sum(1 for p in [*self._pending.values(), *self._other_loads] if p.future is not None)
        while len(self._cpu) + in_flight >= self.max_cpu_loras:
            victim = next((a for a in self._cpu.values() if a.slot is not None or a.refs == 0), None)
            if victim is None:
                return False
            self._evict_cpu(victim)
        return True

    def _evict_cpu(self, adapter: Adapter) -> None:
        del self._cpu[adapter.digest]
        adapter.weights = None
        self.stats.cpu_evictions += 1
        self._drop_if_unused(adapter)

    def _load(self, path: str) -> tuple[LoadedAdapter, Weights, float]:
        """Loader thread: read, validate and digest; convert to the model dtype for the slot copy."""
        start = time.perf_counter()
        loaded = self.load_fn(
            path,
            base_config=self._base_config,
            max_lora_rank=self.max_lora_rank,
            base_model_name=self._base_model_name,
        )
        weights: Weights = {}
        for key, (a, b) in loaded.weights.items():
            a, b = a.to(self._dtype).contiguous(), b.to(self._dtype).contiguous()
            if self._pin:
                a, b = a.pin_memory(), b.pin_memory()
            weights[key] = (a, b)
        return loaded, weights, time.perf_counter() - start

    def _finish_load(self, pending: PendingLoad, failed: list[tuple[AdapterRef, Exception]]) -> None:
        assert pending.future is not None
        error = pending.future.exception()
        if error is None:
            loaded, weights, seconds = pending.future.result()
            if pending.reload_of is not None and loaded.digest != pending.reload_of.digest:
                error = AdapterError(
                    f"adapter at {pending.path} changed since it was loaded (digest {loaded.digest[:12]}, "
                    f"expected {pending.reload_of.digest[:12]}); load it again under a name"
                )
        if error is not None:
            self.stats.load_failures += 1
            if not isinstance(error, Exception):
                error = AdapterError(str(error))
            for done, _ in pending.add_futures:
                done.set_exception(error)
            if pending.reload_of is not None:
                pending.reload_of.reload = None
                failed.append((pending.reload_of, error))
            elif pending.waiters:
                failed.append((pending, error))
            return
        self.stats.loads += 1
        self.stats.load_seconds_total += seconds
        self.stats.last_load_seconds = seconds
        adapter = self._take_in(loaded, weights, pending.path, seconds)
        if pending.reload_of is not None:
            pending.reload_of.reload = None
        for done, load_inplace in pending.add_futures:
            try:
                self._bind(pending.name, adapter, load_inplace=load_inplace)
            except AdapterError as exc:
                done.set_exception(exc)
            else:
                done.set_result(adapter)
        if pending.waiters:
            if pending.name not in self._names:
                self._bind(pending.name, adapter, load_inplace=False)
            adapter.refs += pending.waiters
        pending.result = adapter
        self._drop_if_unused(adapter)

    def _take_in(self, loaded: LoadedAdapter, weights: Weights, path: str, seconds: float) -> Adapter:
        adapter = self._by_digest.get(loaded.digest)
        if adapter is None:
            adapter = Adapter(
                digest=loaded.digest,
                path=path,
                rank=loaded.rank,
                lora_alpha=float(loaded.lora_alpha),
                scaling=float(loaded.scaling),
                target_modules=tuple(sorted(loaded.target_modules)),
                weights=None,
                load_seconds=seconds,
            )
            self._by_digest[loaded.digest] = adapter
        if adapter.weights is None:
            adapter.weights = weights
            self._cpu[adapter.digest] = adapter
        self._cpu.move_to_end(adapter.digest)
        return adapter

    def _bind(self, name: str, adapter: Adapter, *, load_inplace: bool) -> None:
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
            self._drop_if_unused(current)
        self._names[name] = adapter
        adapter.names.add(name)

    def _drop_if_unused(self, adapter: Adapter) -> None:
        """Free an adapter no name points at and no request uses: its slot and its CPU copy."""
        if adapter.names or adapter.refs > 0 or adapter.running > 0 or adapter.reload is not None:
            return
        if adapter.slot is not None:
            self._slots[adapter.slot] = None
            self._slot_lru.move_to_end(adapter.slot, last=False)
            adapter.slot = None
        if adapter.digest in self._cpu:
            del self._cpu[adapter.digest]
        adapter.weights = None
        self._by_digest.pop(adapter.digest, None)
