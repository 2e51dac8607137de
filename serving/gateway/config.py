"""The gateway's own settings (those of no single policy), read from the environment once.

Each policy reads its own variables in its own dataclass (serving.wire.breakers.BreakerConfig,
canary_rule, outliers, shedding, prewarm, prewarm_loop, routing.RoutingConfig,
serving.wire.redis_guard.RedisGuardConfig); what is left is here. lora_platform.settings holds one
instance of each (settings.GATEWAY, settings.GATEWAY_BREAKERS, ...), serving.gateway.wiring hands
them to the pipeline, and .env.example documents every variable with the default written below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from serving.wire.env import env_float, env_int


@dataclass(frozen=True)
class GatewayConfig:
    # How long a web process trusts its cached API keys, tiers and served versions: a revoked key, a
    # suspended tenant or a deployment holds everywhere within this time (GATEWAY_CACHE_SECONDS).
    cache_s: float = 0.5
    # How long the worker list read from Redis is reused; heartbeats are seconds apart anyway
    # (GATEWAY_WORKERS_CACHE_SECONDS).
    workers_cache_s: float = 0.25
    upstream_timeout_s: float = 600.0  # GATEWAY_UPSTREAM_TIMEOUT
    # How long a worker may take to answer a streamed call's headers, which it sends with the first
    # token: past it the gateway closes the call (the worker aborts it) and fails over to the next
    # worker, counting it as the first one's failure; a whole reply's worker is judged by its
    # heartbeat from then on (serving.gateway.worker_watch). A prefill under load takes seconds, not
    # tens of them (GATEWAY_FIRST_BYTE_TIMEOUT; docs/resilience.md, "Failover and outlier ejection").
    first_byte_timeout_s: float = 30.0
    # The largest completion request body the gateway reads: the serving worker's own bound (its
    # --max-request-body-bytes default), so a body the worker would refuse is refused here, before it
    # is parsed, admitted and charged (GATEWAY_MAX_BODY_BYTES; raise both together).
    max_body_bytes: int = 1024 * 1024
    # Token buckets hold this many minutes of the tier's rate: 2 is a burst of twice the per-minute
    # rate (GATEWAY_BUCKET_BURST).
    bucket_burst: float = 2.0
    # How many gateway (web) processes share the quotas: during a Redis outage each process admits
    # its share of a tier's rate from process-local buckets (GATEWAY_PROCESSES, else WEB_CONCURRENCY).
    processes: int = 1
    # Usage records wait in Redis and are written in batches of this size, at least every interval
    # (GATEWAY_USAGE_BATCH, GATEWAY_USAGE_FLUSH_SECONDS).
    usage_batch: int = 500
    usage_flush_s: float = 1.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GatewayConfig:
        return cls(
            cache_s=env_float(environ, "GATEWAY_CACHE_SECONDS", cls.cache_s),
            workers_cache_s=env_float(environ, "GATEWAY_WORKERS_CACHE_SECONDS", cls.workers_cache_s),
            upstream_timeout_s=env_float(environ, "GATEWAY_UPSTREAM_TIMEOUT", cls.upstream_timeout_s),
            first_byte_timeout_s=env_float(environ, "GATEWAY_FIRST_BYTE_TIMEOUT", cls.first_byte_timeout_s),
            max_body_bytes=env_int(environ, "GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes),
            bucket_burst=env_float(environ, "GATEWAY_BUCKET_BURST", cls.bucket_burst),
            processes=env_int(environ, "GATEWAY_PROCESSES", env_int(environ, "WEB_CONCURRENCY", cls.processes)),
            usage_batch=env_int(environ, "GATEWAY_USAGE_BATCH", cls.usage_batch),
            usage_flush_s=env_float(environ, "GATEWAY_USAGE_FLUSH_SECONDS", cls.usage_flush_s),
        )
