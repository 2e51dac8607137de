"""Usage records Redis did not take (it was away, or the batch failed): kept in the process
(`UsageBacklog`, one per event loop, owned by what records usage: serving.gateway.pipeline's
settling) and pushed once Redis is back, by the next request's record or, when none comes, by the
backlog's own pusher, every retry interval. Without the pusher a record made in the last moments of
an outage waited for a request that might never come, and a usage read after the outage missed it.
A record pushed twice (its push reached Redis though the reply did not) is written once: the
flusher skips a record id it has written (serving.contracts.usage_log)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from serving.gateway.accounting import release_after
from serving.gateway.key_budget import Reservation, spend_add
from serving.gateway.redis_batch import run_batch
from serving.contracts.usage_log import UsageEvent, usage_push
from runtime.redis_guard import RedisGuard

log = logging.getLogger(__name__)

# Usage records one process keeps while Redis is away (about 40 MB at most).
USAGE_BACKLOG_MAX = 100_000


def usage_pushes(events: list[UsageEvent]) -> Callable[[aioredis.client.Pipeline], None]:
    """What queues `events` and adds their tokens to their keys' spend, on a batch's pipeline."""

    def usage(pipe: aioredis.client.Pipeline) -> None:
        for item in events:
            usage_push(pipe, item)
            spend_add(pipe, item.api_key_prefix, item.prompt_tokens + item.completion_tokens, item.created_at)

    return usage


@dataclass
class UsageBacklog:
    """One event loop's kept usage records and their pusher, on its Redis and its guard."""

    redis: aioredis.Redis
    guard: RedisGuard
    events: list[UsageEvent] = field(default_factory=list)
    # The key-budget reservations of the calls those records settle: released in the round trip that
    # adds the records' spend, never before (serving.gateway.key_budget).
    reservations: list[Reservation] = field(default_factory=list)
    pusher: asyncio.Task[None] | None = None

    def take(self) -> tuple[list[UsageEvent], list[Reservation]]:
        """The records kept and their reservations (emptied: the caller pushes them now)."""
        backlog, self.events = self.events, []
        held, self.reservations = self.reservations, []
        return backlog, held

    def keep(self, events: list[UsageEvent], reservations: list[Reservation] | None = None) -> None:
        """Keep records Redis did not take, with their reservations, and start the pusher unless it runs."""
        self._hold(events)
        self.reservations.extend(reservations or ())
        if self.pusher is None or self.pusher.done():
            self.pusher = asyncio.get_running_loop().create_task(self._push())

    def _hold(self, events: list[UsageEvent]) -> None:
        """At most USAGE_BACKLOG_MAX records are held (the oldest dropped, logged)."""
        combined = [*self.events, *events]
        if len(combined) > USAGE_BACKLOG_MAX:
            log.error("usage backlog over %d records during the Redis outage; the oldest %d are dropped",
                      USAGE_BACKLOG_MAX, len(combined) - USAGE_BACKLOG_MAX)
        self.events = combined[-USAGE_BACKLOG_MAX:]

    async def _push(self) -> None:
        """Every retry interval while records are kept: push them (usage records and spend only; the
        refunds and breaker counts of an outage stay with this process's buckets and breakers)."""
        while self.events:
            await asyncio.sleep(self.guard.retry_interval_s)
            events, reservations = self.take()
            if not events:
                return
            try:
                replies = await self.guard.call("usage backlog", lambda: run_batch(
                    self.redis, [], release_after(usage_pushes(events), reservations)))
            except (aioredis.RedisError, OSError):
                replies = None
                log.exception("could not push %d kept usage records; retrying", len(events))
            if replies is None:
                self._hold(events)  # this task goes on pushing them
                self.reservations.extend(reservations)
