"""The gateway's settings: one nested model, `GatewaySettings`, read from the environment once.

Each policy is an `EnvModel` (runtime.env) in its own module, each field naming its variable
and its default once (runtime.breakers.BreakerConfig, canary_rule, outliers, shedding,
prewarm, prewarm_loop, routing.RoutingConfig, runtime.redis_guard.RedisGuardConfig);
`GatewayConfig` holds what belongs to no single policy, and `GatewaySettings` nests them all.
runtime.settings.PlatformSettings.gateway reads it from the environment over `.env`;
lora_platform.settings names its parts (settings.GATEWAY, settings.GATEWAY_BREAKERS, ...),
serving.gateway.wiring hands them to the pipeline, and .env.example documents every variable with
the default written below (tests/gateway/test_config.py holds the two together).
"""

from __future__ import annotations

from serving.gateway.canary_rule import CanaryRuleConfig
from serving.gateway.outliers import OutlierConfig
from serving.gateway.prewarm import PrewarmConfig
from serving.gateway.prewarm_loop import PrewarmLoopConfig
from serving.gateway.routing import RoutingConfig
from serving.gateway.shedding import ShedConfig
from runtime.breakers import BreakerConfig
from runtime.env import EnvModel, env
from runtime.redis_guard import RedisGuardConfig
from runtime.settings import MAX_REQUEST_BODY_BYTES


class GatewayConfig(EnvModel):
    """The gateway's settings of no single policy (settings.GATEWAY)."""

    # How long a web process trusts its cached API keys, tiers and served versions: a revoked key, a
    # suspended tenant or a deployment holds everywhere within this time.
    cache_s: float = env(0.5, "GATEWAY_CACHE_SECONDS")
    # How long the worker list read from Redis is reused; heartbeats are seconds apart anyway.
    workers_cache_s: float = env(0.25, "GATEWAY_WORKERS_CACHE_SECONDS")
    upstream_timeout_s: float = env(600.0, "GATEWAY_UPSTREAM_TIMEOUT")
    # How long a worker may take to answer a streamed call's headers, which it sends with the first
    # token: past it the gateway closes the call (the worker aborts it) and fails over to the next
    # worker, counting it as the first one's failure; a whole reply's worker is judged by its
    # heartbeat from then on (serving.gateway.worker_watch). A prefill under load takes seconds, not
    # tens of them (docs/resilience.md, "Failover and outlier ejection").
    first_byte_timeout_s: float = env(30.0, "GATEWAY_FIRST_BYTE_TIMEOUT")
    # The largest completion request body the gateway reads: the serving worker's own bound (its
    # --max-request-body-bytes default, the same constant), so a body the worker would refuse is
    # refused here, before it is parsed, admitted and charged (raise both together).
    max_body_bytes: int = env(MAX_REQUEST_BODY_BYTES, "GATEWAY_MAX_BODY_BYTES")
    # Token buckets hold this many minutes of the tier's rate: 2 is a burst of twice the per-minute
    # rate.
    bucket_burst: float = env(2.0, "GATEWAY_BUCKET_BURST")
    # How many gateway (web) processes share the quotas: during a Redis outage each process admits
    # its share of a tier's rate from process-local buckets.
    processes: int = env(1, "GATEWAY_PROCESSES", "WEB_CONCURRENCY")
    # Usage records wait in Redis and are written in batches of this size, at least every interval.
    usage_batch: int = env(500, "GATEWAY_USAGE_BATCH")
    usage_flush_s: float = env(1.0, "GATEWAY_USAGE_FLUSH_SECONDS")


class GatewaySettings(EnvModel):
    """Every gateway setting, one nested model per policy."""

    gateway: GatewayConfig = GatewayConfig()
    routing: RoutingConfig = RoutingConfig()
    breakers: BreakerConfig = BreakerConfig()
    canary_abort: CanaryRuleConfig = CanaryRuleConfig()
    outliers: OutlierConfig = OutlierConfig()
    shedding: ShedConfig = ShedConfig()
    redis: RedisGuardConfig = RedisGuardConfig()
    prewarm: PrewarmConfig = PrewarmConfig()
    prewarm_loop: PrewarmLoopConfig = PrewarmLoopConfig()
