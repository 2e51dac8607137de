"""The worker's entry in Redis, which the gateway routes by (key layout: docs/serving-worker.md; the keys
are spelled once, in serving.contracts.registry).

- `loraplex:serving:worker:<worker_id>`: a JSON document (URL, base model, state, load, resident
  adapters, heartbeat time), written every heartbeat with a TTL of three heartbeats, so a worker
  that dies without deregistering disappears on its own.
- `loraplex:serving:workers`: a sorted set of worker ids scored by their last heartbeat (unix
  seconds), so a reader lists live workers with one ZRANGEBYSCORE instead of a SCAN.

Redis being down never stops the worker from serving: a failed heartbeat is logged and retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from serving.contracts.registry import WORKERS_KEY, worker_key

log = logging.getLogger(__name__)


class WorkerRegistration:
    """Heartbeats `describe()` into Redis every `interval` seconds, and at once after `poke()`."""

    def __init__(
        self,
        redis_url: str,
        *,
        worker_id: str,
        interval: float,
        describe: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.worker_id = worker_id
        self.interval = interval
        self.ttl = max(1, round(3 * interval))
        self._describe = describe
        self._redis = aioredis.Redis.from_url(redis_url)
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Publish now rather than at the next heartbeat (residency or state changed)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self.publish()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("worker heartbeat to Redis failed (retrying in %.1fs): %s", self.interval, exc)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            except TimeoutError:
                pass

    async def publish(self) -> None:
        now = time.time()
        document = {**(await self._describe()), "worker_id": self.worker_id, "heartbeat_at": now, "ttl": self.ttl}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(worker_key(self.worker_id), json.dumps(document), ex=self.ttl)
            pipe.zadd(WORKERS_KEY, {self.worker_id: now})
            # Readers skip members whose document expired; trimming here keeps the set small.
            pipe.zremrangebyscore(WORKERS_KEY, "-inf", now - 10 * self.ttl)
            await pipe.execute()

    async def deregister(self) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(worker_key(self.worker_id))
                pipe.zrem(WORKERS_KEY, self.worker_id)
                await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not deregister worker %s from Redis (its entry expires in %ss): %s", self.worker_id, self.ttl, exc)
        finally:
            await self._redis.aclose()
