"""Prefetching registry versions ahead of their traffic (the gateway's prewarm loop calls it;
docs/gateway.md, "Predictive prewarm").

The caller lists versions most wanted first, each with its artifact and manifest digest, and says
which ones it wants in a GPU slot. A version this worker does not serve yet is loaded under its
qualified name (read and digest-checked as an on-demand load is: serving.engine.server.on_demand),
one at a time, so on-demand loads keep a loader thread; then the engine's `prefetch_lora` brings
each into the CPU cache (re-reading one whose copy was evicted) and, where asked, into a GPU slot
that is empty or holds an idle adapter, never one pinned by a running sequence or wanted by a
waiting request.

The versions meant for slots are placed first, in a phase of their own (the CPU-only ones may
need many reads, and the slots should not wait for them). Within a phase, what is already in memory
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

from serving.engine.adapter_loader import AdapterError
from serving.engine.async_engine import AsyncEngine
from serving.engine.lora_cache import Placement
from serving.engine.lora_request import LoRARequest
from serving.engine.server.adapters import AdapterSet, Source

log = logging.getLogger(__name__)

# A prefetch reads from storage one version at a time. The engine's loader threads (two) take reads
# in order, so a round that queued a hundred reads would put every request for an adapter not yet
# loaded behind all of them (bench/prewarm.py saw TTFT p99 of seconds); one at a time leaves the
# other thread to on-demand loads, which wait at most for the one prefetch read under way.


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
    error: str | None = None


async def prefetch(engine: AsyncEngine, adapters: AdapterSet, items: list[PrefetchItem]) -> list[PrefetchResult]:
    """Load `items` (most wanted first) into the CPU cache and, where `to_gpu`, a GPU slot; one
    result per item, in the items' order."""
    results = {item.name: PrefetchResult(item.name) for item in items}
    keep = frozenset(item.name for item in items if item.to_gpu)
    for phase in ([item for item in items if item.to_gpu], [item for item in items if not item.to_gpu]):
        if phase:
            await _prefetch_phase(engine, adapters, phase, results, keep)
    return [results[item.name] for item in items]


async def _prefetch_phase(engine: AsyncEngine, adapters: AdapterSet, items: list[PrefetchItem],
                          results: dict[str, PrefetchResult], keep: frozenset[str]) -> None:
    infos = {info.name: info for info in await engine.list_loras()}

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
    # What is in memory goes all at once: each call queues its command as its task starts, and the
    # engine runs queued commands in order between two steps, so it costs one step's wait, not one
    # per version.
    for item, placement in zip(reversed(ready), await asyncio.gather(*(place(item) for item in reversed(ready)),
                                                                   return_exceptions=True)):
        record(item, placement)
    for item in items:
        if item in ready:
            continue
        try:
            await _bind(adapters, item)
            outcome: Placement | BaseException = await place(item)  # re-reads a copy that was evicted
        except (AdapterError, ValueError) as exc:
            outcome = exc
        record(item, outcome)


async def _bind(adapters: AdapterSet, item: PrefetchItem) -> None:
    """Serve `item` under its name on this worker, read and digest-checked as on-demand loads are."""
    served = adapters.get(item.name)
    if served is not None and served.info.digest == item.manifest_sha256:
        return
    info = await adapters.load(item.name, item.artifact_uri, load_inplace=True, source=Source.REGISTRY)
    if info.digest != item.manifest_sha256:
        await adapters.unload(item.name)
        raise AdapterError(f"the artifact's manifest sha256 is {info.digest}, the registry recorded "
                           f"{item.manifest_sha256}")
