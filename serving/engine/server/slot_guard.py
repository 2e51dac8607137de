"""The worker's slot-integrity guard (docs/resilience.md, "Slot integrity"): checks every GPU slot's
checksum on request and every ``--slot-verify-interval`` seconds, and reports what it found.

The check and the repair are the engine's (``AsyncEngine.verify_slots``: the requests that had
produced tokens from a slot whose content changed since it was written are stopped, then the slot
is re-read from storage, digest-verified, and rewritten); it runs on the engine thread between two
steps, never inside one. What this adds is the reporting: a log
line, ``/metrics`` (``loraplex_lora_slot_corruptions_total`` and its neighbours, from the engine's
counters) and one failure on the shared circuit breaker of every registry version the slot held.

Why the worker records on the breaker itself (docs/resilience.md, "Slot integrity"): it is the
only process that knows, it already has the Redis the breakers live in (``--redis-url``, its
registration), and the breaker's one Lua script (``runtime.breakers``, the Django-free layer
both sides import; the engine never imports the gateway) is what the gateway calls too, so a
corruption counts exactly as one failed call of that version, in every gateway process at once.
The thresholds are the platform settings' one instance (``runtime.settings``, the
``GATEWAY_BREAKER_*`` variables), which the web process's settings hold too. Names that are not
registry versions have no breaker.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from prometheus_client import Counter

from serving.engine.engine_client import EngineClient, EngineDeadError
from serving.engine.stats import SlotRepair
from runtime.breakers import CircuitBreakers, Outcome
from serving.contracts.names import in_registry_form
from runtime.redis_guard import RedisGuard
from runtime.settings import platform_settings

log = logging.getLogger(__name__)


class SlotGuard:
    def __init__(self, engine: EngineClient, *, interval: float, redis_url: str | None, breaker_failures: Counter) -> None:
        self._engine = engine
        self._interval = interval
        self._redis: aioredis.Redis | None = None
        self._breakers: CircuitBreakers | None = None
        if redis_url:
            self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            self._breakers = CircuitBreakers(self._redis, platform_settings().breakers, guard=RedisGuard())
        self._breaker_failures = breaker_failures

    async def verify(self) -> list[SlotRepair]:
        """Check every occupied slot now; the slots found changed (their repair is under way)."""
        repairs = await self._engine.verify_slots()
        for repair in repairs:
            log.error("GPU slot %d no longer holds adapter %s (%s): its checksum changed; %d request(s) that had "
                      "produced tokens from it stopped, reloading it from storage", repair.slot, repair.digest[:12],
                      ", ".join(repair.names) or "no name", repair.stopped)
            for name in repair.names:
                if in_registry_form(name):
                    await self._record_failure(name)
        return repairs

    async def run(self) -> None:
        """Verify every ``interval`` seconds until cancelled (or the engine stops); 0: never."""
        if self._interval <= 0:
            return
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.verify()
            except EngineDeadError:
                return
            except Exception:
                log.exception("slot verification failed; trying again in %.0fs", self._interval)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    async def _record_failure(self, name: str) -> None:
        if self._breakers is None:
            return
        permit = await self._breakers.acquire(name)
        if not permit.allowed:
            return  # open already: there is nothing to add to a verdict that has been reached
        snapshot = await self._breakers.record(permit, Outcome.FAILURE, 0.0)
        self._breaker_failures.inc()
        if snapshot.transition is not None:
            log.warning("circuit breaker of %s is now %s after a corrupted slot", name, snapshot.transition.value)
