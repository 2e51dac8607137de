"""What the request path (serving.gateway.pipeline) runs on, per event loop: its config, its
clients and caches (`Resources`), the live workers read through that cache, and the prewarm loop
started beside it. serving.gateway.wiring builds them from the settings."""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from serving.gateway.config import GatewayConfig
from serving.gateway.key_budget import KeyBudgets
from serving.gateway.local_buckets import GuardedBuckets
from serving.gateway.ports import Catalog
from serving.gateway.prewarm_loop import Prewarmer, PrewarmLoopConfig
from serving.gateway.proxy import Upstream
from serving.gateway.resilience import Resilience
from serving.gateway.routing import RoundRobin, RoutingConfig, WorkerView, live_workers, read_registry
from serving.gateway.usage_backlog import UsageBacklog
from serving.contracts.registry import api_key_id


@dataclass(frozen=True)
class PipelineConfig:
    """What the steps read, built once (serving.gateway.wiring, from the settings' instances)."""

    gateway: GatewayConfig
    routing: RoutingConfig
    # The serving workers' shared key: only workers holding it are routed to (SERVING_WORKER_API_KEY).
    worker_api_key: str
    # The base model's id, the name a degraded reply carries (BASE_MODEL_NAME).
    base_model_name: str


@dataclass
class Resources:
    """Per event loop (clients bind to the loop that made them): Redis, the buckets, the pool to
    the workers, the catalog, the worker list cache, this process's in-flight count per worker,
    its round-robin turn (used under GATEWAY_ROUTING=round_robin) and the usage records Redis has
    not taken yet (serving.gateway.usage_backlog)."""

    redis: aioredis.Redis
    buckets: GuardedBuckets
    upstream: Upstream
    resilience: Resilience
    catalog: Catalog
    config: PipelineConfig
    inflight: dict[str, int] = field(default_factory=dict)
    workers: list[WorkerView] = field(default_factory=list)
    workers_read_at: float = -math.inf
    workers_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rotation: RoundRobin = field(default_factory=RoundRobin)
    flusher: asyncio.Task[None] | None = None
    prewarmer: asyncio.Task[None] | None = None
    key_budgets: KeyBudgets = field(init=False)
    usage_backlog: UsageBacklog = field(init=False)

    def __post_init__(self) -> None:
        self.key_budgets = KeyBudgets(self.redis)
        self.usage_backlog = UsageBacklog(self.redis, self.resilience.guard)


def prewarm_start(res: Resources, config: PrewarmLoopConfig) -> asyncio.Task[None] | None:
    """The prewarm loop on this loop (serving.gateway.prewarm_loop), unless its interval is 0."""
    if config.interval_s <= 0:
        return None

    async def workers() -> list[WorkerView]:
        return res.resilience.usable_workers(await current_workers(res))

    prewarmer = Prewarmer(redis=res.redis, demand=res.resilience.demand, guard=res.resilience.guard, workers=workers,
                          served=res.catalog.served_versions, client=res.upstream.client,
                          api_key=res.config.worker_api_key, config=config)
    # A fresh context: inherited from the first request, the registry lookups (sync_to_async) would
    # run on that request's thread executor, which is gone once it ends.
    return asyncio.get_running_loop().create_task(prewarmer.run(), name="gateway-prewarm",
                                                  context=contextvars.Context())


async def current_workers(res: Resources) -> list[WorkerView]:
    """Live workers, read from Redis at most every GATEWAY_WORKERS_CACHE_SECONDS per process."""
    every = res.config.gateway.workers_cache_s
    if time.monotonic() - res.workers_read_at > every:
        async with res.workers_lock:
            if time.monotonic() - res.workers_read_at > every:
                documents = await res.resilience.guard.call("worker registry", lambda: read_registry(res.redis))
                # Redis away: the last list read stays in use (failover handles a worker gone meanwhile).
                if documents is not None:
                    res.workers = live_workers(documents, base_models=res.catalog.base_model_ids(),
                                               key_id=api_key_id(res.config.worker_api_key))
                res.workers_read_at = time.monotonic()
    # A cached entry whose heartbeat has since expired is dropped by the next read; meanwhile the
    # worker is still within its TTL of three heartbeats.
    return res.workers
