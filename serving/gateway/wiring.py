"""The one place the gateway's pipeline is built from Django's settings (an edge module).

Per event loop (the Redis client and the pool to the workers bind to the loop that made them):
the Redis client, the buckets, the resilience set, and the pipeline's config, all from the
settings' instances (lora_platform.settings: settings.GATEWAY, GATEWAY_BREAKERS, ...); the
catalog (serving.gateway.catalog) as the pipeline's database port; the canary abort in the
registry (serving.registry.canary_guard) as the resilience set's `CanaryAbort`; and beside them the usage
flusher (serving.registry.usage) and the prewarm loop. serving.gateway.asgi calls `handle`.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings

from serving.registry.canary_guard import canary_guard_abort
from serving.gateway import catalog, pipeline
from serving.gateway.local_buckets import GuardedBuckets
from serving.gateway.proxy import Upstream
from serving.gateway.quotas import TokenBuckets
from serving.gateway.records import Reply
from serving.gateway.resilience import Resilience
from serving.gateway.resources import PipelineConfig, Resources, prewarm_start
from serving.gateway.version_pick import ServedVersion
from serving.registry.usage import usage_flusher_start

_resources: dict[asyncio.AbstractEventLoop, Resources] = {}


async def canary_abort(canary: ServedVersion, reason: str) -> bool:
    """Aborts `canary` in the registry (audited, atomic: serving.registry.canary_guard); False when there
    was nothing to abort any more."""
    event = await sync_to_async(canary_guard_abort)(tenant_slug=canary.tenant, adapter_name=canary.adapter,
                                                    version=canary.version, reason=reason)
    return event is not None


def resilience_build(redis: aioredis.Redis) -> Resilience:
    """The resilience set of the settings, on `redis`."""
    return Resilience.build(redis, redis_guard=settings.GATEWAY_REDIS, breakers=settings.GATEWAY_BREAKERS,
                            outliers=settings.GATEWAY_OUTLIERS, prewarm=settings.GATEWAY_PREWARM,
                            canary_rule=settings.GATEWAY_CANARY_ABORT, shed=settings.GATEWAY_SHEDDING,
                            canary_abort=canary_abort)


def resources() -> Resources:
    """This event loop's resources, built on first use (with the usage flusher and the prewarm loop)."""
    loop = asyncio.get_running_loop()
    found = _resources.get(loop)
    if found is None:
        for other in [item for item in _resources if item.is_closed()]:
            del _resources[other]
        # Socket timeouts as a backstop under the guard's own per-call bound (a frozen Redis).
        client = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
                                         socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT)
        resilience = resilience_build(client)
        gateway = settings.GATEWAY
        found = Resources(
            redis=client,
            buckets=GuardedBuckets(TokenBuckets(client), guard=resilience.guard, processes=gateway.processes),
            upstream=Upstream(api_key=settings.SERVING_WORKER_API_KEY, timeout_s=gateway.upstream_timeout_s,
                              first_byte_timeout_s=gateway.first_byte_timeout_s),
            resilience=resilience,
            catalog=catalog,
            config=PipelineConfig(gateway=gateway, routing=settings.GATEWAY_ROUTING,
                                  worker_api_key=settings.SERVING_WORKER_API_KEY,
                                  base_model_name=settings.BASE_MODEL_NAME),
        )
        _resources[loop] = found
        found.flusher = usage_flusher_start()
        found.prewarmer = prewarm_start(found, settings.GATEWAY_PREWARM_LOOP)
    return found


async def handle(endpoint: str, *, authorization: str | None, raw_body: bytes) -> Reply:
    """One completion request on this loop's resources (serving.gateway.pipeline.handle)."""
    return await pipeline.handle(endpoint, authorization=authorization, raw_body=raw_body, res=resources())
