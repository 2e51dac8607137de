"""Usage records kept while Redis was away reach its queue once it is back, with no request to
carry them (serving.gateway.usage_backlog): before, only the next request's record pushed them, so
the last records of an outage waited, and a usage read after it missed them."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis
import redis.asyncio as aioredis
from resilience_support import redis_relay

from serving.gateway.canary_rule import CanaryRuleConfig
from serving.gateway.outliers import OutlierConfig
from serving.gateway.prewarm import PrewarmConfig
from serving.gateway.resilience import Resilience
from serving.gateway.shedding import ShedConfig
from serving.gateway.usage_backlog import keep_usage
from serving.gateway.usage_log import QUEUE_KEY, UsageEvent
from serving.gateway.version_pick import ServedVersion
from serving.wire.breakers import BreakerConfig
from serving.wire.redis_guard import RedisGuardConfig


async def _never_abort(version: ServedVersion, reason: str) -> bool:
    return False


def _event() -> UsageEvent:
    return UsageEvent(request_id=f"req-{uuid.uuid4().hex[:8]}", tenant_id=1, api_key_prefix="backlog-test",
                      endpoint="chat.completions", model="m", adapter="", version="", prompt_tokens=3,
                      completion_tokens=2, status="ok", http_status=200, latency_ms=9.0, ttft_ms=None, degraded=False,
                      worker="w1", created_at=time.time())  # fmt: skip


def _queued_ids(url: str) -> set[str]:
    client = redis.Redis.from_url(url)
    try:
        return {UsageEvent.loads(raw).record_id for raw in client.lrange(QUEUE_KEY, 0, -1)}
    finally:
        client.close()


def test_records_kept_during_an_outage_are_pushed_once_redis_is_back_without_a_request() -> None:
    from django.conf import settings

    with redis_relay(settings.REDIS_URL) as relay:

        async def main() -> None:
            client = aioredis.Redis.from_url(relay.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            resilience = Resilience.build(
                client, redis_guard=RedisGuardConfig(timeout_s=0.25, retry_interval_s=0.2), breakers=BreakerConfig(),
                outliers=OutlierConfig(), prewarm=PrewarmConfig(), canary_rule=CanaryRuleConfig(), shed=ShedConfig(),
                canary_abort=_never_abort)  # fmt: skip
            kept = [_event(), _event()]
            try:
                relay.cut()
                keep_usage(kept[:1], resilience, client)
                keep_usage(kept[1:], resilience, client)
                pusher = resilience.backlog_pusher
                assert pusher is not None and not pusher.done(), "one pusher, started by the first record kept"
                await asyncio.sleep(0.6)  # retries while Redis is away: the records stay kept
                assert [e.record_id for e in resilience.usage_backlog] == [e.record_id for e in kept]
                assert not pusher.done()
                relay.restore()
                await asyncio.wait_for(pusher, timeout=10)
                assert resilience.usage_backlog == []
                assert {e.record_id for e in kept} <= _queued_ids(settings.REDIS_URL)
            finally:
                await client.aclose()

        asyncio.run(main())
