"""The request path of `/v1/chat/completions` and `/v1/completions`. `handle` reads it top to bottom:

    authenticate → resolve the model → tier limits → choose the version → admit (the key's budget,
    then the token buckets, or degradation) → the version's breaker → the worker order →
    the attempts, with failover → settle (refund, usage, metrics)

Each step is one call whose answer `handle` (or `forward`, for the attempts) puts on the `Call`:
the resilience rules (serving.gateway.resilience: breakers, canary guard, outlier ejection,
shedding, the Redis-outage fallback) return their decisions and never write it, and the attempts
run through serving.gateway.failover.with_failover, where the retry rule is written once.
Refusals are GatewayErrors; the edge (serving.gateway.asgi) turns everything into HTTP.

Django-free: the database is the `Catalog` in `Resources` (serving.gateway.resources, with every
setting as a config built once); serving.gateway.wiring builds them, per event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import redis.asyncio as aioredis

from serving.gateway import metrics
from serving.gateway.accounting import charged_tokens, check_fits, most_tokens, release_after
from serving.gateway.errors import GatewayError, invalid_request
from serving.gateway.failover import retryable, with_failover
from serving.gateway.proxy import Relay, UpstreamResult, rename_model
from serving.gateway.key_budget import Reservation, budget_exceeded, budget_unavailable
from serving.gateway.quotas import Admission
from serving.gateway.records import Call, Caller, Reply, Target
from serving.gateway.redis_batch import run_batch
from serving.gateway.request_buckets import RequestBuckets
from serving.gateway.request_fields import (
    decode_body, estimate_prompt_tokens, requested_max_tokens, requested_sequences,
)
from serving.gateway.resilience import FAILOVER_RETRIES, VersionVerdict
from serving.gateway.resources import Resources, current_workers
from serving.gateway.routing import WorkerView, route
from serving.gateway.stream_http import FirstByteTimeout
from serving.gateway.upstream import upstream_body
from serving.gateway.usage_backlog import usage_pushes
from serving.contracts.usage_log import UsageEvent
from serving.gateway.version_pick import ServedVersion, pick_version
from serving.gateway.worker_watch import unless_worker_gone
from runtime.access_log import access_note
from runtime.breakers import Permit

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


# ---- the whole path ------------------------------------------------------------------------


async def handle(endpoint: str, *, authorization: str | None, raw_body: bytes, res: Resources) -> Reply:
    """One completion request, from its HTTP parts to the reply, on this loop's `res`
    (serving.gateway.wiring.resources)."""
    caller = await res.catalog.caller_for(authorization)
    try:
        body = decode_body(raw_body)  # checked once: serving.gateway.request_fields
        model = body["model"]
        access_note(tenant=caller.tenant, model=model)
        target = await res.catalog.target_for(caller, model)
        max_tokens, sequences = check_tier_limits(body, endpoint, caller)
    except GatewayError as error:
        # A refused request cost the gateway its decoding and lookups: it costs the caller a request
        # from its buckets, so a flood of malformed bodies or unknown names is rate-limited as any flood.
        if error.status in (400, 404) or error.code == "model_not_allowed":
            raise await charged_refusal(caller, endpoint, error, res) from None
        raise
    # Chosen before admission, so that its breaker permit is asked in the admission's round trip.
    call = Call(endpoint=endpoint, caller=caller, body=body, model=model, target=target, max_tokens=max_tokens,
                sequences=sequences, body_bytes=len(raw_body), version=choose_version(target, body))
    try:
        await admit(call, res)
    except GatewayError as error:
        metrics.REQUESTS.labels(caller.tier.name, endpoint, str(error.status)).inc()
        raise
    try:
        breaker_applied(call, await res.resilience.version_permit(
            call.version, call.permit, call.target.served, degradable=degradable(call), headers=call.headers))
        workers = await choose_workers(call, res)
    except GatewayError:
        await _release(call, res)
        raise
    return await forward(call, workers, res)


# ---- steps ---------------------------------------------------------------------------------


def check_tier_limits(body: dict[str, Any], endpoint: str, caller: Caller) -> tuple[int, int]:
    """The request's max_tokens per completion and how many completions it generates. The tier's
    limit is on the request's whole output: max_tokens times the completions (several prompts, n,
    best_of) within it (400 naming both beyond it); when not asked, the limit shared between them."""
    limit = caller.tier.max_tokens_per_request
    asked = requested_max_tokens(body, endpoint)
    sequences = requested_sequences(body, endpoint)
    param = "max_completion_tokens" if endpoint == "chat" and body.get("max_completion_tokens") else "max_tokens"
    tier = f"the '{caller.tier.name}' tier allows at most {limit} tokens per request"
    if asked is not None and asked * sequences > limit:
        each = f" for each of {sequences} completions ({asked * sequences} tokens)" if sequences > 1 else ""
        raise invalid_request(f"{param} is {asked}{each}, but {tier}; ask for {limit // sequences or 1} or fewer"
                              f"{' each' if sequences > 1 else ''}.", param=param, code="max_tokens_exceeded")
    if asked is None and sequences > limit:
        raise invalid_request(f"The request generates {sequences} completions, but {tier}: not one token each. Ask "
                              f"for fewer completions (prompts, n, best_of).", param="n", code="max_tokens_exceeded")
    return (asked if asked is not None else limit // sequences), sequences


def _over_quota(call: Call, buckets: RequestBuckets, admission: Admission, retry_after_s: float, *,
                headers: dict[str, str]) -> GatewayError:
    retry = max(1, math.ceil(retry_after_s))
    return GatewayError(
        429,
        f"Rate limit reached for {buckets.describe(buckets.shortest(admission))}. This request "
        f"({call.reserved_tokens} tokens reserved) fits in {retry_after_s:.2f} s; retry then.",
        code="rate_limit_exceeded",
        headers={**headers, "retry-after": str(retry), "retry-after-ms": str(math.ceil(retry_after_s * 1000))},
    )


async def key_budget_check(call: Call, res: Resources) -> Reservation | None:
    """Reserve the most tokens the call can be charged (serving.gateway.accounting.most_tokens)
    against its key's monthly budget (serving.gateway.key_budget): the reservation, or 429
    key_budget_exceeded once the month's spend plus what the key's requests in flight reserved
    reaches it. Keys without a budget reserve nothing (None); while Redis is away (or too slow for the
    guard's bound) a budgeted key gets 503 key_budget_unavailable: the budget fails closed."""
    budget = call.caller.key.monthly_token_budget
    if budget is None:
        return None
    now = time.time()
    verdict = await res.key_budgets.reserve(
        call.caller.key_prefix, budget, most_tokens(call), now=now, guard=res.resilience.guard,
        recorded=lambda start, before: res.catalog.key_tokens_recorded(call.caller, start, before))
    if verdict is None:
        raise budget_unavailable(call.caller.key_prefix, retry_after_s=res.resilience.guard.retry_interval_s,
                                 headers=call.headers)
    if verdict.reservation is None:
        metrics.RATE_LIMITED.labels(call.caller.tier.name).inc()
        raise budget_exceeded(call.caller.key_prefix, budget, verdict.spend, now=now, headers=call.headers)
    return verdict.reservation


@dataclass(frozen=True)
class Admitted:
    """The buckets' answer: their admission, the chosen version's breaker permit asked in the same
    round trip (None on the base model, or when the request was degraded), the rate-limit headers,
    and whether the base model answers instead for want of the tenant's quota."""

    admission: Admission
    permit: Permit | None
    headers: dict[str, str]
    degraded: bool = False


async def admit(call: Call, res: Resources) -> None:
    """Reserve the call's tokens against its key's budget, then 1 request and prompt + every
    completion's max_tokens from the tenant's and the key's buckets, all or none; over the tenant's
    quota, degrade where allowed, else (and over the key's own limits) 429, giving the budget's
    reservation back. A request larger than a bucket's capacity is a 400. The chosen version's
    breaker permit is asked in the buckets' round trip (`call.permit`;
    serving.gateway.resilience.version_permit takes it)."""
    buckets = RequestBuckets.of(call.caller, res.config.gateway.bucket_burst)
    call.prompt_estimate = estimate_prompt_tokens(call.body, call.endpoint)
    call.reserved_tokens = call.prompt_estimate + call.max_tokens * call.sequences
    check_fits(call, buckets, may_degrade=degradable(call))
    call.budget_reservation = await key_budget_check(call, res)
    try:
        admitted = await admit_buckets(call, buckets, res)
    except BaseException:
        await _release_budget(call, res)
        raise
    call.admission, call.permit = admitted.admission, admitted.permit
    call.headers.update(admitted.headers)
    if admitted.degraded:
        call.degraded, call.reserved_tokens, call.version = True, 0, None
        call.target = Target(base=True)
        call.headers["x-loraplex-degraded"] = "quota"


async def admit_buckets(call: Call, buckets: RequestBuckets, res: Resources) -> Admitted:
    """The call's reservation from `buckets`, with its version's breaker permit in one round trip;
    the degraded bucket's request when the tenant's quota is short and the call may degrade; else
    429 (with the rate-limit headers), the permit given back."""
    version = call.version
    admission, replies = await res.buckets.admit_batched(
        res.redis, buckets.costs(tokens=call.reserved_tokens),
        [res.resilience.acquire_call(version)] if version is not None else [])
    permit = (res.resilience.permit_from(version, replies[0] if replies is not None else None)
              if version is not None else None)
    headers = buckets.headers(admission)
    if admission.admitted:
        return Admitted(admission, permit, headers)
    res.resilience.permit_unused(permit)
    retry_after = admission.retry_after_s
    if degradable(call) and not buckets.key_short(admission):
        degraded = await res.buckets.admit(buckets.degraded_costs())
        if degraded.admitted:
            metrics.DEGRADED.labels(call.caller.tier.name).inc()
            return Admitted(admission, None, headers, degraded=True)
        retry_after = min(retry_after, degraded.retry_after_s)
    metrics.RATE_LIMITED.labels(call.caller.tier.name).inc()
    raise _over_quota(call, buckets, admission, retry_after, headers={**call.headers, **headers})


async def _release_budget(call: Call, res: Resources) -> None:
    """Give back the budget's reservation of a call that reached no worker (it lapses by itself
    when Redis is away: serving.gateway.key_budget.RESERVATION_HOLD_S)."""
    reservation, call.budget_reservation = call.budget_reservation, None
    if reservation is not None:
        await res.resilience.guard.call("key budget release", lambda: res.key_budgets.release(reservation))


def degradable(call: Call) -> bool:
    """Whether the base model may answer instead of the adapter (tier allows it, request did not opt out)."""
    return (call.caller.tier.degradation_allowed and not call.target.base
            and call.body.get("allow_degradation", True) is not False)


def choose_version(target: Target, body: dict[str, Any]) -> ServedVersion | None:
    """The version that serves the request (None: the base model)."""
    if target.base:
        return None
    if target.pinned is not None:
        return target.pinned
    assert target.served is not None, "a target is the base model, a pinned version or an adapter's served set"
    user = body.get("user")
    return pick_version(target.served, user=user if isinstance(user, str) else None)


async def choose_workers(call: Call, res: Resources) -> list[WorkerView]:
    """The workers for the call's version, best first, among those not ejected, by the routing
    policy (affinity, queue, KV; or round robin: serving.gateway.routing.route): the first is
    called, the next where it fails before its first byte. 503 when none is live or, below vip,
    when all are full."""
    candidates = res.resilience.usable_workers(await current_workers(res))
    adapter = call.version.qualified_name if call.version else None
    order = route(candidates, adapter=adapter, inflight=res.inflight, config=res.config.routing,
                  rotation=res.rotation)
    if not order:
        raise GatewayError(503, "No serving worker is available for this model right now; retry shortly.",
                           code="no_serving_worker", headers={**call.headers, "retry-after": "1"})
    shed = res.resilience.shed_refusal(call.caller.tier, candidates, res.inflight, headers=call.headers)
    if shed is not None:
        raise shed
    return order


def breaker_applied(call: Call, verdict: VersionVerdict) -> None:
    """The breaker's verdict on the call: the version it runs (and permit), or the base model."""
    call.version, call.permit = verdict.version, verdict.permit
    if verdict.degraded is not None:
        call.degraded = True
        call.target = Target(base=True)
        call.headers["x-loraplex-degraded"] = verdict.degraded


def response_headers(call: Call) -> dict[str, str]:
    headers = dict(call.headers)
    headers["x-request-id"] = call.request_id
    if call.version is not None:
        headers["x-loraplex-adapter-version"] = call.version.version
    return headers


def settle(call: Call, worker: WorkerView, result: UpstreamResult, res: Resources) -> None:
    """The call's last attempt (on `worker`) is over: count it on the worker's outlier record,
    refund unused tokens (charge overruns), record usage (what `charged_tokens` says) and metrics."""
    res.inflight[result.worker_id] = max(0, res.inflight.get(result.worker_id, 1) - 1)
    metrics.IN_FLIGHT.dec()
    prompt_tokens, completion_tokens = charged_tokens(call, result)
    used = prompt_tokens + completion_tokens
    status = result.status
    # A worker's refusal of the operator key reached the client as 502 (_key_refused).
    http_status = 502 if result.key_refused else result.http_status or 502
    metrics.UPSTREAM_DURATION.labels(status).observe(result.ended_s or 0.0)
    if result.first_byte_s is not None:
        metrics.UPSTREAM_FIRST_BYTE.observe(result.first_byte_s)
    metrics.REQUESTS.labels(call.caller.tier.name, call.endpoint, str(http_status)).inc()
    event = UsageEvent(
        request_id=call.request_id, tenant_id=call.caller.tenant_id, api_key_prefix=call.caller.key_prefix,
        endpoint=call.endpoint, model=call.model,
        adapter=call.version.adapter if call.version else "", version=call.version.version if call.version else "",
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        status=status, http_status=http_status, latency_ms=(time.perf_counter() - call.started) * 1000,
        ttft_ms=(result.first_byte_s * 1000) if result.first_byte_s is not None and status == "ok" else None,
        degraded=call.degraded, worker=result.worker_id, created_at=time.time(),
    )
    res.resilience.attempt_done(worker, result, live=len(res.workers))
    # Off the reply's path: the client has its last byte before Redis hears of it.
    task = asyncio.get_running_loop().create_task(_record(call, result, event, used, res))
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()


async def _record(call: Call, result: UpstreamResult, event: UsageEvent, used: int, res: Resources) -> None:
    """The refund, the call's counts on its version's breaker and in the prewarm demand model
    (serving.gateway.resilience.outcome_calls) and the usage record, in one round trip
    (serving.gateway.redis_batch); the refund first, so a visible usage record means the refund is
    done. While Redis is away the refund goes to this process's buckets, the breaker's count to its
    own breaker, and the record waits in memory, pushed with the first record once Redis is back."""
    refund = call.reserved_tokens - used if call.reserved_tokens and call.reserved_tokens != used else 0
    tokens_buckets = RequestBuckets.of(call.caller, res.config.gateway.bucket_burst).tokens if refund else ()
    kept, reservations = res.usage_backlog.take()
    events = [*kept, event]
    if call.budget_reservation is not None:
        reservations.append(call.budget_reservation)
        call.budget_reservation = None
    refunds = [res.buckets.shared.refund_call(bucket, refund) for bucket in tokens_buckets]
    counts = res.resilience.outcome_calls(call, result)
    try:
        replies = await res.resilience.guard.call("usage record", lambda: run_batch(
            res.redis, [*refunds, *counts], release_after(usage_pushes(events), reservations)))
        if replies is None:
            for bucket in tokens_buckets:
                res.buckets.local.refund(bucket, refund)
            res.usage_backlog.keep(events, reservations)
        await res.resilience.outcome_recorded(call, result, replies[len(refunds):] if replies is not None else None)
    except (aioredis.RedisError, OSError):
        # Kept all the same: a record pushed twice is written once (its record id), and a reservation
        # released twice is taken off once (serving.gateway.key_budget's release script).
        res.usage_backlog.keep(events, reservations)
        log.exception("could not record usage / refund tokens of %s", call.request_id)


async def charged_refusal(caller: Caller, endpoint: str, refusal: GatewayError, res: Resources) -> GatewayError:
    """A request refused before admission (a malformed body or one past the tier's limits, 400; a
    model the caller cannot have, 404, or 403 outside its key's allow-list), asked for in a
    completion or looked up (`GET /v1/models/{id}`, serving.gateway.views), still costs one request
    from its buckets, so a flood of them is rate-limited as any other flood: the refusal with the
    rate-limit headers, or 429 once the bucket is empty. The refusal may be a cached one: it is
    copied, never changed."""
    buckets = RequestBuckets.of(caller, res.config.gateway.bucket_burst)
    admission = await res.buckets.admit(buckets.costs(tokens=0))
    headers = buckets.headers(admission)
    metrics.REQUESTS.labels(caller.tier.name, endpoint, str(refusal.status) if admission.admitted else "429").inc()
    if admission.admitted:
        return GatewayError(refusal.status, refusal.message, code=refusal.code, param=refusal.param,
                            headers={**refusal.headers, **headers})
    metrics.RATE_LIMITED.labels(caller.tier.name).inc()
    retry_after_s = admission.retry_after_s
    return GatewayError(
        429, f"Rate limit reached for {buckets.describe(buckets.shortest(admission))}; refused requests count "
             f"too (malformed ones, unknown models, models outside the key's allow-list). Retry in "
             f"{retry_after_s:.2f} s.",
        code="rate_limit_exceeded",
        headers={**headers, "retry-after": str(max(1, math.ceil(retry_after_s))),
                 "retry-after-ms": str(math.ceil(retry_after_s * 1000))})


async def _release(call: Call, res: Resources) -> None:
    """Give back a reservation the request never used (no worker took it)."""
    if call.reserved_tokens:
        for bucket in RequestBuckets.of(call.caller, res.config.gateway.bucket_burst).tokens:
            await res.buckets.refund(bucket, call.reserved_tokens)
    await _release_budget(call, res)
    metrics.REQUESTS.labels(call.caller.tier.name, call.endpoint, "503").inc()


@dataclass
class Attempt:
    """One upstream attempt's answer: what the client gets if it stands, and whether it failed
    before its first byte in a way another worker may mend (serving.gateway.failover.retryable)."""

    upstream: UpstreamResult
    reply: Reply
    retryable: bool = False
    # A stream under way: its relay settles the call as it ends.
    relayed: bool = False


async def forward(call: Call, workers: list[WorkerView], res: Resources) -> Reply:
    """Call the first of `workers` and, when it fails before its first byte, once more the next
    (serving.gateway.failover.with_failover); the attempt that answers settles the call: a stream
    when it ends, anything else before returning."""
    tried = await with_failover(workers, lambda worker: _attempt(call, worker, res), lambda attempt: attempt.retryable,
                                on_retry=lambda worker, attempt: _abandon(worker, attempt.upstream, res))
    last = tried[-1]
    if not last.result.relayed:
        settle(call, last.worker, last.result.upstream, res)
    return last.result.reply


async def _attempt(call: Call, worker: WorkerView, res: Resources) -> Attempt:
    """One upstream attempt on `worker`, unsettled unless it raised (the client left, or the
    gateway's own fault) or its stream is under way (settled by its relay)."""
    url = f"{worker.url}{ENDPOINTS[call.endpoint]}"
    body = upstream_body(call, worker)
    rename = rename_model(body["model"], res.config.base_model_name if call.degraded else call.model)
    result = UpstreamResult(worker_id=worker.worker_id)
    res.inflight[worker.worker_id] = res.inflight.get(worker.worker_id, 0) + 1
    metrics.IN_FLIGHT.inc()
    headers = response_headers(call)
    error: httpx.HTTPError | None = None
    status, content = 0, b""
    try:
        if body.get("stream"):
            try:
                response = await res.upstream.open_stream(url, body, result=result, request_id=call.request_id)
            except httpx.HTTPError as exc:
                error = exc
            else:
                if response.status_code == 200:
                    wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
                    # Settled as the relay ends (its `finally`), however it ends.
                    relay = Relay(response, result=result, rename=rename, client_wants_usage=wants_usage,
                                  on_end=lambda: settle(call, worker, result, res))
                    return Attempt(result, Reply(status=200, stream=relay, headers={
                        **headers, "cache-control": "no-cache", "x-accel-buffering": "no"}), relayed=True)
                status, content = response.status_code, result.refused_body
        else:
            try:
                # Its head comes with its last token: a silent worker is judged by its heartbeat.
                content = await unless_worker_gone(
                    res.upstream.call(url, body, result=result, rename=rename, request_id=call.request_id),
                    worker=worker, redis=res.redis, guard=res.resilience.guard,
                    first_check_s=res.config.gateway.first_byte_timeout_s)
            except httpx.HTTPError as exc:
                error = exc
            else:
                status = result.http_status
    except asyncio.CancelledError:
        result.status = "aborted"  # the client left before the reply
        result.end()
        settle(call, worker, result, res)
        raise
    except Exception:
        # The worker's failures are answered below; what escapes is the gateway's own (a request it
        # could not encode, a bug): no count on the worker's ejection record or the adapter's breaker.
        result.gateway_fault = True
        result.end()
        settle(call, worker, result, res)
        raise
    if error is not None:
        return Attempt(result, Reply(status=502, headers=headers, body=_upstream_unreachable(worker, error)),
                       retryable=retryable(status=None, error=error))
    if result.key_refused:
        reply = Reply(status=502, headers=headers, body=_key_refused(worker, status))
    else:
        reply = Reply(status=status, headers=headers, body=content)
    return Attempt(result, reply, retryable=retryable(status=status, error=None))


def _abandon(worker: WorkerView, result: UpstreamResult, res: Resources) -> None:
    """An attempt that failed before its first byte and is retried elsewhere: it leaves the
    worker's in-flight count and counts on the worker's record as `resilience.worker_failed` says
    (an adapter's load failure does not); the request is settled once, by the attempt that answers."""
    res.inflight[worker.worker_id] = max(0, res.inflight.get(worker.worker_id, 1) - 1)
    metrics.IN_FLIGHT.dec()
    res.resilience.attempt_done(worker, result, live=len(res.workers))
    FAILOVER_RETRIES.inc()


def _upstream_unreachable(worker: WorkerView, error: httpx.HTTPError) -> bytes:
    silent = isinstance(error, FirstByteTimeout)
    what = "sent nothing within the first-byte bound (GATEWAY_FIRST_BYTE_TIMEOUT)" if silent else "could not be reached"
    return GatewayError(502, f"The serving worker {worker.worker_id} {what}; retry the request.",
                        code="upstream_unavailable").body()


def _key_refused(worker: WorkerView, status: int) -> bytes:
    """The client's answer when a worker refused the gateway's operator key: relaying the worker's
    401 would tell the client its own key is wrong, which the gateway already accepted."""
    return GatewayError(
        502, f"The serving worker {worker.worker_id} refused the gateway's operator key (HTTP {status}): the worker "
             "is misconfigured (its --api-key differs from the gateway's SERVING_WORKER_API_KEY, or it has none); "
             "your API key is fine. Retry the request; an operator must fix the worker's key.",
        code="upstream_misconfigured").body()
