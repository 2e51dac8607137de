"""Redis calls on a hot path, bounded in time, with a memory of Redis being away.

The gateway's buckets, breakers, prewarm counts and usage records go through it, and so does the
serving worker's breaker report (runtime.breakers): both sides share it with the breakers.

No request may hang on a dead Redis. Every shared-state call (buckets, breakers, prewarm counts)
goes through `RedisGuard.call`, which gives it `timeout_s` at most; a connection failure or a
timeout marks Redis unavailable, and for the next `retry_interval_s` no call tries Redis at all
(callers get None at once and use their process-local fallback). After that, one call at a time
probes it; the first that succeeds marks Redis available again. Each change is logged once, and
`available` / `outage_calls` feed the gateway's metrics.

A Lua error or a wrong command is a bug, not an outage: it propagates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from runtime.env import EnvModel, env

log = logging.getLogger(__name__)

T = TypeVar("T")

# What an unreachable, restarting or stalled Redis raises (BusyLoadingError: loading its data).
_OUTAGE = (ConnectionError, TimeoutError, BusyLoadingError, OSError, asyncio.TimeoutError)


class RedisGuardConfig(EnvModel):
    """Each call's bound and the pause after a failure."""

    timeout_s: float = env(0.25, "GATEWAY_REDIS_TIMEOUT")
    retry_interval_s: float = env(1.0, "GATEWAY_REDIS_RETRY_SECONDS")


_DEFAULT = RedisGuardConfig()


class RedisGuard:
    def __init__(self, *, timeout_s: float = _DEFAULT.timeout_s,
                 retry_interval_s: float = _DEFAULT.retry_interval_s,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self.available = True
        # Calls answered by a fallback because Redis was away (a counter for /metrics).
        self.outage_calls = 0
        self._retry_at = 0.0
        self._probing = False
        # Told True / False when Redis comes back / goes away (the gateway's metrics).
        self._on_change = on_change

    async def call(self, what: str, command: Callable[[], Awaitable[T]]) -> T | None:
        """`command()`'s result, or None when Redis is (or just turned out to be) unreachable."""
        if not self.available and (self._probing or self._clock() < self._retry_at):
            self.outage_calls += 1
            return None
        probing = not self.available
        self._probing = probing
        try:
            result = await asyncio.wait_for(command(), self.timeout_s)
        except _OUTAGE as exc:
            self._mark_down(what, exc)
            return None
        finally:
            if probing:
                self._probing = False
        if not self.available:
            self.available = True
            log.warning("Redis is reachable again: gateway state is shared again (%s succeeded)", what)
            if self._on_change is not None:
                self._on_change(True)
        return result

    def _mark_down(self, what: str, exc: BaseException) -> None:
        self.outage_calls += 1
        self._retry_at = self._clock() + self.retry_interval_s
        if self.available:
            self.available = False
            log.error("Redis unreachable (%s: %s: %s); the gateway serves from process-local buckets and "
                      "breakers until it is back, retrying every %.1fs", what, type(exc).__name__, exc,
                      self.retry_interval_s)
            if self._on_change is not None:
                self._on_change(False)

    @classmethod
    def from_config(cls, config: RedisGuardConfig, *,
                    on_change: Callable[[bool], None] | None = None) -> RedisGuard:
        return cls(timeout_s=config.timeout_s, retry_interval_s=config.retry_interval_s, on_change=on_change)
