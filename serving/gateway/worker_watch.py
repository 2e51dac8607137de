"""A whole (non-streamed) reply's bound on a worker that went silent (issue 37, item 7).

A worker sends a stream's response head with its first token, so a stream's first-byte bound
(GATEWAY_FIRST_BYTE_TIMEOUT, serving.gateway.stream_http) catches a worker that took the request and
froze. A whole reply's head comes with its last token, which may rightly take minutes, so its wait
is judged by the worker's heartbeat instead: once the first-byte bound has passed, and then every
WATCH_INTERVAL_S, the gateway reads the worker's registry entry, and gives the call up (closing
its connection; FirstByteTimeout, which the pipeline fails over on and counts as the worker's
failure) when the entry is gone or is another instance's (a frozen process stops heartbeating, so
its entry expires within three heartbeats; a restarted one lost the request). A draining worker
keeps heartbeating until it stops, so its calls finish. While Redis is away the call goes on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis

from serving.gateway.routing import WorkerView
from serving.gateway.stream_http import FirstByteTimeout
from runtime.redis_guard import RedisGuard
from serving.contracts.registry import worker_key

# How often a whole reply's worker is looked up once the first-byte bound has passed: about a
# heartbeat, so a frozen worker is given up on within a few seconds of its entry expiring.
WATCH_INTERVAL_S = 2.0

T = TypeVar("T")


async def _still_there(worker: WorkerView, redis: aioredis.Redis, guard: RedisGuard) -> bool:
    """False when the worker's registry entry is gone or is another instance's; True while it is
    there, or while Redis is away (nothing is known then)."""
    raw = await guard.call("worker watch", lambda: redis.get(worker_key(worker.worker_id)))
    if raw is None:
        return not guard.available
    try:
        started_at = float(json.loads(raw).get("started_at") or 0.0)
    except (ValueError, TypeError, AttributeError):
        return True
    return started_at == worker.started_at


async def unless_worker_gone(work: Awaitable[T], *, worker: WorkerView, redis: aioredis.Redis, guard: RedisGuard,
                             first_check_s: float, every_s: float = WATCH_INTERVAL_S) -> T:
    """`work`'s result; cancelled, as FirstByteTimeout, once the worker has left the registry
    (looked at after `first_check_s`, then every `every_s`)."""
    task = asyncio.ensure_future(work)
    wait = first_check_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return task.result()
            if not await _still_there(worker, redis, guard):
                raise FirstByteTimeout(f"The worker {worker.worker_id} left the registry (its heartbeat stopped) "
                                       f"with no reply after {first_check_s:g} s.")
            wait = every_s
    finally:
        if not task.done():
            task.cancel()  # closes the call's connection: a worker still alive aborts the request
            await asyncio.gather(task, return_exceptions=True)
