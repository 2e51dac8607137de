"""Usage records Redis did not take (it was away, or the batch failed): kept in the process
(`Resilience.usage_backlog`) and pushed once Redis is back, by the next request's record or,
when none comes, by the backlog's own pusher, every retry interval. Without the pusher a record
made in the last moments of an outage waited for a request that might never come, and a usage read
after the outage missed it. A record pushed twice (its push reached Redis though the reply did
not) is written once: the flusher skips a record id it has written (serving.gateway.usage_log)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from serving.gateway.key_budget import spend_add
from serving.gateway.redis_batch import run_batch
from serving.gateway.resilience import Resilience
from serving.gateway.usage_log import UsageEvent, usage_push

log = logging.getLogger(__name__)


def usage_pushes(events: list[UsageEvent]) -> Callable[[aioredis.client.Pipeline], None]:
    """What queues `events` and adds their tokens to their keys' spend, on a batch's pipeline."""

    def usage(pipe: aioredis.client.Pipeline) -> None:
        for item in events:
            usage_push(pipe, item)
            spend_add(pipe, item.api_key_prefix, item.prompt_tokens + item.completion_tokens, item.created_at)

    return usage


def keep_usage(events: list[UsageEvent], resilience: Resilience, redis: aioredis.Redis) -> None:
    """Keep records Redis did not take, and start the pusher unless it runs."""
    resilience.usage_backlog_keep(events)
    pusher = resilience.backlog_pusher
    if pusher is None or pusher.done():
        resilience.backlog_pusher = asyncio.get_running_loop().create_task(_push_backlog(resilience, redis))


async def _push_backlog(resilience: Resilience, redis: aioredis.Redis) -> None:
    """Every retry interval while records are kept: push them (usage records and spend only; the
    refunds and breaker counts of an outage stay with this process's buckets and breakers)."""
    while resilience.usage_backlog:
        await asyncio.sleep(resilience.guard.retry_interval_s)
        events = resilience.usage_backlog_take()
        if not events:
            return
        try:
            replies = await resilience.guard.call("usage backlog", lambda: run_batch(redis, [], usage_pushes(events)))
        except (aioredis.RedisError, OSError):
            replies = None
            log.exception("could not push %d kept usage records; retrying", len(events))
        if replies is None:
            resilience.usage_backlog_keep(events)
