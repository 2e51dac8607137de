"""Gateway usage in the database: the batched writer (Redis queue → UsageRecord rows) and the
queries the usage API and the dashboard read (`usage_summary`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDay
from redis.backoff import NoBackoff
from redis.retry import Retry

from serving.contracts.usage_log import UsageEvent, usage_flush_lock, usage_flush_unlock, usage_peek, usage_trim
from serving.registry.models import UsageRecord
from tenants.models import Tenant

log = logging.getLogger(__name__)

GROUP_BY = ("day", "adapter", "key")
# How long a usage read waits for another process's flush to end before answering without the
# records still queued (`complete: false`); a flush of 500 records takes milliseconds.
READ_FLUSH_WAIT_S = 5.0

# What an unreachable, restarting or frozen Redis raises (as runtime.redis_guard counts it).
_OUTAGE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError)


@dataclass
class _Queue:
    """The Redis that holds the queued records: a client for REDIS_URL, and until when (time.monotonic)
    the usage API leaves it alone after finding it away."""

    url: str
    client: redis.Redis
    away_until: float = 0.0


_queue: _Queue | None = None


def _queue_for_settings() -> _Queue:
    global _queue
    url = settings.REDIS_URL
    if _queue is None or _queue.url != url:
        if _queue is not None:
            _queue.client.close()
        # Bounded, and one attempt: a frozen Redis must not stall the usage API or the flusher (issues 16
        # and 23). Retries are spelled out because redis-py's defaults vary (a client made without a URL
        # retries a timed-out command 10 times, multiplying the wait); the flusher retries on its own
        # schedule and the usage API answers from the database instead.
        _queue = _Queue(url, redis.Redis.from_url(url, socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
                                                  socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT,
                                                  retry=Retry(NoBackoff(), 0)))
    return _queue


def _redis() -> redis.Redis:
    return _queue_for_settings().client


def _record(event: UsageEvent) -> UsageRecord:
    return UsageRecord(
        tenant_id=event.tenant_id, api_key_prefix=event.api_key_prefix, record_id=event.record_id,
        request_id=event.request_id,
        endpoint=event.endpoint, model=event.model[:200], adapter=event.adapter, version=event.version,
        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens, status=event.status,
        http_status=event.http_status, latency_ms=event.latency_ms, ttft_ms=event.ttft_ms, degraded=event.degraded,
        worker=event.worker[:200], created_at=datetime.fromtimestamp(event.created_at, tz=timezone.utc),
    )


def usage_records_flush(*, batch: int | None = None, wait_s: float = 10.0) -> int | None:
    """Move every queued usage record into the database, `batch` rows per insert; how many.

    Waits up to `wait_s` for a flush of another process to end (serving.contracts.usage_log: one
    flusher at a time, records trimmed off the queue only once written), then flushes; returns None
    without flushing when that flush is still going on. A batch the database refuses stays queued
    for the next flush. Records of a tenant deleted meanwhile are dropped, and a record already
    written (same record id) is not repeated.
    """
    size = batch or settings.GATEWAY.usage_batch
    client = _redis()
    token = usage_flush_lock(client, wait_s=wait_s)
    if token is None:
        return None
    written = 0
    try:
        while True:
            events, taken = usage_peek(client, size)
            if not taken:
                return written
            tenants = set(Tenant.objects.filter(id__in={event.tenant_id for event in events})
                          .values_list("id", flat=True))  # fmt: skip
            records = [_record(event) for event in events if event.tenant_id in tenants]
            try:
                UsageRecord.objects.bulk_create(records, ignore_conflicts=True)
            except DatabaseError:
                log.exception("could not write %d usage records; they stay queued", len(records))
                return written
            written += len(records)
            if not usage_trim(client, token, taken):
                log.warning("the usage flush lock expired during a write; the process holding it now carries on")
                return written
            if taken < size:
                return written
    finally:
        usage_flush_unlock(client, token)


def usage_records_flush_for_read() -> bool:
    """Flush before a read of the usage: True when every record the gateway queued is now in the
    database; False when Redis is unreachable (or was found so within GATEWAY_REDIS_RETRY_SECONDS),
    so the database's rows are all a reader gets. A Redis found away is left alone for that long, as
    the gateway's redis_guard does, so a frozen Redis costs one socket timeout, not one per request."""
    queue = _queue_for_settings()
    if time.monotonic() < queue.away_until:
        return False
    try:
        if usage_records_flush(wait_s=READ_FLUSH_WAIT_S) is None:
            log.warning("another process's usage flush held the lock for %.0f s: usage is answered without "
                        "the records still queued", READ_FLUSH_WAIT_S)
            return False
    except _OUTAGE as exc:
        queue.away_until = time.monotonic() + settings.GATEWAY_REDIS.retry_interval_s
        log.warning("Redis unreachable (%s: %s): usage is answered from the database without the records "
                    "still queued", type(exc).__name__, exc)
        return False
    return True


async def _flush_forever() -> None:
    while True:
        await asyncio.sleep(settings.GATEWAY.usage_flush_s)
        try:
            # Not thread-sensitive: this task outlives the request that started it, and that request's
            # thread-sensitive executor is gone once it ends ("CurrentThreadExecutor already quit").
            # wait_s=0: while another process flushes, this one has nothing to add.
            await sync_to_async(usage_records_flush, thread_sensitive=False)(wait_s=0.0)
        except Exception:
            log.exception("usage flush failed; retrying")


def usage_flusher_start() -> asyncio.Task:
    """The web process's background writer, on the running loop (started by the first request)."""
    return asyncio.get_running_loop().create_task(_flush_forever(), name="gateway-usage-flush")


def usage_summary(*, tenant: Tenant, start: datetime | None, end: datetime | None,
                  group_by: str | None) -> dict[str, Any]:
    """A tenant's usage in [start, end): totals, and rows per day, adapter or API key."""
    records = UsageRecord.objects.for_tenant(tenant)
    if start is not None:
        records = records.filter(created_at__gte=start)
    if end is not None:
        records = records.filter(created_at__lt=end)
    sums = dict(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                completion_tokens=Sum("completion_tokens"))

    def clean(row: dict[str, Any]) -> dict[str, Any]:
        row["prompt_tokens"] = row["prompt_tokens"] or 0
        row["completion_tokens"] = row["completion_tokens"] or 0
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        return row

    totals = clean(records.aggregate(**sums))
    totals["degraded_requests"] = records.filter(degraded=True).count()
    result: dict[str, Any] = {"object": "usage", "start": start, "end": end, "group_by": group_by, "totals": totals}
    if group_by == "day":
        rows = records.annotate(day=TruncDay("created_at")).values("day").annotate(**sums).order_by("day")
        result["data"] = [clean({**row, "day": row["day"].date().isoformat()}) for row in rows]
    elif group_by == "adapter":
        rows = records.values("adapter").annotate(**sums).order_by("adapter")
        result["data"] = [clean({**row, "adapter": row["adapter"] or None}) for row in rows]
    elif group_by == "key":
        rows = (records.annotate(api_key=F("api_key_prefix")).values("api_key").annotate(**sums).order_by("api_key"))
        result["data"] = [clean(row) for row in rows]
    return result
