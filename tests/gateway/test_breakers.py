"""Circuit breakers in resilience4j's style: the state machine under an injected clock.

Every rule runs twice: against the Lua script in a real Redis (shared state) and against the
process-local fallback a gateway uses while Redis is unreachable (reached here the real way, by
pointing the breakers at a port where no Redis listens), so both answer alike. Then two processes
share one breaker, and a Redis cut off mid-traffic is survived and rejoined.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from resilience_support import Clock, dead_redis_url, redis_relay

from runtime.breakers import BreakerConfig, CircuitBreakers, Outcome, State
from runtime.redis_guard import RedisGuard
from tests.conftest import SLOW_REDIS_S

REPO = Path(__file__).resolve().parents[2]
S, F, I = Outcome.SUCCESS, Outcome.FAILURE, Outcome.IGNORED


@pytest.fixture(scope="module")
def shared_redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


@pytest.fixture(params=["redis", "local"])
def backend(request, shared_redis_url: str) -> str:
    return shared_redis_url if request.param == "redis" else dead_redis_url()


def run(redis_url: str, body: Callable[[CircuitBreakers, Clock, str], Awaitable[None]],
        config: BreakerConfig | None = None) -> None:
    """Runs `body(breakers, clock, name)` on a fresh breaker name in its own event loop."""

    async def main() -> None:
        # Timeouts far above a loaded CI machine's Redis round trip: one call timed out at 0.5 s there,
        # the guard took Redis for down and the permit came from the local fallback. (The dead URL is
        # refused at once, so the local backend does not wait for them.)
        client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
        clock = Clock()
        breakers = CircuitBreakers(client, config or BreakerConfig(), guard=RedisGuard(timeout_s=SLOW_REDIS_S),
                                   clock=clock)
        try:
            await body(breakers, clock, f"t/adapter-{uuid.uuid4().hex[:8]}@1.0.0")
        finally:
            await client.aclose()

    asyncio.run(main())


async def calls(breakers: CircuitBreakers, name: str, outcomes: list[Outcome], duration_s: float = 0.01):
    """Acquires and records one call per outcome; the last snapshot."""
    snapshot = None
    for outcome in outcomes:
        permit = await breakers.acquire(name)
        assert permit.allowed, f"call refused while {permit.state}"
        snapshot = await breakers.record(permit, outcome, duration_s)
    return snapshot


async def open_breaker(breakers: CircuitBreakers, name: str) -> None:
    snapshot = await calls(breakers, name, [F] * 50)
    assert snapshot.transition is State.OPEN


def test_minimum_calls_before_the_rate_counts(backend: str, shared_redis_url: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        snapshot = await calls(breakers, name, [F] * 49)
        assert snapshot.state is State.CLOSED and snapshot.calls == 49 and snapshot.failures == 49
        snapshot = await calls(breakers, name, [F])
        assert snapshot.transition is State.OPEN
        # The figures of the window that opened it, for the audit reason.
        assert (snapshot.calls, snapshot.failures, snapshot.failure_rate) == (50, 50, 1.0)
        permit = await breakers.acquire(name)
        assert not permit.allowed and permit.state is State.OPEN
        assert permit.retry_after_s == pytest.approx(30.0)
        assert permit.shared is (backend == shared_redis_url)
        # While open, its snapshot reports the window that opened it (for the canary guard's reason).
        later = await breakers.snapshot(name)
        assert (later.state, later.transition, later.calls, later.failures) == (State.OPEN, None, 50, 50)

    run(backend, body)


def test_failure_rate_must_pass_the_threshold(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        snapshot = await calls(breakers, name, [S] * 70 + [F] * 30)
        assert snapshot.state is State.CLOSED and snapshot.failure_rate == pytest.approx(0.30)
        # The window is full: this failure pushes out the oldest success, 31 of 100.
        snapshot = await calls(breakers, name, [F])
        assert snapshot.transition is State.OPEN and (snapshot.calls, snapshot.failures) == (100, 31)

    run(backend, body)


def test_window_slides_over_the_last_calls(backend: str) -> None:
    config = BreakerConfig(window_size=10, minimum_calls=10)

    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        snapshot = await calls(breakers, name, [F] * 3 + [S] * 7)
        assert snapshot.state is State.CLOSED and snapshot.failures == 3
        # Each new failure replaces one of the three oldest (failed) calls: still 3 of 10.
        snapshot = await calls(breakers, name, [F] * 3)
        assert snapshot.state is State.CLOSED and (snapshot.calls, snapshot.failures) == (10, 3)
        snapshot = await calls(breakers, name, [F])  # replaces a success: 4 of 10
        assert snapshot.transition is State.OPEN

    run(backend, body, config)


def test_client_errors_are_ignored(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        snapshot = await calls(breakers, name, [F] * 49 + [I] * 100)
        assert snapshot.state is State.CLOSED and snapshot.calls == 49

    run(backend, body)


def test_slow_calls_open_it_as_failures_do(backend: str) -> None:
    config = BreakerConfig(slow_call_duration_s=2.0, slow_call_rate_threshold=0.5)

    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await calls(breakers, name, [S] * 25, duration_s=0.1)
        snapshot = await calls(breakers, name, [S] * 25, duration_s=2.0)
        assert snapshot.state is State.CLOSED and snapshot.slow_call_rate == pytest.approx(0.5)
        snapshot = await calls(breakers, name, [S], duration_s=5.0)  # 26 slow of 51
        assert snapshot.transition is State.OPEN and snapshot.failures == 0 and snapshot.slow_calls == 26

    run(backend, body, config)


def test_open_then_half_open_after_the_cooldown_with_five_permits(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await open_breaker(breakers, name)
        clock.advance(29.5)
        permit = await breakers.acquire(name)
        assert not permit.allowed and permit.retry_after_s == pytest.approx(0.5)
        clock.advance(0.5)
        permits = [await breakers.acquire(name) for _ in range(6)]
        assert [p.allowed for p in permits] == [True] * 5 + [False]
        assert {p.state for p in permits} == {State.HALF_OPEN}
        assert permits[5].retry_after_s > 0

    run(backend, body)


def test_half_open_closes_when_every_trial_succeeds(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await open_breaker(breakers, name)
        clock.advance(30)
        permits = [await breakers.acquire(name) for _ in range(5)]
        for permit in permits[:4]:
            assert (await breakers.record(permit, S, 0.01)).state is State.HALF_OPEN
        snapshot = await breakers.record(permits[4], S, 0.01)
        assert snapshot.transition is State.CLOSED
        after = await breakers.snapshot(name)
        assert after.state is State.CLOSED and after.calls == 0  # a fresh window
        assert (await breakers.acquire(name)).allowed

    run(backend, body)


@pytest.mark.parametrize("failure", ["error", "slow"])
def test_half_open_reopens_on_one_failed_or_slow_trial(backend: str, failure: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await open_breaker(breakers, name)
        clock.advance(30)
        first, second = await breakers.acquire(name), await breakers.acquire(name)
        await breakers.record(first, S, 0.01)
        outcome, duration = (F, 0.01) if failure == "error" else (S, 31.0)
        snapshot = await breakers.record(second, outcome, duration)
        assert snapshot.transition is State.OPEN
        permit = await breakers.acquire(name)
        assert not permit.allowed and permit.retry_after_s == pytest.approx(30.0)  # a new cool-down

    run(backend, body)


def test_outcome_of_an_earlier_state_is_dropped(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        late = await breakers.acquire(name)  # let through while closed
        await open_breaker(breakers, name)
        clock.advance(30)
        trials = [await breakers.acquire(name) for _ in range(5)]
        # The late call ends now: it is no trial, so it neither closes nor reopens the breaker.
        snapshot = await breakers.record(late, F, 0.01)
        assert snapshot.state is State.HALF_OPEN and snapshot.transition is None
        for trial in trials:
            snapshot = await breakers.record(trial, S, 0.01)
        assert snapshot.transition is State.CLOSED

    run(backend, body)


def test_ignored_trial_gives_its_permit_back(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await open_breaker(breakers, name)
        clock.advance(30)
        trials = [await breakers.acquire(name) for _ in range(5)]
        assert not (await breakers.acquire(name)).allowed
        await breakers.record(trials[0], I, 0.01)  # the client's 400: no verdict on the adapter
        assert (await breakers.acquire(name)).allowed

    run(backend, body)


def test_trials_that_never_report_are_reissued_after_a_cooldown(backend: str) -> None:
    async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
        await open_breaker(breakers, name)
        clock.advance(30)
        lost = [await breakers.acquire(name) for _ in range(5)]  # their gateway process died
        clock.advance(29)
        assert not (await breakers.acquire(name)).allowed
        clock.advance(1)
        fresh = [await breakers.acquire(name) for _ in range(5)]
        assert all(p.allowed for p in fresh) and fresh[0].epoch > lost[0].epoch
        for trial in fresh:
            snapshot = await breakers.record(trial, S, 0.01)
        assert snapshot.transition is State.CLOSED

    run(backend, body)


def test_config_refuses_impossible_thresholds() -> None:
    with pytest.raises(ValueError, match="minimum_calls"):
        BreakerConfig(window_size=10, minimum_calls=20)
    with pytest.raises(ValueError, match="failure_rate_threshold"):
        BreakerConfig(failure_rate_threshold=30)


# --- shared between processes ----------------------------------------------------------------

_CHILD = """
import asyncio, json, sys
import redis.asyncio as aioredis
from runtime.breakers import BreakerConfig, CircuitBreakers, Outcome
from runtime.redis_guard import RedisGuard

url, name, action, now = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

async def main():
    client = aioredis.Redis.from_url(url)
    breakers = CircuitBreakers(client, BreakerConfig(), guard=RedisGuard(timeout_s=2), clock=lambda: now)
    out = []
    if action == "fail":
        for _ in range(50):
            permit = await breakers.acquire(name)
            out.append((await breakers.record(permit, Outcome.FAILURE, 0.01)).state.value)
    else:
        for _ in range(20):
            out.append((await breakers.acquire(name)).allowed)
    await client.aclose()
    print(json.dumps(out))

asyncio.run(main())
"""


def _child(url: str, name: str, action: str, now: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, url, name, action, repr(now)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)


def _result(child: subprocess.Popen) -> list:
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0
    return json.loads(out)


@pytest.mark.e2e
def test_two_processes_see_one_breaker(shared_redis_url: str) -> None:
    name = f"t/shared-{uuid.uuid4().hex[:8]}@1.0.0"
    start = time.time()
    assert _result(_child(shared_redis_url, name, "fail", start))[-1] == "open"

    async def body(breakers: CircuitBreakers, clock: Clock, _: str) -> None:
        clock.now = start + 1
        permit = await breakers.acquire(name)
        assert not permit.allowed and permit.state is State.OPEN and permit.shared

    run(shared_redis_url, body)
    # After the cool-down, two processes race for the half-open trials: five in all, not ten.
    racers = [_child(shared_redis_url, name, "acquire", start + 31) for _ in range(2)]
    granted = sum(sum(_result(child)) for child in racers)
    assert granted == 5


# --- Redis away and back ---------------------------------------------------------------------


def test_redis_cut_off_falls_back_to_local_breakers_and_rejoins(shared_redis_url: str) -> None:
    with redis_relay(shared_redis_url) as relay:

        async def body(breakers: CircuitBreakers, clock: Clock, name: str) -> None:
            await open_breaker(breakers, name)  # shared: open in Redis
            relay.cut()
            started = time.monotonic()
            permit = await breakers.acquire(name)
            # Bounded: one attempt of at most the guard's timeout, then the local breaker answers.
            assert time.monotonic() - started < 2.0
            assert permit.allowed and not permit.shared and permit.state is State.CLOSED
            assert breakers._guard.available is False
            # Local breakers count on their own, with the same thresholds.
            await breakers.record(permit, F, 0.01)
            snapshot = await calls(breakers, name, [F] * 49)
            assert snapshot.transition is State.OPEN and not snapshot.shared
            relay.restore()
            await asyncio.sleep(breakers._guard.retry_interval_s)
            permit = await breakers.acquire(name)
            # Shared state again: the breaker that was open in Redis before the outage.
            assert permit.shared and permit.state is State.OPEN and breakers._guard.available

        async def main() -> None:
            client = aioredis.Redis.from_url(relay.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            clock = Clock(time.time())
            breakers = CircuitBreakers(client, BreakerConfig(), guard=RedisGuard(retry_interval_s=0.3),
                                       clock=clock)
            try:
                await body(breakers, clock, f"t/outage-{uuid.uuid4().hex[:8]}@1.0.0")
            finally:
                await client.aclose()

        asyncio.run(main())
