"""Token buckets on a real Redis: exact admission under concurrency from several processes, exact
refill under an injected clock, all-or-nothing reservations, refunds, and OpenAI's header format."""

from __future__ import annotations

import asyncio
import multiprocessing
import uuid

import pytest
import redis.asyncio as aioredis

from serving.gateway.quotas import Bucket, TokenBuckets, format_reset, ratelimit_headers


def redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


def run(coroutine):
    return asyncio.run(coroutine)


async def _admit_many(url: str, key: str, count: int, now: float) -> int:
    client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=64))
    buckets = TokenBuckets(client)
    # A rate too small to refill anything while the burst runs: only the capacity is shared out.
    bucket = Bucket(key=key, capacity=100, rate=1e-9)
    try:
        results = await asyncio.gather(*(buckets.admit([(bucket, 1)], now=now) for _ in range(count)))
    finally:
        await client.aclose()
    return sum(result.admitted for result in results)


def _admit_in_process(args: tuple[str, str, int, float]) -> int:
    return asyncio.run(_admit_many(*args))


@pytest.mark.e2e
@pytest.mark.parametrize("attempt", range(3))
def test_1000_concurrent_admissions_from_4_processes_admit_exactly_the_capacity(redis_client, attempt):
    key = f"loraplex:gateway:bucket:test-{uuid.uuid4().hex}"
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        admitted = pool.map(_admit_in_process, [(redis_url(), key, 250, 1000.0)] * 4)
    assert sum(admitted) == 100


def test_refill_is_exact_under_an_injected_clock(redis_client):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        buckets = TokenBuckets(client)
        bucket = Bucket(key=f"loraplex:gateway:bucket:{uuid.uuid4().hex}", capacity=10, rate=2.0)
        first = await buckets.admit([(bucket, 10)], now=100.0)
        assert first.admitted and first.states[0].level == 0.0 and first.states[0].reset_s == 5.0
        refused = await buckets.admit([(bucket, 3)], now=101.0)  # 2 tokens back after 1 s
        assert not refused.admitted and refused.states[0].level == 2.0 and refused.retry_after_s == 0.5
        assert (await buckets.admit([(bucket, 3)], now=101.5)).admitted
        later = await buckets.admit([(bucket, 1)], now=200.0)  # never above capacity
        assert later.admitted and later.states[0].level == 9.0
        await client.aclose()

    run(scenario())


def test_a_reservation_takes_from_every_bucket_or_from_none(redis_client):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        buckets = TokenBuckets(client)
        requests = Bucket(key=f"loraplex:gateway:bucket:{uuid.uuid4().hex}", capacity=5, rate=1.0)
        tokens = Bucket(key=f"loraplex:gateway:bucket:{uuid.uuid4().hex}", capacity=100, rate=1.0)
        assert (await buckets.admit([(requests, 1), (tokens, 80)], now=0.0)).admitted
        refused = await buckets.admit([(requests, 1), (tokens, 80)], now=0.0)
        assert not refused.admitted
        # The requests bucket had room but gave nothing, as the tokens bucket had none.
        assert [state.level for state in refused.states] == [4.0, 20.0]
        assert refused.retry_after_s == 60.0 and refused.states[0].wait_s == 0.0
        assert (await buckets.admit([(requests, 1), (tokens, 20)], now=0.0)).states[0].level == 3.0
        await client.aclose()

    run(scenario())


def test_refunds_give_back_up_to_capacity_and_negative_refunds_charge(redis_client):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        buckets = TokenBuckets(client)
        bucket = Bucket(key=f"loraplex:gateway:bucket:{uuid.uuid4().hex}", capacity=100, rate=1.0)
        await buckets.admit([(bucket, 90)], now=10.0)
        assert await buckets.refund(bucket, 40, now=10.0) == 50.0
        assert await buckets.refund(bucket, 500, now=10.0) == 100.0
        assert await buckets.refund(bucket, -130, now=10.0) == -30.0
        refused = await buckets.admit([(bucket, 10)], now=20.0)
        assert not refused.admitted and refused.retry_after_s == 30.0
        await client.aclose()

    run(scenario())


def test_an_idle_bucket_expires_once_it_would_be_full(redis_client):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        bucket = Bucket(key=f"loraplex:gateway:bucket:{uuid.uuid4().hex}", capacity=10, rate=5.0)
        await TokenBuckets(client).admit([(bucket, 10)])
        assert 1000 <= await client.pttl(bucket.key) <= 3000
        await client.aclose()

    run(scenario())


def test_per_minute_buckets_hold_twice_the_rate():
    bucket = Bucket.per_minute("t:requests", 200)
    assert bucket.capacity == 400 and bucket.rate == pytest.approx(200 / 60)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.012, "12ms"), (0.0001, "1ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"), (59.999, "59.999s"),
    (3725, "1h2m5s"), (0, "0s"),
])
def test_reset_durations_are_formatted_as_openai_does(seconds, text):
    assert format_reset(seconds) == text


def test_ratelimit_headers_name_limit_remaining_and_reset():
    from serving.gateway.quotas import BucketState

    requests = BucketState(bucket=Bucket.per_minute("r", 60), level=119.6, wait_s=0)
    tokens = BucketState(bucket=Bucket.per_minute("t", 6000), level=0.0, wait_s=3)
    assert ratelimit_headers(requests, tokens) == {
        "x-ratelimit-limit-requests": "120", "x-ratelimit-remaining-requests": "119",
        "x-ratelimit-reset-requests": "400ms", "x-ratelimit-limit-tokens": "12000",
        "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2m0s",
    }
