"""Token buckets during a Redis outage: per process at the tier's rate / processes, then shared again."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis
from resilience_support import Clock, redis_relay

from serving.gateway.local_buckets import GuardedBuckets, LocalTokenBuckets
from serving.gateway.quotas import Bucket, TokenBuckets
from runtime.redis_guard import RedisGuard


def requests_bucket(rpm: int = 60) -> Bucket:
    return Bucket.per_minute(f"outage-{uuid.uuid4().hex[:8]}:requests", rpm, burst=2.0)


def test_local_buckets_admit_this_process_share_and_refill_at_its_rate() -> None:
    clock = Clock()
    local = LocalTokenBuckets(share=0.5, clock=clock)
    bucket = requests_bucket(60)  # capacity 120, 1 per second; this process: 60 and 0.5 per second
    admitted = [local.admit([(bucket, 1)]).admitted for _ in range(61)]
    assert admitted == [True] * 60 + [False]
    refused = local.admit([(bucket, 1)])
    assert refused.retry_after_s == pytest.approx(2.0)  # one token at 0.5 per second
    clock.advance(2.0)
    assert local.admit([(bucket, 1)]).admitted


def test_local_admission_takes_all_costs_or_none() -> None:
    local = LocalTokenBuckets(share=1.0, clock=Clock())
    requests, tokens = requests_bucket(60), Bucket.per_minute(f"outage-{uuid.uuid4().hex[:8]}:tokens", 100)
    assert local.admit([(requests, 1), (tokens, 150)]).admitted
    refused = local.admit([(requests, 1), (tokens, 100)])  # 50 tokens left
    assert not refused.admitted and refused.states[0].level == pytest.approx(119)
    local.refund(tokens, 100)
    assert local.admit([(requests, 1), (tokens, 100)]).admitted


def test_a_cut_redis_falls_back_at_once_and_shared_buckets_resume() -> None:
    from django.conf import settings

    with redis_relay(settings.REDIS_URL) as relay:

        async def main() -> None:
            client = aioredis.Redis.from_url(relay.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            guard = RedisGuard(timeout_s=0.25, retry_interval_s=0.3)
            buckets = GuardedBuckets(TokenBuckets(client), guard=guard, processes=4)
            bucket = requests_bucket(60)  # shared capacity 120; a process's share during an outage: 30
            try:
                for _ in range(100):
                    assert (await buckets.admit([(bucket, 1)])).admitted
                relay.cut()
                started = time.monotonic()
                outage = [(await buckets.admit([(bucket, 1)])).admitted for _ in range(31)]
                assert time.monotonic() - started < 2.0  # one bounded attempt, then local answers
                assert outage == [True] * 30 + [False] and not guard.available
                relay.restore()
                await asyncio.sleep(0.35)
                # Shared again: the 20 requests left in Redis (plus a second's refill), not a fresh
                # local share of 30.
                back = [(await buckets.admit([(bucket, 1)])).admitted for _ in range(40)]
                assert guard.available and 20 <= back.count(True) <= 24
            finally:
                await client.aclose()

        asyncio.run(main())
