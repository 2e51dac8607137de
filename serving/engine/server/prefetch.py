"""Prefetching registry versions ahead of their traffic (the gateway's prewarm loop calls it;
docs/gateway.md, "Predictive prewarm").

The caller lists versions most wanted first, each with its artifact and manifest digest, and says
which ones it wants in a GPU slot. A version this worker does not serve yet is loaded under its
qualified name (read and digest-checked as an on-demand load is: serving.engine.server.on_demand),
a few at a time; then the engine's `prefetch_lora` brings each into the CPU cache (re-reading one
whose copy was evicted) and, where asked, into a GPU slot that is empty or holds an idle adapter,
never one pinned by a running sequence or wanted by a waiting request.

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

# Versions read from storage at once (the engine's loader threads bound the reads themselves).
_PARALLEL_LOADS = 4


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
    gate = asyncio.Semaphore(_PARALLEL_LOADS)

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
    in_slot = {info.name for info in await engine.list_loras() if info.gpu_slot is not None}
    order = [item for item in bound if item.name in in_slot]
    order += [item for item in reversed(bound) if item.name not in in_slot]
    # All at once, in order: each call queues its command as its task starts, and the engine runs
    # queued commands in order between two steps, so the round costs one step's wait, not one per
    # version. No path: the name is bound now, and its location is what the load resolved.
    placements = await asyncio.gather(*(engine.prefetch_lora(LoRARequest(item.name), to_gpu=item.to_gpu)
                                        for item in order), return_exceptions=True)
    for item, placement in zip(order, placements):
        result = results[item.name]
        if isinstance(placement, AdapterError):
            result.error = str(placement)
        elif isinstance(placement, BaseException):
            raise placement
        else:
            result.cpu = True
            result.gpu = placement == "gpu"
    return [results[item.name] for item in items]
