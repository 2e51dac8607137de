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

from serving.gateway.usage_backlog import UsageBacklog
from serving.contracts.usage_log import QUEUE_KEY, UsageEvent
from runtime.redis_guard import RedisGuard, RedisGuardConfig


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
            guard = RedisGuard.from_config(RedisGuardConfig(timeout_s=0.25, retry_interval_s=0.2))
            backlog = UsageBacklog(client, guard)
            kept = [_event(), _event()]
            try:
                relay.cut()
                backlog.keep(kept[:1])
                backlog.keep(kept[1:])
                pusher = backlog.pusher
                assert pusher is not None and not pusher.done(), "one pusher, started by the first record kept"
                await asyncio.sleep(0.6)  # retries while Redis is away: the records stay kept
                assert [e.record_id for e in backlog.events] == [e.record_id for e in kept]
                assert not pusher.done()
                relay.restore()
                await asyncio.wait_for(pusher, timeout=10)
                assert backlog.events == []
                assert {e.record_id for e in kept} <= _queued_ids(settings.REDIS_URL)
            finally:
                await client.aclose()

        asyncio.run(main())
