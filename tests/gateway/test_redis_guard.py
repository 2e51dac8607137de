"""The guard on hot-path Redis calls: bounded, skips Redis after a failure, one probe at a time."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, ResponseError
from resilience_support import Clock

from runtime.redis_guard import RedisGuard


def test_a_stalled_redis_costs_one_timeout_then_nothing_until_the_retry_interval() -> None:
    clock = Clock()
    changes: list[bool] = []
    guard = RedisGuard(timeout_s=0.05, retry_interval_s=1.0, clock=clock, on_change=changes.append)
    calls = 0

    async def stalled() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(10)
        return "never"

    async def ok() -> str:
        return "pong"

    async def main() -> None:
        started = time.monotonic()
        assert await guard.call("stalled", stalled) is None
        assert time.monotonic() - started < 1.0 and not guard.available
        # Within the retry interval Redis is not even tried.
        assert await guard.call("skipped", stalled) is None and calls == 1
        clock.advance(1.0)
        assert await guard.call("probe", ok) == "pong" and guard.available

    asyncio.run(main())
    assert changes == [False, True] and guard.outage_calls == 2


def test_one_probe_at_a_time_while_redis_is_away() -> None:
    clock = Clock()
    guard = RedisGuard(timeout_s=0.5, retry_interval_s=1.0, clock=clock)
    probes = 0

    async def refused() -> None:
        raise ConnectionError("refused")

    async def slow_refusal() -> None:
        nonlocal probes
        probes += 1
        await asyncio.sleep(0.1)
        raise ConnectionError("refused")

    async def main() -> None:
        assert await guard.call("first", refused) is None
        clock.advance(1.0)
        results = await asyncio.gather(*(guard.call("probe", slow_refusal) for _ in range(10)))
        assert results == [None] * 10 and probes == 1

    asyncio.run(main())


def test_a_script_error_is_a_bug_not_an_outage() -> None:
    from django.conf import settings

    async def main() -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        guard = RedisGuard()
        try:
            with pytest.raises(ResponseError):
                await guard.call("bad script", lambda: client.eval("return redis.call('NOPE')", 0))
            assert guard.available
        finally:
            await client.aclose()

    asyncio.run(main())
