"""Issue 37, item 4, at the admission step (serving.gateway.pipeline.admit) on the run's Redis: a
request that reserves more tokens than a bucket can ever hold is a 400 naming the limit, not a 429
whose retry-after never comes; a key's budget reservation goes back when its buckets refuse the
request; and what a call is charged when it ends (serving.gateway.accounting.charged_tokens). No
web process: the catalog is a stand-in that admission reads only for the budget's seed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from serving.gateway import pipeline, wiring
from serving.gateway.accounting import charged_tokens
from serving.gateway.errors import GatewayError
from serving.gateway.key_budget import Month, counter_key
from serving.gateway.local_buckets import GuardedBuckets
from serving.gateway.proxy import Upstream, UpstreamResult
from serving.gateway.quotas import TokenBuckets
from serving.gateway.records import Call, Caller, KeyControls, Target, TierLimits
from serving.gateway.resources import PipelineConfig, Resources

STRICT = TierLimits(name="strict", requests_per_minute=600, tokens_per_minute=10, max_tokens_per_request=64,
                    priority=1, degradation_allowed=False)
DEGRADABLE = TierLimits(name="standard", requests_per_minute=600, tokens_per_minute=1_000, max_tokens_per_request=64,
                        priority=1, degradation_allowed=True)


class NothingRecorded:
    async def key_tokens_recorded(self, caller: Caller, start: float, before: float) -> int:
        return 0


def caller(tier: TierLimits, **key: int) -> Caller:
    return Caller(tenant_id=1, tenant=f"t-{uuid.uuid4().hex[:8]}", key_prefix=uuid.uuid4().hex[:12], tier=tier,
                  key=KeyControls(**key))


def chat(who: Caller, *, max_tokens: int) -> Call:
    return Call(endpoint="chat", caller=who, model="support-bot", target=Target(),
                body={"model": "support-bot", "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": max_tokens},
                max_tokens=max_tokens)


def admitting(scenario: Callable[[Resources, aioredis.Redis], Awaitable[None]]) -> None:
    from django.conf import settings

    async def run() -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        resilience = wiring.resilience_build(client)
        res = Resources(
            redis=client, buckets=GuardedBuckets(TokenBuckets(client), guard=resilience.guard, processes=1),
            upstream=Upstream(api_key="", timeout_s=5.0), resilience=resilience,
            catalog=NothingRecorded(),  # type: ignore[arg-type]  # admission reads only this
            config=PipelineConfig(gateway=settings.GATEWAY, routing=settings.GATEWAY_ROUTING,
                                           worker_api_key="", base_model_name="tiny"))
        try:
            await scenario(res, client)
        finally:
            await res.upstream.aclose()
            await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(("tier", "key", "named"), [
    (STRICT, {}, "('strict' tier: 10 tokens per minute)"),
    (DEGRADABLE, {"tokens_per_minute": 10}, "(its own limit: 10 tokens per minute)"),
])
def test_a_request_no_bucket_can_ever_hold_is_a_400_naming_the_limit(redis_client, tier, key, named) -> None:
    who = caller(tier, **key)

    async def scenario(res: Resources, client: aioredis.Redis) -> None:
        # 10 tpm with the default burst of two minutes hold 20 tokens; this request reserves 64 and its prompt.
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(chat(who, max_tokens=64), res)
        error = refused.value
        assert (error.status, error.code, error.param) == (400, "request_too_large", "max_tokens")
        assert "retry-after" not in error.headers
        assert "more than the 20 tokens the bucket of" in error.message and named in error.message
        # One that fits is admitted.
        fits = chat(who, max_tokens=4)
        await pipeline.admit(fits, res)
        assert fits.admission is not None and fits.admission.admitted

    admitting(scenario)


def test_a_budget_reservation_goes_back_when_the_buckets_refuse(redis_client) -> None:
    who = caller(DEGRADABLE, tokens_per_minute=50, monthly_token_budget=1_000)

    async def scenario(res: Resources, client: aioredis.Redis) -> None:
        first = chat(who, max_tokens=64)
        await pipeline.admit(first, res)
        assert first.budget_reservation is not None
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(chat(who, max_tokens=64), res)  # the key's 100-token bucket is short
        assert refused.value.code == "rate_limit_exceeded"
        reserved = await client.hget(counter_key(who.key_prefix, Month.of(time.time())), "reserved")
        assert int(reserved) == first.budget_reservation.tokens  # the refused one's share is back

    admitting(scenario)


def settled(call: Call, *, status: str, http_status: int = 200, chunks: int = 0,
            usage: tuple[int, int] | None = None) -> tuple[int, int]:
    result = UpstreamResult(worker_id="w1", http_status=http_status, status=status, content_chunks=chunks)
    if usage is not None:
        result.take_usage({"prompt_tokens": usage[0], "completion_tokens": usage[1]})
    return charged_tokens(call, result)


def test_what_a_call_is_charged_is_never_less_than_the_worker_generated() -> None:
    call = chat(caller(DEGRADABLE), max_tokens=101)
    call.prompt_estimate, call.sequences = 9, 2
    # The worker's usage when it came (it counts best_of's discarded sequences: tests/engine).
    assert settled(call, status="ok", usage=(8, 40)) == (8, 40)
    # The client left mid-stream after 51 chunks: the worker went on until it noticed, so the
    # reservation is charged (it was 51 of 101 tokens generated, issue 37), a whole reply's too.
    assert settled(call, status="aborted", chunks=51) == (9, 202)
    assert settled(call, status="aborted", http_status=0) == (9, 202)
    # The worker broke the stream: what reached the client; it refused or failed before replying: nothing.
    assert settled(call, status="upstream_error", chunks=7) == (9, 7)
    assert settled(call, status="client_error", http_status=400) == (0, 0)
    assert settled(call, status="upstream_error", http_status=0) == (0, 0)
