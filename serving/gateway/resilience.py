"""The resilience steps of the request path; serving.gateway.pipeline calls each at one place.
Each decision is returned (a permit, a `VersionVerdict`, a refusal, a worker list); nothing here
writes the pipeline's `Call`.

    choose the version → its breaker permit, asked in the admission's round trip (`acquire_call`,
    `permit_from`; given back by `permit_unused` when the request is not admitted) →
    `version_permit` (breaker: a canary's open breaker sends its traffic to the active version; an
    active one's answers 503 adapter_unavailable, or the base model where the tier allows
    degradation) → choose the worker among `usable_workers` (outlier ejection), unless
    `shed_refusal` refuses (load shedding below vip) → each attempt, failover included, is counted
    by `attempt_done` (ejection) → the call's counts on the version's breaker and in the prewarm
    demand model go out with its usage record (`outcome_calls`, one round trip), and
    `outcome_recorded` reads the breaker's answer and judges a canary (auto-abort through the
    injected `CanaryAbort`, off the request path).

The policies are the Django-free modules next to this one (outliers, shedding, failover,
canary_rule, prewarm) and runtime.breakers; this module builds them from their configs (one
set per event loop, as the pipeline's other resources: serving.gateway.wiring passes the settings'
instances) and maps their answers onto the gateway's errors and headers. The canary's abort in the
registry is handed in (`CanaryAbort`), so nothing here reaches the database. docs/gateway.md
("Resilience") lists every rule with its default.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from serving.gateway.canary_rule import CanaryRuleConfig, canary_abort_reason
from serving.gateway.errors import GatewayError
from serving.gateway.outliers import OutlierConfig, OutlierDetector
from serving.gateway.ports import CanaryAbort
from serving.gateway.prewarm import DemandModel, PrewarmConfig
from serving.gateway.proxy import UpstreamResult
from serving.gateway.records import Call, TierLimits
from serving.gateway.redis_batch import ScriptCall
from serving.gateway.routing import WorkerView
from serving.gateway.shedding import Saturation, ShedConfig, shed_decision
from serving.gateway.version_pick import ServedSet, ServedVersion
from runtime.breakers import BreakerConfig, CircuitBreakers, Outcome, Permit, Snapshot, State
from runtime.redis_guard import RedisGuard, RedisGuardConfig
from serving.contracts.registry import SLOT_CORRUPTED

log = logging.getLogger(__name__)

# How long after starting a canary's abort this process leaves it alone.
JUDGE_INTERVAL_S = 5.0

REDIS_AVAILABLE = Gauge("loraplex_gateway_redis_available",
                        "1 while the gateway reaches Redis (shared buckets and breakers), 0 while it serves "
                        "from process-local state.", multiprocess_mode="livemin")
REDIS_OUTAGE_CALLS = Counter("loraplex_gateway_redis_fallback_total",
                             "Hot-path Redis calls answered by the process-local fallback.")
BREAKER_TRANSITIONS = Counter("loraplex_gateway_breaker_transitions_total",
                              "Circuit-breaker transitions of adapter versions.", ["to"])
BREAKER_REFUSED = Counter("loraplex_gateway_breaker_refused_total",
                          "Calls an open breaker kept from a version, by what happened instead.", ["then"])
SHED = Counter("loraplex_gateway_shed_total", "Requests refused with 503 server_overloaded.", ["tier"])
FAILOVER_RETRIES = Counter("loraplex_gateway_failover_retries_total",
                           "Requests retried on another worker after a failure before the first byte.")
EJECTIONS = Counter("loraplex_gateway_worker_ejections_total", "Workers ejected by outlier detection.")
CANARY_ABORTS = Counter("loraplex_gateway_canary_aborts_total", "Canaries aborted by the canary guard.")


# Worker error codes that report the worker's state, whatever the status or the point of the reply
# they arrive at: a stream stopped by a corrupted GPU slot ends with such an error event after its
# first token (the worker charged the version's breaker once itself for the corruption).
WORKER_STATE_CODES = frozenset({SLOT_CORRUPTED})


def breaker_outcome(result: UpstreamResult) -> Outcome:
    """The version's view of a call's final answer (after failover): a worker's 503 (loading,
    draining, over its queue bound, a corrupted slot), its refusal of the operator key
    (misconfigured) and an error whose code is in WORKER_STATE_CODES (a stream stopped by a
    corrupted slot) are the worker's state, and a 4xx, a client that left or the gateway's own
    failure (`gateway_fault`) says nothing of the adapter; other failures (5xx such as
    adapter_load_failed, no connection, a timeout, a stream that broke or ended with any other
    error event) count against it. The canary guard judges by
    the breaker's figures, so this is its rule too."""
    if result.status == "ok":
        return Outcome.SUCCESS
    if result.gateway_fault:
        return Outcome.IGNORED
    worker_state = (result.http_status == 503 or result.key_refused
                    or result.error_code in WORKER_STATE_CODES)
    if result.status == "upstream_error" and not worker_state:
        return Outcome.FAILURE
    return Outcome.IGNORED


# Worker error codes that are the adapter's, not the worker's: its artifact could not be loaded or
# does not match the registry's digest. They count on the version's breaker (that is what it is
# for), never toward the worker's ejection: a tenant's broken adapter must not take a worker out of
# routing for every other tenant.
ADAPTER_FAULT_CODES = frozenset({"adapter_load_failed", "adapter_digest_mismatch"})


def worker_failed(result: UpstreamResult) -> bool | None:
    """An attempt's outcome for its worker's outlier record: True (a failure: no connection, a
    timeout, a 5xx, a broken stream, a refusal of the operator key), False (a success), or None
    when it says nothing of the worker, which then counts neither way: the caller's own fault
    (the worker refused the request, 4xx), a caller that left, an ADAPTER_FAULT_CODES error, or the
    gateway's own failure (`gateway_fault`: a request it could not encode, a bug of its own)."""
    if result.status == "ok":
        return False
    if result.status != "upstream_error" or result.error_code in ADAPTER_FAULT_CODES or result.gateway_fault:
        return None
    return True


def _redis_changed(available: bool) -> None:
    REDIS_AVAILABLE.set(1 if available else 0)


@dataclass(frozen=True)
class VersionVerdict:
    """The breaker step's answer: the version that serves the call and its permit (both None on the
    base model), and why the base model answers instead of the adapter, when it does."""

    version: ServedVersion | None
    permit: Permit | None
    # The x-loraplex-degraded reason ("circuit_open") when the version's breaker sent it to the base model.
    degraded: str | None = None


@dataclass
class Resilience:
    """One event loop's breakers, outlier detector, demand model and the guard they share."""

    guard: RedisGuard
    breakers: CircuitBreakers
    outliers: OutlierDetector
    demand: DemandModel
    canary_rule: CanaryRuleConfig
    shed: ShedConfig
    canary_abort: CanaryAbort
    # Canaries whose abort this process started, and when (one attempt per JUDGE_INTERVAL_S).
    aborting: dict[str, float] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)

    @classmethod
    def build(cls, redis: aioredis.Redis, *, redis_guard: RedisGuardConfig, breakers: BreakerConfig,
              outliers: OutlierConfig, prewarm: PrewarmConfig, canary_rule: CanaryRuleConfig, shed: ShedConfig,
              canary_abort: CanaryAbort) -> Resilience:
        """One event loop's set, from the policies' configs (the settings' instances)."""
        guard = RedisGuard.from_config(redis_guard, on_change=_redis_changed)
        REDIS_AVAILABLE.set(1)
        return cls(guard=guard, breakers=CircuitBreakers(redis, breakers, guard=guard),
                   outliers=OutlierDetector(outliers), demand=DemandModel(redis, prewarm), canary_rule=canary_rule,
                   shed=shed, canary_abort=canary_abort)

    # ---- the version ------------------------------------------------------------------------

    def acquire_call(self, version: ServedVersion) -> ScriptCall:
        """The breaker's acquire for `version`, to run in the admission's round trip."""
        keys, args = self.breakers.script_args(version.qualified_name, "acquire")
        return ScriptCall(self.breakers.script, keys, args)

    def permit_from(self, version: ServedVersion, reply: list[Any] | None) -> Permit:
        """The permit `acquire_call`'s reply gives; None (Redis away): this process's breaker's."""
        name = version.qualified_name
        if reply is None:
            return CircuitBreakers.permit(name, self.breakers.run_local(name, "acquire"), shared=False)
        return CircuitBreakers.permit(name, CircuitBreakers.verdict(reply), shared=True)

    def permit_unused(self, permit: Permit | None) -> None:
        """A permit the request will not use (it was not admitted, or degraded): a half-open trial is
        given back, off the request path, as an ignored outcome does."""
        if permit is None or not permit.allowed or permit.state is not State.HALF_OPEN:
            return
        task = asyncio.get_running_loop().create_task(self.breakers.record(permit, Outcome.IGNORED, 0.0))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def version_permit(self, version: ServedVersion | None, permit: Permit | None, served: ServedSet | None,
                             *, degradable: bool, headers: dict[str, str]) -> VersionVerdict:
        """The chosen version's breaker (`permit`: the one asked with the admission, when the version
        was known then): the version that runs and its permit, rerouted to the active version when a
        canary's breaker is open, degraded to the base model (where `degradable`) or refused (503
        adapter_unavailable, raised, with `headers` and its retry-after) when the version's own is."""
        if version is None:
            return VersionVerdict(version=None, permit=None)
        if permit is None or permit.name != version.qualified_name:
            permit = await self.breakers.acquire(version.qualified_name)
        if not permit.allowed and served is not None and served.canary == version:
            BREAKER_REFUSED.labels("active_version").inc()
            if permit.state is State.OPEN and self._may_judge(version.qualified_name):
                # Whoever opened it may have died before aborting: judge from the breaker's figures.
                snapshot = await self.breakers.snapshot(version.qualified_name)
                reason = canary_abort_reason(canary=snapshot, active=None, config=self.canary_rule)
                if reason is not None:
                    self._abort_canary_later(served, reason=reason)
            version = served.active
            permit = await self.breakers.acquire(version.qualified_name)
        if permit.allowed:
            return VersionVerdict(version=version, permit=permit)
        retry = max(1, math.ceil(permit.retry_after_s))
        if degradable:
            BREAKER_REFUSED.labels("base_model").inc()
            return VersionVerdict(version=None, permit=None, degraded="circuit_open")
        BREAKER_REFUSED.labels("refused").inc()
        raise GatewayError(
            503, f"The adapter version {version.version} of '{version.adapter}' is failing and its circuit breaker "
                 f"is open; retry in {retry} s.", code="adapter_unavailable",
            headers={**headers, "retry-after": str(retry)})

    # ---- the workers ------------------------------------------------------------------------

    @staticmethod
    def instance(worker: WorkerView) -> str:
        """A worker process's identity: a restarted worker is a new instance with a clean record."""
        return f"{worker.worker_id}@{worker.started_at}"

    def usable_workers(self, candidates: list[WorkerView]) -> list[WorkerView]:
        """The candidates less the ejected ones."""
        self.outliers.forget_except(self.instance(worker) for worker in candidates)
        return [worker for worker in candidates if not self.outliers.is_ejected(self.instance(worker))]

    def shed_refusal(self, tier: TierLimits, candidates: list[WorkerView],
                     inflight: dict[str, int], headers: dict[str, str]) -> GatewayError | None:
        """503 server_overloaded (with `headers` and its retry-after) below vip when every candidate is
        over its queue bound; None: served."""
        saturations = [Saturation(worker_id=w.worker_id, queue_depth=w.queue_depth,
                                  max_queued_requests=w.max_queued_requests, kv_cache_usage=w.kv_cache_usage,
                                  gpu_memory_free_bytes=w.gpu_memory_free_bytes) for w in candidates]
        shed = shed_decision(saturations, priority=tier.priority, inflight=inflight, config=self.shed)
        if shed is None:
            return None
        SHED.labels(tier.name).inc()
        return GatewayError(503, shed.message, code="server_overloaded",
                            headers={**headers, "retry-after": str(max(1, math.ceil(shed.retry_after_s)))})

    def attempt_done(self, worker: WorkerView, result: UpstreamResult, *, live: int) -> None:
        """One attempt on `worker` is over: counted on its outlier record as `worker_failed` says."""
        failed = worker_failed(result)
        if failed is not None and self.outliers.record(self.instance(worker), failed=failed, live=live):
            EJECTIONS.inc()

    # ---- the outcome ------------------------------------------------------------------------

    def _code(self, result: UpstreamResult) -> int:
        duration = result.first_byte_s if result.first_byte_s is not None else (result.ended_s or 0.0)
        return self.breakers.code(breaker_outcome(result), duration)

    def outcome_calls(self, call: Call, result: UpstreamResult) -> list[ScriptCall]:
        """The scripts that count the call, for its settling round trip: on its version's breaker
        (when the permit came from Redis; a local permit is counted locally), then in the demand
        model. None on the base model."""
        version, permit = call.version, call.permit
        if version is None or permit is None:
            return []
        calls = [self.demand.record_call(version.qualified_name, time.time())]
        if permit.shared:
            keys, args = self.breakers.script_args(permit.name, "record", permit.epoch, self._code(result))
            calls.insert(0, ScriptCall(self.breakers.script, keys, args))
        return calls

    async def outcome_recorded(self, call: Call, result: UpstreamResult, replies: list[Any] | None) -> None:
        """`outcome_calls` ran (their replies; None: Redis was away, and nothing of them ran): the
        breaker's answer (this process's own breaker's when the permit was local or Redis away),
        its transition logged; a canary judged."""
        version, permit = call.version, call.permit
        if version is None or permit is None:
            return
        if permit.shared and replies is not None:
            snapshot = CircuitBreakers.snapshot_of(permit.name, CircuitBreakers.verdict(replies[0]), shared=True)
        else:
            verdict = self.breakers.run_local(permit.name, "record", permit.epoch, self._code(result))
            snapshot = CircuitBreakers.snapshot_of(permit.name, verdict, shared=False)
        if snapshot.transition is not None:
            BREAKER_TRANSITIONS.labels(snapshot.transition.value).inc()
            log.warning("circuit breaker of %s is now %s (%d of %d calls failed, %d slow)", version.qualified_name,
                        snapshot.transition.value, snapshot.failures, snapshot.calls, snapshot.slow_calls)
        await self._judge_canary(call, snapshot)

    async def _judge_canary(self, call: Call, snapshot: Snapshot) -> None:
        served = call.target.served
        if served is None or served.canary is None or call.version != served.canary:
            return
        active = None
        if snapshot.state is State.CLOSED and snapshot.calls >= self.canary_rule.minimum_calls:
            active = await self.breakers.snapshot(served.active.qualified_name)
        reason = canary_abort_reason(canary=snapshot, active=active, config=self.canary_rule)
        if reason is not None:
            self._abort_canary_later(served, reason=reason)

    def _may_judge(self, name: str) -> bool:
        """False while this process's abort of `name` is recent: the served versions it sees are
        cached (GATEWAY_CACHE_SECONDS), so the aborted canary is still picked for a moment."""
        started = self.aborting.get(name)
        return started is None or time.monotonic() - started > JUDGE_INTERVAL_S

    def _abort_canary_later(self, served: ServedSet, *, reason: str) -> None:
        """Aborts the served set's canary in the registry, off the request path, once per process at a time."""
        canary = served.canary
        if canary is None or not self._may_judge(canary.qualified_name):
            return
        self.aborting[canary.qualified_name] = time.monotonic()

        async def abort() -> None:
            try:
                if await self.canary_abort(canary, reason):
                    CANARY_ABORTS.inc()
            except Exception:
                log.exception("canary guard could not abort %s; the next verdict tries again", canary.qualified_name)
                self.aborting.pop(canary.qualified_name, None)

        # A fresh context: inherited from the request, the abort's sync_to_async (the registry's ORM,
        # serving.gateway.wiring) would run on that request's thread executor, gone once it ends.
        task = asyncio.get_running_loop().create_task(abort(), context=contextvars.Context())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
