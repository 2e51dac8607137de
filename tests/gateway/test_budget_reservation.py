"""A key's monthly budget reserved before admission and settled after (serving.gateway.key_budget,
serving.gateway.pipeline.key_budget_check), on a real Redis: concurrent requests see each other's
reservations, so the month's spend passes the budget by at most one request's reservation (issue 37:
200 concurrent requests on a 250-token budget had used 4,390); a spend equal to the budget is
refused; a release comes after the spend it settles; a reservation never released lapses."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from serving.gateway import pipeline
from serving.gateway.accounting import COMPLETION_TOKENS, most_tokens, release_after
from serving.gateway.errors import GatewayError
from serving.gateway.key_budget import RESERVATION_HOLD_S, KeyBudgets, Month, Reservation, counter_key, spend_add
from serving.gateway.records import Call, Caller, KeyControls, Target, TierLimits
from runtime.redis_guard import RedisGuard
from tests.conftest import SLOW_REDIS_S

TIER = TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
                  priority=1, degradation_allowed=True)
NOW = Month.of(time.time()).start + 3600.0  # this month: counters expire a week after it


def redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


async def nothing_recorded(start: float, before: float) -> int:
    return 0


def budgeted(budget: int) -> Caller:
    return Caller(tenant_id=1, tenant="t", key_prefix=uuid.uuid4().hex[:12], tier=TIER,
                  key=KeyControls(monthly_token_budget=budget))


def resources(client: aioredis.Redis) -> SimpleNamespace:
    """What key_budget_check reads of the pipeline's Resources."""
    # A minute's patience: 200 Lua calls at once on a loaded CI machine can outlast the gateway's
    # default timeout, and a guard that gives up fails open, which is not what these tests are about.
    return SimpleNamespace(key_budgets=KeyBudgets(client), resilience=SimpleNamespace(guard=RedisGuard(timeout_s=60)),
                           catalog=SimpleNamespace(key_tokens_recorded=lambda caller, start, before: nothing_recorded(
                               start, before)))


def call_of(caller: Caller, max_tokens: int) -> Call:
    """A completion of `max_tokens`, its prompt's estimate 0: the budget holds max_tokens plus the
    most its empty body's prompt can hold (serving.gateway.accounting.most_tokens)."""
    call = Call(endpoint="completions", caller=caller, body={}, model="bot", target=Target(base=True),
                max_tokens=max_tokens)
    call.reserved_tokens = max_tokens
    return call


SHARE = COMPLETION_TOKENS  # what the budget holds beyond max_tokens for such a call


async def settle(client: aioredis.Redis, res: SimpleNamespace, call: Call, used: int) -> None:
    """What pipeline._record does for the budget: the usage record's spend, then the release."""
    async with client.pipeline(transaction=False) as pipe:
        reservation, call.budget_reservation = call.budget_reservation, None
        release_after(lambda p: spend_add(p, call.caller.key_prefix, used, time.time()),
                      [reservation] if reservation is not None else [])(pipe)
        await pipe.execute()


def test_200_concurrent_requests_never_pass_the_budget_by_more_than_one_reservation(redis_client):
    budget, reserved, used = 250, 40, 25
    caller = budgeted(budget)
    assert most_tokens(call_of(caller, reserved - SHARE)) == reserved

    async def scenario() -> tuple[int, int, int]:
        client = aioredis.Redis.from_url(redis_url(), max_connections=400)  # 200 at once
        res = resources(client)
        try:
            calls = [call_of(caller, reserved - SHARE) for _ in range(200)]
            outcomes = await asyncio.gather(*(pipeline.key_budget_check(call, res) for call in calls),
                                            return_exceptions=True)
            admitted = []
            for call, outcome in zip(calls, outcomes):
                if isinstance(outcome, Reservation):
                    call.budget_reservation = outcome
                    admitted.append(call)
            refused = [outcome for outcome in outcomes if isinstance(outcome, GatewayError)]
            assert len(admitted) + len(refused) == 200
            assert {error.code for error in refused} == {"key_budget_exceeded"}
            # Every admitted request settles: its usage record adds what it used, its reservation goes.
            await asyncio.gather(*(settle(client, res, call, used) for call in admitted))
            state = await client.hmget(counter_key(caller.key_prefix, Month.of(time.time())), "tokens", "reserved")
            return len(admitted), int(state[0]), int(state[1])
        finally:
            await client.aclose()

    admitted, spent, still_reserved = asyncio.run(scenario())
    # 0, 40, ..., 240 reserved when each was judged: 7 admitted, 280 reserved = budget + 30.
    assert admitted == 7
    assert admitted * reserved <= budget + reserved
    assert spent == admitted * used and still_reserved == 0


def test_a_spend_equal_to_the_budget_is_refused_and_one_below_it_admitted(redis_client):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        res = resources(client)
        try:
            at_budget, below = budgeted(100), budgeted(100)
            async with client.pipeline(transaction=False) as pipe:
                spend_add(pipe, at_budget.key_prefix, 100, time.time())
                spend_add(pipe, below.key_prefix, 99, time.time())
                await pipe.execute()
            with pytest.raises(GatewayError) as refused:
                await pipeline.key_budget_check(call_of(at_budget, 5), res)
            error = refused.value
            assert (error.status, error.code) == (429, "key_budget_exceeded")
            assert "has used 100 tokens this month, its monthly budget is 100" in error.message
            assert int(error.headers["retry-after"]) > 1  # the month's end
            admitted = call_of(below, 5)
            admitted.budget_reservation = await pipeline.key_budget_check(admitted, res)
            assert admitted.budget_reservation is not None and admitted.budget_reservation.tokens == 5 + SHARE
            # Spent 99, reserved 13: the next one waits for the first to settle, a second away.
            with pytest.raises(GatewayError) as waiting:
                await pipeline.key_budget_check(call_of(below, 5), res)
            assert waiting.value.headers["retry-after"] == "1"
            assert f"{5 + SHARE} more are reserved" in waiting.value.message
            await settle(client, res, admitted, 0)  # it used nothing: its reservation comes back whole
            await pipeline.key_budget_check(call_of(below, 5), res)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_reservation_never_released_lapses_and_a_late_release_takes_nothing_twice(redis_client):
    prefix = uuid.uuid4().hex[:12]

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        budgets, guard = KeyBudgets(client), RedisGuard(timeout_s=SLOW_REDIS_S)
        try:
            first = await budgets.reserve(prefix, 100, 150, now=NOW, guard=guard, recorded=nothing_recorded)
            assert first is not None and first.reservation is not None
            held = await budgets.reserve(prefix, 100, 10, now=NOW + 1, guard=guard, recorded=nothing_recorded)
            assert held is not None and held.reservation is None and held.spend.reserved == 150
            # Its gateway process died: past the hold, the reservation is gone and the key admitted again.
            later = NOW + RESERVATION_HOLD_S + 1
            second = await budgets.reserve(prefix, 100, 10, now=later, guard=guard, recorded=nothing_recorded)
            assert second is not None and second.reservation is not None and second.spend.reserved == 0
            await budgets.release(first.reservation)  # too late: takes nothing off the second's
            assert int(await client.hget(counter_key(prefix, Month.of(NOW)), "reserved")) == 10
            await budgets.release(second.reservation)
            await budgets.release(second.reservation)  # twice: once
            assert int(await client.hget(counter_key(prefix, Month.of(NOW)), "reserved")) == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_key_without_a_budget_reserves_nothing():
    async def scenario() -> None:
        res = SimpleNamespace(key_budgets=None)  # never reached
        call = call_of(Caller(tenant_id=1, tenant="t", key_prefix="p", tier=TIER), 10)
        assert await pipeline.key_budget_check(call, res) is None

    asyncio.run(scenario())
