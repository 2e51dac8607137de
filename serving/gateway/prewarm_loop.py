"""The prewarm loop: every `interval_s`, the top predicted adapter versions are prefetched into
the serving workers' GPU slots and CPU caches ahead of their traffic (docs/resilience.md,
"Predictive prewarm").

It runs in the gateway processes, beside the demand model it reads (serving.gateway.prewarm) and
the worker list they route by; a Redis lock (`SET NX` with an expiry just under the interval)
lets one process per interval do a round, whichever takes it first, so N gateways cost one round
and a process that dies simply stops taking the lock. A round:

1. the lock, else nothing;
2. the demand model's ranking: at most `max_adapters` versions, each predicted above `min_rate`
   requests per second (0 by default: any demand at all ranks; the plan fills only the workers'
   capacity, so what is placed always out-ranks what it displaces);
3. the versions still served (active or canary) with their artifact and digest, from the
   registry (`served`: the Django side, so an aborted or archived version is not prefetched);
4. the plan over the live workers (serving.gateway.prewarm_plan);
5. each worker's part, in one `POST /v1/prefetch_lora_adapters` per worker with the operator key,
   the workers in parallel. The worker never evicts a pinned or busy slot for it, nor one holding
   another version of the same call's slot part; it answers once the slot placements are done
   and reads the CPU-only ones after (`queued`), until the next round's call supersedes them, so
   a round takes about as long as its slot placements and rounds keep to their interval.

Nothing here is on a request's path; a round that fails (Redis away, a worker down) is logged
and the next one starts afresh. While Redis is away the lock cannot be taken and no round runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx
import redis.asyncio as aioredis

from serving.gateway.prewarm import KEY_PREFIX, DemandModel
from serving.gateway.prewarm_plan import Placement, plan_prefetch
from serving.gateway.routing import WorkerView
from serving.gateway.version_pick import ServedVersion
from runtime.env import EnvModel, env
from runtime.redis_guard import RedisGuard

log = logging.getLogger(__name__)

LOCK_KEY = KEY_PREFIX + "lock"
PREFETCH_PATH = "/v1/prefetch_lora_adapters"


class PrewarmLoopConfig(EnvModel):
    """The prewarm loop (settings.GATEWAY_PREWARM_LOOP): one round per `interval_s` across all
    gateway processes (0: no loop), at most `max_adapters` versions, each predicted at least
    `min_per_hour` requests per hour (as an operator counts them; `min_rate` per second)."""

    interval_s: float = env(30.0, "GATEWAY_PREWARM_INTERVAL_SECONDS")
    max_adapters: int = env(256, "GATEWAY_PREWARM_MAX_ADAPTERS")
    min_per_hour: float = env(0.0, "GATEWAY_PREWARM_MIN_PER_HOUR")
    # A version goes into a CPU cache by a storage read only if its predicted rate × interval_s
    # (the requests expected before the next round ranks afresh) reaches this; slot placements
    # and versions already in memory are not held to it (docs/resilience.md, "Predictive prewarm").
    min_expected: float = env(1.0, "GATEWAY_PREWARM_MIN_EXPECTED")

    @property
    def min_rate(self) -> float:
        """`min_per_hour` in requests per second, the demand model's unit."""
        return self.min_per_hour / 3600.0


@dataclass
class RoundReport:
    """What one round did: versions placed in slots / CPU caches as the workers answered, and
    those queued for the CPU caches after the answer."""

    planned: int = 0
    gpu: int = 0
    cpu: int = 0
    queued: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


Served = Callable[[list[str]], Awaitable[dict[str, ServedVersion]]]
Workers = Callable[[], Awaitable[list[WorkerView]]]


class Prewarmer:
    def __init__(self, *, redis: aioredis.Redis, demand: DemandModel, guard: RedisGuard, workers: Workers,
                 served: Served, client: httpx.AsyncClient, api_key: str,
                 config: PrewarmLoopConfig = PrewarmLoopConfig()) -> None:
        self.config = config
        self._redis = redis
        self._demand = demand
        self._guard = guard
        self._workers = workers
        self._served = served
        self._client = client
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    async def run(self) -> None:
        """Rounds every interval until cancelled."""
        while True:
            try:
                report = await self.round(time.time())
                if report is not None and (report.failed or report.planned):
                    log.info("prewarm: %d planned, %d in GPU slots, %d in CPU caches, %d queued for them, "
                             "%d failed%s", report.planned, report.gpu, report.cpu, report.queued, report.failed,
                             f" ({'; '.join(report.errors[:3])})" if report.errors else "")
            except Exception:
                log.exception("prewarm round failed; the next one starts afresh")
            await asyncio.sleep(self.config.interval_s)

    async def round(self, now: float, *, locked: bool = True) -> RoundReport | None:
        """One round at unix time `now`; None when another process holds this interval's lock
        (or Redis is away). `locked=False` skips the lock (one process alone, the benchmark)."""
        if locked and not await self._take_lock():
            return None
        ranked = await self._guard.call("prewarm ranking", lambda: self._demand.top(self.config.max_adapters, now))
        if not ranked:
            return RoundReport()
        names = [name for name, rate in ranked if rate > self.config.min_rate]
        served = await self._served(names) if names else {}
        names = [name for name in names if name in served]
        workers = await self._workers()
        wanted = set(names)
        readable = {name for name, rate in ranked
                    if name in wanted and rate * self.config.interval_s >= self.config.min_expected}
        plan = plan_prefetch(names, workers, readable)
        by_id = {worker.worker_id: worker for worker in workers}
        report = RoundReport(planned=sum(len(items) for items in plan.values()))
        await asyncio.gather(*(self._send(by_id[worker_id], items, served, report)
                               for worker_id, items in plan.items()))
        return report

    async def _take_lock(self) -> bool:
        ttl_ms = max(1, int(self.config.interval_s * 900))  # expires just before the next round is due

        async def take() -> bool:
            return bool(await self._redis.set(LOCK_KEY, self._token, nx=True, px=ttl_ms))

        return bool(await self._guard.call("prewarm lock", take))

    async def _send(self, worker: WorkerView, items: Sequence[Placement], served: dict[str, ServedVersion],
                    report: RoundReport) -> None:
        body = {"adapters": [{"lora_name": item.name, "artifact_uri": served[item.name].artifact_uri,
                              "manifest_sha256": served[item.name].manifest_sha256, "to_gpu": item.to_gpu}
                             for item in items]}
        try:
            response = await self._client.post(f"{worker.url}{PREFETCH_PATH}", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            report.failed += len(items)
            report.errors.append(f"{worker.worker_id}: {type(exc).__name__}: {exc}")
            return
        if response.status_code != 200:
            report.failed += len(items)
            report.errors.append(f"{worker.worker_id}: HTTP {response.status_code} {response.text[:200]}")
            return
        for entry in response.json().get("data", []):
            if entry.get("gpu"):
                report.gpu += 1
            elif entry.get("cpu"):
                report.cpu += 1
            elif entry.get("queued"):
                report.queued += 1
            if entry.get("error"):
                report.failed += 1
                report.errors.append(f"{worker.worker_id}: {entry.get('lora_name')}: {entry['error']}")
