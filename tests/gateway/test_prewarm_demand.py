"""Predicted adapter demand in Redis: EWMA rate and hour-of-day profile, under an injected clock."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
import redis.asyncio as aioredis

from serving.gateway import prewarm
from serving.gateway.prewarm import DemandModel, PrewarmConfig

DAY = 86400.0
CONFIG = PrewarmConfig(tau_s=300, daily_decay=0.5, lookahead_s=900, prior_s=3600)


@pytest.fixture
def isolated(monkeypatch):
    """Keys of this test only (the Redis DB is shared with other suites)."""
    prefix = f"loraplex:prewarm-test-{uuid.uuid4().hex[:8]}:"
    monkeypatch.setattr(prewarm, "EWMA_KEY", prefix + "ewma")
    monkeypatch.setattr(prewarm, "HOUR_KEY", prefix + "hour:")
    return prefix


def run(body) -> None:
    from django.conf import settings

    async def main() -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            await body(DemandModel(client, CONFIG))
        finally:
            keys = [key async for key in client.scan_iter(match=f"{prewarm.EWMA_KEY.rsplit(':', 1)[0]}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    asyncio.run(main())


def test_ewma_is_the_decayed_rate(isolated) -> None:
    async def body(model: DemandModel) -> None:
        start = 10 * DAY + 3 * 3600
        await model.record("t/a@1", start)
        assert (await model.observed(start))["t/a@1"].recent == pytest.approx(1 / 300)
        assert (await model.observed(start + 300))["t/a@1"].recent == pytest.approx(math.exp(-1) / 300)
        # A steady 2 requests per second for 6 tau reads 2 per second (within 1 - e^-6).
        for i in range(3600):
            await model.record("t/b@1", start + i * 0.5)
        observed = await model.observed(start + 3600 * 0.5)
        assert observed["t/b@1"].recent == pytest.approx(2.0, rel=0.005)
        # The prediction: this hour's profile (3,600 requests so far) as the prior, worth 3600 s,
        # and the EWMA's evidence (rate × tau) over tau.
        b = observed["t/b@1"]
        assert b.hourly == pytest.approx(3600 * 0.5 / 3600)
        rates = await model.predicted_rates(start + 3600 * 0.5)
        assert rates["t/b@1"] == pytest.approx((b.hourly * 3600 + b.recent * 300) / 3900)

    run(body)


def test_hourly_profile_predicts_the_morning_before_it_starts(isolated) -> None:
    async def body(model: DemandModel) -> None:
        nine = 3 * DAY + 9 * 3600
        for i in range(360):  # yesterday 09:00–10:00, one request every 10 s
            await model.record("t/morning@1", nine + i * 10)
        for i in range(36):
            await model.record("t/steady@1", nine + 12 * 3600 + i * 100)  # busy at 21:00
        before = nine + DAY - 600  # 08:50 the next day: the EWMA is long gone
        observed = await model.observed(before)
        assert observed["t/morning@1"].hourly == pytest.approx(360 * 0.5 / 3600)
        # The EWMA is long gone: the prediction is the prior's share of the profile.
        rates = await model.predicted_rates(before)
        assert rates["t/morning@1"] == pytest.approx(360 * 0.5 / 3600 * 3600 / 3900)
        top = await model.top(1, before)
        assert top[0][0] == "t/morning@1"
        # Two days later with no 09:00 traffic since, yesterday's profile counts for half.
        later = await model.observed(before + DAY)
        assert later["t/morning@1"].hourly == pytest.approx(360 * 0.25 / 3600)

    run(body)


def test_a_new_day_decays_that_hours_counts(isolated) -> None:
    async def body(model: DemandModel) -> None:
        nine = 5 * DAY + 9 * 3600
        for _ in range(100):
            await model.record("t/old@1", nine)
        await model.record("t/new@1", nine + DAY)  # the first 09:00 request of the next day
        observed = await model.observed(nine + 2 * DAY - 600)  # 08:50 the day after, looking at 09:05
        assert observed["t/old@1"].hourly == pytest.approx(100 * 0.5 * 0.5 / 3600)
        assert observed["t/new@1"].hourly == pytest.approx(1 * 0.5 / 3600)

    run(body)


def test_a_one_off_request_does_not_outrank_a_steady_adapter_at_its_hour(isolated) -> None:
    async def body(model: DemandModel) -> None:
        nine = 7 * DAY + 9 * 3600
        for day in range(3):  # three mornings of 6 requests between 09:00 and 10:00
            for i in range(6):
                await model.record("t/steady@1", nine + day * DAY + i * 600)
        now = nine + 3 * DAY - 600  # 08:50 the next morning
        await model.record("t/once@1", now - 60)  # one request a minute ago
        observed = await model.observed(now)
        # The bare EWMA of the one request (~10 an hour) reads above the steady adapter's profile
        # (~5 an hour): the rule before ranked the one-off first.
        assert observed["t/once@1"].recent > observed["t/steady@1"].hourly
        assert [name for name, _ in await model.top(2, now)] == ["t/steady@1", "t/once@1"]
        # A burst is evidence: 30 requests in the last few minutes do outrank the profile.
        for i in range(30):
            await model.record("t/burst@1", now - 300 + i * 10)
        assert (await model.top(1, now))[0][0] == "t/burst@1"

    run(body)
