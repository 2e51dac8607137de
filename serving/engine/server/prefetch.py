"""Prefetching registry versions ahead of their traffic (the gateway's prewarm loop calls it;
docs/gateway.md, "Predictive prewarm").

The caller lists versions most wanted first, each with its artifact and manifest digest, and says
which ones it wants in a GPU slot. A version this worker does not serve yet is loaded under its
qualified name (read and digest-checked as an on-demand load is: serving.engine.server.on_demand),
one at a time on the engine's prefetch thread, so on-demand loads never queue behind it; then the engine's `prefetch_lora` brings
each into the CPU cache (re-reading one whose copy was evicted) and, where asked, into a GPU slot
that is empty or holds an idle adapter, never one pinned by a running sequence or wanted by a
waiting request.

The versions meant for slots are placed before the call answers; the CPU-only ones are read and
placed after it, in the background, since they may need many reads (a hundred at 100 ms each
made a round of bench/prewarm.py last 9 s, so its slot placements ran every 1.4 simulated hours
instead of every 5 minutes). A newer call supersedes them: its ranking is fresher, so the older
call's CPU-only part stops before its next read. Reads go one at a time across calls. Within a
phase, what is already in memory
is placed at once, least wanted first, so the most wanted ends most recently used (an on-demand
load evicts least recently used first); then what needs a read, one at a time, most wanted first,
each placed as soon as it is read. Every slot placement names the others of the call as kept, so
no placement evicts an adapter the same call wants in a slot: the engine takes an empty slot or an
idle one holding something off the list, else leaves the version in the CPU cache. (An order alone
did not do it: bench/prewarm.py found about 40 % of the misses of predicted adapters were a
placement evicting another predicted one, touched at the start of the round and made least
recently used by the on-demand loads during its reads.) A failure of one version is reported for
it and does not stop the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from serving.engine.engine_client import EngineClient
from serving.engine.lora.cache import Placement
from serving.engine.lora.reader import AdapterError
from serving.engine.lora.request import LoRARequest
from serving.engine.server.adapters import AdapterSet, Source

log = logging.getLogger(__name__)

# A prefetch reads from storage one version at a time, whatever the calls in flight, on the engine's
# prefetch thread (serving.engine.lora.loader): the requests' loader threads are left to on-demand
# loads. (A round that queued a hundred reads on those threads put every request for an adapter
# not yet loaded behind all of them: TTFT p99 of seconds in bench/prewarm.py.)


@dataclass(frozen=True)
class PrefetchItem:
    name: str
    artifact_uri: str
    manifest_sha256: str
    to_gpu: bool


@dataclass
class PrefetchResult:
    name: str
    cpu: bool = False
    gpu: bool = False
    queued: bool = False  # CPU-only: read and placed after the answer, unless a newer call comes first
    error: str | None = None


class Prefetcher:
    """A worker's prefetches (one per worker): the calls' reads one at a time, the CPU-only part
    of a call in the background until a newer call supersedes it."""

    def __init__(self) -> None:
        self._reads = asyncio.Lock()
        self._calls = 0
        self._background: set[asyncio.Task[None]] = set()

    async def prefetch(self, engine: EngineClient, adapters: AdapterSet,
                       items: list[PrefetchItem]) -> list[PrefetchResult]:
        """Place the `to_gpu` ones of `items` (most wanted first) in slots, then answer: one result
        per item, in the items' order, the CPU-only ones `queued` (their part goes on after)."""
        self._calls += 1
        call = self._calls
        results = {item.name: PrefetchResult(item.name) for item in items}
        keep = frozenset(item.name for item in items if item.to_gpu)
        await self._phase(engine, adapters, [item for item in items if item.to_gpu], results, keep, call)
        cpu_only = [item for item in items if not item.to_gpu]
        if cpu_only:
            for item in cpu_only:
                results[item.name].queued = True
            later = {item.name: PrefetchResult(item.name) for item in cpu_only}
            task = asyncio.create_task(self._phase(engine, adapters, cpu_only, later, keep, call),
                                       name="prefetch-cpu-caches")
            self._background.add(task)
            task.add_done_callback(self._done)
        return [results[item.name] for item in items]

    async def close(self) -> None:
        """Stop the CPU-only parts still going (the worker is stopping)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("prefetch into the CPU cache failed", exc_info=task.exception())

    async def _phase(self, engine: EngineClient, adapters: AdapterSet, items: list[PrefetchItem],
                     results: dict[str, PrefetchResult], keep: frozenset[str], call: int) -> None:
        if not items:
            return
        # Only the call's names: an entry per adapter loaded would be O(all) on the engine thread
        # per phase, a delay every request in flight pays.
        infos = {info.name: info for info in await engine.list_loras([item.name for item in items])}

        def in_memory(item: PrefetchItem) -> bool:
            served, info = adapters.get(item.name), infos.get(item.name)
            return (served is not None and served.info.digest == item.manifest_sha256 and info is not None
                    and (info.gpu_slot is not None or info.in_cpu_cache))

        def record(item: PrefetchItem, placement: Placement | BaseException) -> None:
            result = results[item.name]
            if isinstance(placement, (AdapterError, ValueError)):
                result.error = str(placement)
                log.warning("prefetch of %s failed: %s", item.name, placement)
            elif isinstance(placement, BaseException):
                raise placement
            else:
                result.cpu = True
                result.gpu = placement == "gpu"

        def place(item: PrefetchItem) -> Awaitable[Placement]:
            # No path: the name is bound by now, and its location is what the load resolved.
            return engine.prefetch_lora(LoRARequest(item.name), to_gpu=item.to_gpu, keep=keep)

        ready = [item for item in items if in_memory(item)]
        # What is in memory goes all at once: each call queues its command as its task starts, and
        # the engine runs queued commands in order between two steps, so it costs one step's wait,
        # not one per version.
        placed = await asyncio.gather(*(place(item) for item in reversed(ready)), return_exceptions=True)
        for item, placement in zip(reversed(ready), placed):
            record(item, placement)
        for item in items:
            if item in ready:
                continue
            async with self._reads:
                if call != self._calls:
                    return  # a newer call ranks afresh
                try:
                    await _bind(adapters, item)
                    outcome: Placement | BaseException = await place(item)  # re-reads an evicted copy
                except (AdapterError, ValueError) as exc:
                    outcome = exc
            record(item, outcome)


async def _bind(adapters: AdapterSet, item: PrefetchItem) -> None:
    """Serve `item` under its name on this worker, read and digest-checked as on-demand loads are."""
    served = adapters.get(item.name)
    if served is not None and served.info.digest == item.manifest_sha256:
        return
    info = await adapters.load(item.name, item.artifact_uri, load_inplace=True, source=Source.REGISTRY,
                               background=True)
    if info.digest != item.manifest_sha256:
        await adapters.unload(item.name)
        raise AdapterError(f"the artifact's manifest sha256 is {info.digest}, the registry recorded "
                           f"{item.manifest_sha256}")
