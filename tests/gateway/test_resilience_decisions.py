"""The resilience rules answer the pipeline with values and write nothing of the request
(serving.gateway.resilience): the breaker step a `VersionVerdict`, shedding its 503 or None. The
pipeline puts the answer on its `Call` (serving.gateway.pipeline.handle)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from serving.gateway.canary_rule import CanaryRuleConfig
from serving.gateway.errors import GatewayError
from serving.gateway.outliers import OutlierConfig
from serving.gateway.prewarm import PrewarmConfig
from serving.gateway.records import TierLimits
from serving.gateway.resilience import Resilience, VersionVerdict
from serving.gateway.routing import WorkerView
from serving.gateway.shedding import ShedConfig
from serving.gateway.version_pick import ServedVersion
from runtime.breakers import BreakerConfig
from runtime.redis_guard import RedisGuardConfig

STANDARD = TierLimits(name="standard", requests_per_minute=60, tokens_per_minute=1_000, max_tokens_per_request=64,
                      priority=1, degradation_allowed=True)
VIP = TierLimits(name="vip", requests_per_minute=60, tokens_per_minute=1_000, max_tokens_per_request=64,
                 priority=0, degradation_allowed=True)


async def _never_abort(version: ServedVersion, reason: str) -> bool:
    return False


def resilience() -> Resilience:
    # Never connected: the steps below reach no Redis.
    return Resilience.build(aioredis.Redis(host="127.0.0.1", port=1), redis_guard=RedisGuardConfig(),
                            breakers=BreakerConfig(), outliers=OutlierConfig(), prewarm=PrewarmConfig(),
                            canary_rule=CanaryRuleConfig(), shed=ShedConfig(), canary_abort=_never_abort)


def worker(worker_id: str, queue_depth: int) -> WorkerView:
    return WorkerView(worker_id=worker_id, url="http://127.0.0.1:1", base_model="base", served_model_names=("base",),
                      max_loras=1, max_model_len=2048, queue_depth=queue_depth, kv_cache_usage=0.0,
                      max_queued_requests=10)


def test_shedding_returns_its_refusal_with_the_callers_headers_and_never_raises() -> None:
    rules = resilience()
    full, idle = [worker("w1", 10), worker("w2", 9)], [worker("w1", 0), worker("w2", 10)]
    headers = {"x-ratelimit-remaining-requests": "59"}
    refusal = rules.shed_refusal(STANDARD, full, {}, headers=headers)
    assert isinstance(refusal, GatewayError)
    assert (refusal.status, refusal.code) == (503, "server_overloaded")
    assert refusal.headers == {**headers, "retry-after": "1"}
    assert headers == {"x-ratelimit-remaining-requests": "59"}  # the caller's own, unchanged
    assert rules.shed_refusal(STANDARD, idle, {}, headers=headers) is None  # one worker has room
    assert rules.shed_refusal(VIP, full, {}, headers=headers) is None  # vip is never shed


def test_the_base_model_has_no_breaker_to_ask() -> None:
    verdict = asyncio.run(resilience().version_permit(None, None, None, degradable=True, headers={}))
    assert verdict == VersionVerdict(version=None, permit=None)
