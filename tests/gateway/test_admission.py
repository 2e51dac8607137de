"""The admission step in this process (serving.gateway.pipeline.admit) on the run's Redis, at its
boundaries: a key whose recorded spend has reached its monthly budget exactly is refused, one
below it is admitted; a key over its own tokens per minute is refused even on a tier that allows
degradation (degrading spends the tenant's slack, not the key's), while the tenant's quota running
short on such a tier is degraded; a request reserving exactly what its key's bucket holds is
admitted, one token more is a 400 (it could never be). No web process: the catalog is a stand-in
whose only answer that matters is the key's recorded tokens (what the budget's counter is seeded
from). The buckets hold two minutes of their rate (BURST), pinned here whatever the environment says."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from serving.gateway import pipeline, wiring
from serving.gateway.errors import GatewayError
from serving.gateway.local_buckets import GuardedBuckets
from serving.gateway.proxy import Upstream
from serving.gateway.quotas import TokenBuckets
from serving.gateway.records import Call, Caller, KeyControls, Target, TierLimits
from serving.gateway.request_fields import estimate_prompt_tokens
from serving.gateway.resources import PipelineConfig, Resources

BURST = 2.0
DEGRADABLE = TierLimits(name="standard", requests_per_minute=600, tokens_per_minute=1_000,
                        max_tokens_per_request=64, priority=1, degradation_allowed=True)


class RecordedCatalog:
    """The one port admission reads: the key's usage records in the month before its counter."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def key_tokens_recorded(self, caller: Caller, start: float, before: float) -> int:
        return self.tokens


def caller(tier: TierLimits = DEGRADABLE, **key: int) -> Caller:
    return Caller(tenant_id=1, tenant=f"t-{uuid.uuid4().hex[:8]}", key_prefix=uuid.uuid4().hex[:12], tier=tier,
                  key=KeyControls(**key))


def adapter_call(who: Caller, *, max_tokens: int = 8) -> Call:
    """A chat request for an adapter (not the base model: only those may degrade)."""
    return Call(endpoint="chat", caller=who, model="support-bot", target=Target(),
                body={"model": "support-bot", "messages": [{"role": "user", "content": "Hi"}]},
                max_tokens=max_tokens)


def admitting(recorded: int, scenario: Callable[[Resources], Awaitable[None]], *, redis_url: str | None = None) -> None:
    """Runs `scenario` with the pipeline's resources on the run's Redis (or `redis_url`), as
    serving.gateway.wiring builds them."""
    from django.conf import settings

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url or settings.REDIS_URL, socket_connect_timeout=0.2)
        resilience = wiring.resilience_build(client)
        res = Resources(
            redis=client, buckets=GuardedBuckets(TokenBuckets(client), guard=resilience.guard, processes=1),
            upstream=Upstream(api_key="", timeout_s=5.0), resilience=resilience,
            catalog=RecordedCatalog(recorded),  # type: ignore[arg-type]  # admission reads only this
            config=PipelineConfig(gateway=settings.GATEWAY.model_copy(update={"bucket_burst": BURST}),
                                           routing=settings.GATEWAY_ROUTING,
                                           worker_api_key="", base_model_name="tiny"))
        try:
            await scenario(res)
        finally:
            await res.upstream.aclose()
            await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(("recorded", "admitted"), [(1_000, False), (1_001, False), (999, True), (500, True)])
def test_a_key_is_refused_once_its_recorded_spend_reaches_its_budget(redis_client, recorded: int,
                                                                    admitted: bool) -> None:
    who = caller(monthly_token_budget=1_000)

    async def scenario(res: Resources) -> None:
        call = adapter_call(who)
        if admitted:
            await pipeline.admit(call, res)
            assert call.admission is not None and call.admission.admitted and not call.degraded
            return
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(call, res)
        assert (refused.value.status, refused.value.code) == (429, "key_budget_exceeded")
        assert f"has used {recorded:,} tokens this month, its monthly budget is 1,000" in str(refused.value)

    admitting(recorded, scenario)


def test_while_redis_is_away_a_budgeted_key_is_refused_and_a_key_without_one_is_served() -> None:
    """The buckets fail open to this process's own; a budget fails closed (a 503 that says nothing
    was charged): on a loaded host, failing open let a 250-token key be served 910 tokens."""
    from tests.conftest import free_port

    budgeted, free = caller(monthly_token_budget=1_000), caller()

    async def scenario(res: Resources) -> None:
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(adapter_call(budgeted), res)
        assert (refused.value.status, refused.value.code) == (503, "key_budget_unavailable")
        assert "nothing was charged" in str(refused.value) and refused.value.headers["retry-after"] == "1"
        call = adapter_call(free)
        await pipeline.admit(call, res)
        assert call.admission is not None and call.admission.admitted

    admitting(0, scenario, redis_url=f"redis://127.0.0.1:{free_port()}/0")


def test_a_key_over_its_own_tokens_per_minute_is_refused_not_degraded(redis_client) -> None:
    # The key's 50 tpm hold 100 tokens: one 64-token request, not two.
    # The tenant's 1,000 tpm hold far more, so only the key is short.
    who = caller(tokens_per_minute=50)

    async def scenario(res: Resources) -> None:
        first = adapter_call(who, max_tokens=64)
        await pipeline.admit(first, res)
        assert first.admission is not None and first.admission.admitted
        over = adapter_call(who, max_tokens=64)
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(over, res)
        assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
        assert "its own limit: 50 tokens per minute" in str(refused.value)
        assert not over.degraded and not over.target.base and "x-loraplex-degraded" not in over.headers

    admitting(0, scenario)


def test_the_tenants_quota_short_on_a_degradable_tier_is_degraded_to_the_base_model(redis_client) -> None:
    # The tier's 100 tpm hold 200 tokens: two 64-token requests fit, the third finds the tenant short
    # (the key has no limits of its own) and is degraded.
    who = caller(tier=TierLimits(name="standard", requests_per_minute=600, tokens_per_minute=100,
                                 max_tokens_per_request=64, priority=1, degradation_allowed=True))

    async def scenario(res: Resources) -> None:
        calls = [adapter_call(who, max_tokens=64) for _ in range(3)]
        for call in calls:
            await pipeline.admit(call, res)
        assert [call.degraded for call in calls] == [False, False, True]
        assert calls[2].target.base and calls[2].headers["x-loraplex-degraded"] == "quota"

    admitting(0, scenario)


def test_a_request_reserving_exactly_its_keys_bucket_is_admitted_and_one_token_more_is_a_400(redis_client) -> None:
    body = adapter_call(caller()).body
    prompt = estimate_prompt_tokens(body, "chat")
    max_tokens = 40 + (prompt % 2)  # an even reservation: the key's tpm is half of it (BURST minutes)
    who = caller(tokens_per_minute=int((prompt + max_tokens) / BURST))

    async def scenario(res: Resources) -> None:
        with pytest.raises(GatewayError) as refused:
            await pipeline.admit(adapter_call(who, max_tokens=max_tokens + 1), res)
        assert (refused.value.status, refused.value.code) == (400, "request_too_large")
        exact = adapter_call(who, max_tokens=max_tokens)
        await pipeline.admit(exact, res)
        assert exact.reserved_tokens == prompt + max_tokens and exact.admission is not None
        assert exact.admission.admitted

    admitting(0, scenario)
