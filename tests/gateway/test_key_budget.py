"""A key's monthly spend counter on a real Redis (serving.gateway.key_budget): the month's bounds,
records adding up in their own month, the seed from the usage records added exactly once, and a
Redis that is away failing open; and the request's buckets (serving.gateway.request_buckets): the
key's beside the tenant's, the headers of the tightest, the 429 naming the short one."""

from __future__ import annotations

import asyncio
import calendar
import time
import uuid

import redis.asyncio as aioredis

from serving.gateway.key_budget import KeyBudgets, Month, counter_key, spend_add
from serving.gateway.quotas import TokenBuckets
from serving.gateway.records import Caller, KeyControls, TierLimits
from serving.gateway.request_buckets import RequestBuckets
from runtime.redis_guard import RedisGuard
from tests.conftest import SLOW_REDIS_S

# Counters expire a week after their month, so the Redis tests use this month and the next.
THIS_MONTH = Month.of(time.time())
LAST_SECOND = THIS_MONTH.end - 1
MID_NEXT = THIS_MONTH.end + 14 * 86_400
TIER = TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
                  priority=1, degradation_allowed=True)


def redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


def test_a_month_runs_from_its_first_second_to_the_next_months():
    january = Month.of(calendar.timegm((2027, 1, 15, 12, 0, 0)))
    assert (january.name, january.start, january.end) == (
        "2027-01", calendar.timegm((2027, 1, 1, 0, 0, 0)), calendar.timegm((2027, 2, 1, 0, 0, 0)))
    december = Month.of(calendar.timegm((2026, 12, 31, 23, 59, 59)))
    assert december.name == "2026-12" and december.end == january.start
    assert december.iso_end() == "2027-01-01T00:00:00Z"
    assert Month.of(january.start).name == "2027-01"


def test_records_add_up_in_their_own_months_counter_and_the_seed_is_added_once(redis_client):
    prefix = uuid.uuid4().hex[:12]
    asked: list[tuple[float, float]] = []

    async def recorded(start: float, before: float) -> int:
        asked.append((start, before))
        return 1_000

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        budgets, guard = KeyBudgets(client), RedisGuard(timeout_s=SLOW_REDIS_S)
        try:
            async with client.pipeline(transaction=False) as pipe:
                spend_add(pipe, prefix, 30, MID_NEXT)
                spend_add(pipe, prefix, 12, MID_NEXT + 60)
                spend_add(pipe, prefix, 500, LAST_SECOND)  # last month's: another counter
                spend_add(pipe, prefix, 0, MID_NEXT)  # nothing used: nothing written
                await pipe.execute()
            assert await budgets.read(prefix, now=MID_NEXT + 120) == (42, MID_NEXT, False)
            # Unseeded: the records of the month before the counter's first record are added.
            verdict = await budgets.reserve(prefix, 10**6, 5, now=MID_NEXT + 120, guard=guard, recorded=recorded)
            assert verdict is not None and verdict.reservation is not None
            assert verdict.spend.tokens == 1_042 and verdict.spend.month.name == Month.of(MID_NEXT).name
            assert asked == [(Month.of(MID_NEXT).start, MID_NEXT)]
            # Seeded once: later reads never ask the records again, whoever seeded.
            again = await budgets.reserve(prefix, 10**6, 5, now=MID_NEXT + 180, guard=guard, recorded=recorded)
            assert again is not None and (again.spend.tokens, again.spend.reserved) == (1_042, 5)
            assert await budgets.seed(prefix, 1_000, now=MID_NEXT + 180) == 1_042
            assert len(asked) == 1
            # Kept a week past the month's end (a record held back while Redis was away may still land).
            ttl_s = await client.ttl(counter_key(prefix, Month.of(MID_NEXT)))
            assert abs(ttl_s - (Month.of(MID_NEXT).end + 7 * 86_400 - time.time())) < 60
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_key_with_no_counter_yet_is_seeded_from_all_of_the_months_records_up_to_now(redis_client):
    prefix = uuid.uuid4().hex[:12]
    asked: list[tuple[float, float]] = []

    async def recorded(start: float, before: float) -> int:
        asked.append((start, before))
        return 7

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        try:
            verdict = await KeyBudgets(client).reserve(prefix, 100, 5, now=MID_NEXT,
                                                       guard=RedisGuard(timeout_s=SLOW_REDIS_S), recorded=recorded)
        finally:
            await client.aclose()
        assert verdict is not None and verdict.spend.tokens == 7 and verdict.reservation is not None
        assert asked == [(Month.of(MID_NEXT).start, MID_NEXT)]

    asyncio.run(scenario())


def test_redis_away_answers_none():
    async def recorded(start: float, before: float) -> int:
        raise AssertionError("the records are not read while Redis is away")

    async def scenario() -> None:
        from tests.conftest import free_port

        client = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2)
        try:
            assert await KeyBudgets(client).reserve("abc", 100, 5, now=MID_NEXT, guard=RedisGuard(),
                                                    recorded=recorded) is None
        finally:
            await client.aclose()

    asyncio.run(scenario())


def caller(**key: int) -> Caller:
    return Caller(tenant_id=1, tenant=f"t-{uuid.uuid4().hex[:8]}", key_prefix=uuid.uuid4().hex[:12], tier=TIER,
                  key=KeyControls(**key))


def test_a_key_without_limits_takes_only_the_tenants_buckets():
    buckets = RequestBuckets.of(caller(), 2.0)
    assert [bucket.key for bucket, _ in buckets.costs(tokens=10)] == [
        buckets.requests[0].key, buckets.tokens[0].key]
    assert buckets.degraded_costs() == [(buckets.degraded, 1.0)]


def test_a_keys_own_rpm_is_short_first_named_in_the_headers_and_never_degraded(redis_client):
    limited = caller(requests_per_minute=1, tokens_per_minute=10_000)
    buckets = RequestBuckets.of(limited, 2.0)
    assert len(buckets.requests) == len(buckets.tokens) == 2
    assert [cost for _, cost in buckets.degraded_costs()] == [1.0, 1.0]  # a degraded request counts on the key

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        try:
            shared = TokenBuckets(client)
            admissions = [await shared.admit(buckets.costs(tokens=5), now=1000.0) for _ in range(3)]
        finally:
            await client.aclose()
        assert [admission.admitted for admission in admissions] == [True, True, False]
        # The key's 1 rpm (2 with the burst) is the tightest: the headers are its bucket's.
        headers = buckets.headers(admissions[1])
        assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-limit-tokens"] == "20000"  # the key's tpm, below the tier's 51,200
        refused = admissions[2]
        assert buckets.key_short(refused)
        assert buckets.describe(buckets.shortest(refused)) == (
            f"API key lp-{limited.key_prefix}… (its own limit: 1 requests per minute)")

    asyncio.run(scenario())


def test_the_tenants_bucket_short_is_the_tiers_and_may_degrade(redis_client):
    tenant_short = caller(requests_per_minute=200)
    buckets = RequestBuckets.of(tenant_short, 2.0)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        try:
            refused = await TokenBuckets(client).admit(buckets.costs(tokens=10**9), now=1000.0)
        finally:
            await client.aclose()
        assert not refused.admitted and not buckets.key_short(refused)
        assert buckets.describe(buckets.shortest(refused)) == (
            f"tenant '{tenant_short.tenant}' ('standard' tier: 51200 tokens per minute)")

    asyncio.run(scenario())
