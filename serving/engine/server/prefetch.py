"""Prefetching registry versions ahead of their traffic (the gateway's prewarm loop calls it;
docs/gateway.md, "Predictive prewarm").

The caller lists versions most wanted first, each with its artifact and manifest digest, and says
which ones it wants in a GPU slot. A version this worker does not serve yet is loaded under its
qualified name (read and digest-checked as an on-demand load is: serving.engine.server.on_demand),
one at a time, so on-demand loads keep a loader thread; then the engine's `prefetch_lora` brings
each into the CPU cache (re-reading one whose copy was evicted) and, where asked, into a GPU slot
that is empty or holds an idle adapter, never one pinned by a running sequence or wanted by a
waiting request.

Order matters because the engine evicts least recently used first, in slots and in the CPU cache:
the versions already in a slot are touched first, then the others from the least wanted up, so
each placement evicts an adapter that is not on the list before one that is, and the most wanted
ends most recently used. A failure of one version is reported for it and does not stop the others.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from serving.engine.adapter_loader import AdapterError
from serving.engine.async_engine import AsyncEngine
from serving.engine.lora_request import LoRARequest
from serving.engine.server.adapters import AdapterSet, Source

log = logging.getLogger(__name__)

# Versions a prefetch reads from storage at once: one. The engine's loader threads (two) take reads
# in order, so a round that queued a hundred reads would put every request for an adapter not yet
# loaded behind all of them (bench/prewarm.py saw TTFT p99 of seconds); one at a time leaves the
# other thread to on-demand loads, which wait at most for the one prefetch read under way.
_PARALLEL_LOADS = 1


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
    result per item, in the items' order. The slot placements go first, as a phase of their own:
    the CPU-only ones may need many reads, and the slots should not wait for them."""
    results = {item.name: PrefetchResult(item.name) for item in items}
    gate = asyncio.Semaphore(_PARALLEL_LOADS)
    for phase in ([item for item in items if item.to_gpu], [item for item in items if not item.to_gpu]):
        if phase:
            await _prefetch_phase(engine, adapters, phase, results, gate)
    return [results[item.name] for item in items]


async def _prefetch_phase(engine: AsyncEngine, adapters: AdapterSet, items: list[PrefetchItem],
                          results: dict[str, PrefetchResult], gate: asyncio.Semaphore) -> None:

    async def bind(item: PrefetchItem) -> None:
        served = adapters.get(item.name)
        if served is not None and served.info.digest == item.manifest_sha256:
            return
        async with gate:
            info = await adapters.load(item.name, item.artifact_uri, load_inplace=True, source=Source.REGISTRY)
        if info.digest != item.manifest_sha256:
            await adapters.unload(item.name)
            raise AdapterError(f"the artifact's manifest sha256 is {info.digest}, the registry recorded "
                               f"{item.manifest_sha256}")

    outcomes = await asyncio.gather(*(bind(item) for item in items), return_exceptions=True)
    bound = []
    for item, outcome in zip(items, outcomes):
        if isinstance(outcome, (AdapterError, ValueError)):
            results[item.name].error = str(outcome)
            log.warning("prefetch of %s failed: %s", item.name, outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            bound.append(item)
    infos = {info.name: info for info in await engine.list_loras()}
    in_slot = {name for name, info in infos.items() if info.gpu_slot is not None}
    order = [item for item in bound if item.name in in_slot]
    order += [item for item in reversed(bound) if item.name not in in_slot]
    in_memory = [item for item in order
                 if item.name in in_slot or getattr(infos.get(item.name), "in_cpu_cache", False)]
    # What is in memory goes all at once, in order: each call queues its command as its task
    # starts, and the engine runs queued commands in order between two steps, so it costs one
    # step's wait, not one per version. What must be re-read (its CPU copy was evicted) goes one
    # at a time after, for the loader threads' sake (above). No path: each name is bound now, and
    # its location is what the load resolved.
    placements = list(await asyncio.gather(*(engine.prefetch_lora(LoRARequest(item.name), to_gpu=item.to_gpu)
                                             for item in in_memory), return_exceptions=True))
    rest = [item for item in order if item not in in_memory]
    for item in rest:
        try:
            placements.append(await engine.prefetch_lora(LoRARequest(item.name), to_gpu=item.to_gpu))
        except AdapterError as exc:
            placements.append(exc)
    for item, placement in zip([*in_memory, *rest], placements):
        result = results[item.name]
        if isinstance(placement, AdapterError):
            result.error = str(placement)
        elif isinstance(placement, BaseException):
            raise placement
        else:
            result.cpu = True
            result.gpu = placement == "gpu"
