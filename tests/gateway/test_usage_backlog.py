"""Usage records kept while Redis was away reach its queue once it is back, with no request to
carry them (serving.gateway.usage_backlog): before, only the next request's record pushed them, so
the last records of an outage waited, and a usage read after it missed them."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import redis
import redis.asyncio as aioredis
from resilience_support import redis_relay

from serving.gateway.key_budget import KeyBudgets, Month, counter_key
from serving.gateway.usage_backlog import UsageBacklog
from serving.contracts.usage_log import QUEUE_KEY, UsageEvent
from runtime.redis_guard import RedisGuard, RedisGuardConfig
from tests.worker_isolation import worker_redis_url


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

    # A database of this test's own, 8 above the xdist worker's: the web process an earlier file of
    # this worker left running (tests/gateway/conftest.py's session `web`) flushes the worker's
    # database's usage queue into PostgreSQL, and took these records from it once (CI, 15:35 UTC).
    url = worker_redis_url(settings.REDIS_URL, 8)
    redis.Redis.from_url(url).delete(QUEUE_KEY)
    with redis_relay(url) as relay:

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
                assert {e.record_id for e in kept} <= _queued_ids(url)
            finally:
                await client.aclose()

        asyncio.run(main())


def test_a_kept_record_keeps_its_budget_reservation_until_its_spend_lands() -> None:
    """A record Redis did not take keeps its call's reservation: while it waits, the key's tokens are
    held (reserved); once pushed, its spend lands and the reservation goes in the same round trip.
    Released at the outage instead, the tokens were neither spent nor reserved until the push."""
    from django.conf import settings

    with redis_relay(settings.REDIS_URL) as relay:

        async def main() -> None:
            client = aioredis.Redis.from_url(relay.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            guard = RedisGuard.from_config(RedisGuardConfig(timeout_s=0.25, retry_interval_s=0.2))
            budgets = KeyBudgets(client)
            prefix = f"backlog-{uuid.uuid4().hex[:8]}"
            record = replace(_event(), api_key_prefix=prefix)
            backlog = UsageBacklog(client, guard)
            try:
                async def no_records(start: float, before: float) -> int:
                    return 0

                verdict = await budgets.reserve(prefix, 100, 40, now=record.created_at, guard=guard,
                                                recorded=no_records)
                assert verdict is not None and verdict.reservation is not None
                relay.cut()
                backlog.keep([record], [verdict.reservation])
                await asyncio.sleep(0.5)  # the pusher retries while Redis is away
                relay.restore()
                pusher = backlog.pusher
                assert pusher is not None
                await asyncio.wait_for(pusher, timeout=10)
                assert backlog.reservations == []
                counter = counter_key(prefix, Month.of(record.created_at))
                tokens, reserved = await client.hmget(counter, "tokens", "reserved")
                assert (int(tokens), int(reserved)) == (5, 0)
            finally:
                await client.aclose()

        asyncio.run(main())
