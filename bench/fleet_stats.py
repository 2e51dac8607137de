"""bench/fleet.py's figures, from what the client saw and what the platform recorded: pure functions.

- per request (`Outcome`): sent when, first token when, how it ended;
- per worker (`WorkerSpread`): its share of the requests, the distinct adapters it served (from the
  gateway's usage records: the worker that answered each request) and its GPU-slot hit rate (from
  its own /metrics: bench/worker_metrics.window_metrics);
- how evenly both spread: the coefficient of variation (population standard deviation over the
  mean) of the workers' request counts and of their distinct adapters. 0 is perfectly even; affinity
  routing is meant to make the adapters uneven (each worker keeps its own) while the requests stay even.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# How a request ended, as the client saw it.
OK = "ok"  # 200 and the stream ran to [DONE]
REFUSED = "refused"  # an HTTP error status before any token
BROKEN = "broken"  # the stream ended with an error event or was cut after its first byte
TIMED_OUT = "timed_out"  # the client's bound ran out (nothing may hang)
UNREACHABLE = "unreachable"  # no connection to the web process, or dropped before its answer


@dataclass
class Outcome:
    seq: int
    adapter: str
    sent_at: float  # seconds since the trace started
    status: str = OK
    ttft: float | None = None  # to the first content event
    ended_at: float | None = None
    detail: str = ""


@dataclass
class WorkerSpread:
    worker_id: str
    requests: int = 0
    adapters: set[str] = field(default_factory=set)
    slot_hits: float | None = None
    slot_misses: float | None = None
    killed: bool = False

    @property
    def hit_rate(self) -> float | None:
        if self.slot_hits is None or self.slot_misses is None or not self.slot_hits + self.slot_misses:
            return None
        return self.slot_hits / (self.slot_hits + self.slot_misses)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (q in 0..1); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over the mean; NaN without values or with a zero mean."""
    if not values or not statistics.fmean(values):
        return math.nan
    return statistics.pstdev(values) / statistics.fmean(values)


def spread(served: Iterable[tuple[str, str]], worker_ids: Sequence[str]) -> dict[str, WorkerSpread]:
    """Per worker of `worker_ids`, the requests and distinct adapters of the (worker, adapter) pairs
    `served`; a pair naming another worker (none expected) gets an entry of its own."""
    workers = {worker_id: WorkerSpread(worker_id) for worker_id in worker_ids}
    for worker_id, adapter in served:
        entry = workers.setdefault(worker_id, WorkerSpread(worker_id))
        entry.requests += 1
        entry.adapters.add(adapter)
    return workers


def pooled_hit_rate(workers: Iterable[WorkerSpread]) -> float | None:
    """Slot hits over admissions, summed over the workers that report both."""
    hits = misses = 0.0
    for worker in workers:
        if worker.slot_hits is not None and worker.slot_misses is not None:
            hits, misses = hits + worker.slot_hits, misses + worker.slot_misses
    return hits / (hits + misses) if hits + misses else None


@dataclass
class PhaseSummary:
    """One policy's run of the trace."""

    policy: str
    outcomes: list[Outcome]
    workers: dict[str, WorkerSpread]
    completion_tokens: int = 0
    # After a kill: seconds from the SIGKILL to the dead worker leaving the registry's live list,
    # and to the last failover retry the gateway counted (its last attempt on the dead worker).
    registry_drop_s: float | None = None
    last_failover_s: float | None = None
    failovers: float = 0.0
    ejections: float = 0.0

    @property
    def ok(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.status == OK]

    def failed(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            if outcome.status != OK:
                counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts

    def ttfts(self) -> list[float]:
        return [outcome.ttft for outcome in self.ok if outcome.ttft is not None]

    def wall_s(self) -> float:
        ended = [outcome.ended_at for outcome in self.outcomes if outcome.ended_at is not None]
        return max(ended, default=0.0) - min((outcome.sent_at for outcome in self.outcomes), default=0.0)

    def hit_rate(self) -> float | None:
        return pooled_hit_rate(self.workers.values())

    def request_cv(self) -> float:
        return coefficient_of_variation([worker.requests for worker in self.workers.values()])

    def adapter_cv(self) -> float:
        return coefficient_of_variation([len(worker.adapters) for worker in self.workers.values()])

    def adapters_per_worker(self) -> float:
        """Mean distinct adapters per worker over distinct adapters in all: 1/K when each adapter
        stays on one worker, 1 when every worker serves every adapter."""
        union = set().union(*(worker.adapters for worker in self.workers.values()))
        if not union:
            return math.nan
        return statistics.fmean(len(worker.adapters) for worker in self.workers.values()) / len(union)
