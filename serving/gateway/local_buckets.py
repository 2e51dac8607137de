"""Token buckets while Redis is away: per process, at the tier's rate divided by the processes.

Shared buckets (serving.gateway.quotas) need Redis. When it cannot be reached the gateway keeps
admitting — quotas fail open to a bounded degree — from buckets in this process's memory with the
same capacity and rate divided by GATEWAY_PROCESSES, so N processes together admit about the
tier's rate, not N times it. Each local bucket starts full when the outage starts (what a tenant
had used in the shared bucket is unknown here); that is the outage's only slack. When Redis answers
again the shared buckets take over as they were, and the local ones are dropped.

`GuardedBuckets` is the object the request path uses: the shared buckets through the RedisGuard,
the local ones when the guard says Redis is away. A refund goes to whichever side is in use at the
time it is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from serving.gateway.quotas import Admission, Bucket, BucketState, TokenBuckets
from serving.gateway.redis_batch import ScriptCall, run_batch
from runtime.redis_guard import RedisGuard


@dataclass
class _Level:
    level: float
    ts: float


class LocalTokenBuckets:
    """The admit and refund scripts' rules, in memory, each bucket scaled by `share`."""

    def __init__(self, *, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self._clock = clock
        self._levels: dict[str, _Level] = {}

    def _scaled(self, bucket: Bucket) -> Bucket:
        return Bucket(key=bucket.key, capacity=bucket.capacity * self.share, rate=bucket.rate * self.share)

    def _refilled(self, bucket: Bucket, now: float) -> _Level:
        state = self._levels.get(bucket.key)
        if state is None:
            state = self._levels[bucket.key] = _Level(level=bucket.capacity, ts=now)
        elif now > state.ts:
            state.level = min(bucket.capacity, state.level + (now - state.ts) * bucket.rate)
            state.ts = now
        return state

    def admit(self, costs: list[tuple[Bucket, float]]) -> Admission:
        now = self._clock()
        scaled = [(self._scaled(bucket), cost) for bucket, cost in costs]
        levels = [self._refilled(bucket, now) for bucket, _ in scaled]
        admitted = all(level.level >= cost for level, (_, cost) in zip(levels, scaled))
        states = []
        for level, (bucket, cost) in zip(levels, scaled):
            if admitted:
                level.level -= cost
            wait = 0.0 if admitted or level.level >= cost else (cost - level.level) / bucket.rate
            states.append(BucketState(bucket=bucket, level=level.level, wait_s=wait))
        return Admission(admitted=admitted, states=states)

    def refund(self, bucket: Bucket, amount: float) -> float:
        scaled = self._scaled(bucket)
        level = self._refilled(scaled, self._clock())
        level.level = min(scaled.capacity, level.level + amount)
        return level.level

    def clear(self) -> None:
        self._levels.clear()


class GuardedBuckets:
    """TokenBuckets' interface: shared in Redis, process-local while Redis is away."""

    def __init__(self, shared: TokenBuckets, *, guard: RedisGuard, processes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shared = shared
        self._guard = guard
        self.local = LocalTokenBuckets(share=1.0 / max(1, processes), clock=clock)
        self._was_local = False

    async def admit(self, costs: list[tuple[Bucket, float]], *, now: float | None = None) -> Admission:
        admission = await self._guard.call("bucket admit", lambda: self.shared.admit(costs, now=now))
        if admission is not None:
            self._back_to_shared()
            return admission
        self._was_local = True
        return self.local.admit(costs)

    async def admit_batched(self, client: aioredis.Redis, costs: list[tuple[Bucket, float]],
                            others: list[ScriptCall]) -> tuple[Admission, list[Any] | None]:
        """`admit` and the `others` scripts in one round trip (serving.gateway.redis_batch): the
        admission and the others' replies, or the local admission and None while Redis is away
        (the others did not run)."""
        replies = await self._guard.call("bucket admit", lambda: run_batch(
            client, [self.shared.admit_call(costs), *others]))
        if replies is not None:
            self._back_to_shared()
            return TokenBuckets.admission(costs, replies[0]), replies[1:]
        self._was_local = True
        return self.local.admit(costs), None

    async def refund(self, bucket: Bucket, amount: float, *, now: float | None = None) -> float:
        level = await self._guard.call("bucket refund", lambda: self.shared.refund(bucket, amount, now=now))
        if level is not None:
            self._back_to_shared()
            return level
        return self.local.refund(bucket, amount)

    def _back_to_shared(self) -> None:
        if self._was_local:
            self._was_local = False
            self.local.clear()
