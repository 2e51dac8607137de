"""Outlier ejection of serving workers, as Envoy's outlier detection does it (per gateway process).

A worker that fails `consecutive_failures` (5) requests in a row — connection failures and 5xx,
not a client's 4xx — is ejected: skipped by worker choice for `base_ejection_s` (30 s) times the
number of times it has been ejected, capped at `max_ejection_s` (300 s). A worker that then serves
a whole `base_ejection_s` without being ejected again earns one ejection back, so a worker that
failed once long ago starts from 30 s again. At most `max_ejection_fraction` (half) of the live
workers are ejected at once: past that the detector keeps routing to the failing worker rather
than concentrate all traffic on the few left (Envoy's `max_ejection_percent`).

Each gateway process detects on its own traffic, as each Envoy does; no Redis round trip. A
worker is known by its instance (`worker_id` plus its start time), so a restarted worker comes
back with a clean record as soon as it heartbeats.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from runtime.env import EnvModel, env

log = logging.getLogger(__name__)


class OutlierConfig(EnvModel):
    """Ejection of failing workers (settings.GATEWAY_OUTLIERS, from GATEWAY_OUTLIER_*)."""

    consecutive_failures: int = env(5, "GATEWAY_OUTLIER_CONSECUTIVE_FAILURES")
    base_ejection_s: float = env(30.0, "GATEWAY_OUTLIER_EJECTION_SECONDS")
    max_ejection_s: float = env(300.0, "GATEWAY_OUTLIER_MAX_EJECTION_SECONDS")
    max_ejection_fraction: float = env(0.5, "GATEWAY_OUTLIER_MAX_EJECTED_FRACTION")


@dataclass
class _Record:
    consecutive: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    # When the worker last left ejection (or was last credited back an ejection).
    healthy_since: float = 0.0


class OutlierDetector:
    def __init__(self, config: OutlierConfig = OutlierConfig(), *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self.ejections_total = 0

    def record(self, instance: str, *, failed: bool, live: int) -> bool:
        """Counts one request's outcome on `instance`; True when this one ejected it.

        `live` is how many workers are candidates now (the ejection cap is a share of them)."""
        now = self._clock()
        record = self._records.setdefault(instance, _Record(healthy_since=now))
        if not failed:
            record.consecutive = 0
            if record.ejections and now >= record.ejected_until and now - record.healthy_since >= self.config.base_ejection_s:
                record.ejections -= 1
                record.healthy_since = now
            return False
        record.consecutive += 1
        if record.consecutive < self.config.consecutive_failures or now < record.ejected_until:
            return False
        if self.ejected_count() + 1 > math.floor(live * self.config.max_ejection_fraction):
            return False
        record.ejections += 1
        record.consecutive = 0
        seconds = min(self.config.base_ejection_s * record.ejections, self.config.max_ejection_s)
        record.ejected_until = now + seconds
        record.healthy_since = record.ejected_until
        self.ejections_total += 1
        log.warning("worker %s ejected for %.0fs after %d consecutive failures (ejection %d)", instance, seconds,
                    self.config.consecutive_failures, record.ejections)
        return True

    def is_ejected(self, instance: str) -> bool:
        record = self._records.get(instance)
        return record is not None and self._clock() < record.ejected_until

    def ejected_count(self) -> int:
        now = self._clock()
        return sum(1 for record in self._records.values() if now < record.ejected_until)

    def forget_except(self, instances: Iterable[str]) -> None:
        """Drops the records of instances no longer live (gone or restarted), keeping memory bounded."""
        keep = set(instances)
        for instance in [item for item in self._records if item not in keep]:
            del self._records[instance]
