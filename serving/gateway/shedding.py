"""Load shedding: refuse what cannot be served soon, rather than queue it behind everyone else.

As Stripe's load shedders do, by priority: when every candidate worker reports its waiting queue
at or over its bound, requests below vip priority (tier priority > 0) get 503 `server_overloaded`
with `retry-after`, and vip requests still queue. One worker with room is enough to admit
everyone: worker choice sends the request there.

A worker's bound is `queue_fraction` (half) of the waiting room it reports
(`max_queued_requests` in its registration: past it the worker itself answers 503), or, for a
worker that does not report it, `default_queue_bound`. The waiting queue counts the worker's
reported waiting requests plus what this gateway process has sent it since (heartbeats are
seconds old).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.env import EnvModel, env

VIP_PRIORITY = 0


class ShedConfig(EnvModel):
    """Load shedding (settings.GATEWAY_SHEDDING, from GATEWAY_SHED_*): a worker is full when its
    waiting queue reaches `queue_fraction` of its max_queued_requests (or of `default_queue_bound`
    when it reports none)."""

    queue_fraction: float = env(0.5, "GATEWAY_SHED_QUEUE_FRACTION")
    default_queue_bound: int = env(256, "GATEWAY_SHED_DEFAULT_QUEUE_BOUND")
    retry_after_s: float = env(1.0, "GATEWAY_SHED_RETRY_AFTER")


@dataclass(frozen=True)
class Saturation:
    """How full one worker is, from its registration document."""

    worker_id: str
    queue_depth: int
    max_queued_requests: int | None
    kv_cache_usage: float
    gpu_memory_free_bytes: int | None

    @classmethod
    def parse(cls, document: Mapping[str, Any]) -> Saturation:
        queued = document.get("max_queued_requests")
        free = document.get("gpu_memory_free_bytes")
        return cls(worker_id=str(document["worker_id"]), queue_depth=int(document.get("queue_depth") or 0),
                   max_queued_requests=int(queued) if queued is not None else None,
                   kv_cache_usage=float(document.get("kv_cache_usage") or 0.0),
                   gpu_memory_free_bytes=int(free) if free is not None else None)

    def queue_bound(self, config: ShedConfig) -> int:
        if self.max_queued_requests is None:
            return config.default_queue_bound
        return max(1, int(self.max_queued_requests * config.queue_fraction))


@dataclass(frozen=True)
class Shed:
    """A refusal: the message names the figures, retry after `retry_after_s`."""

    message: str
    retry_after_s: float


def shed_decision(workers: Sequence[Saturation], *, priority: int, inflight: Mapping[str, int],
                  config: ShedConfig = ShedConfig()) -> Shed | None:
    """None to go ahead; a Shed when every worker is over its bound and the caller is below vip."""
    if priority <= VIP_PRIORITY or not workers:
        return None
    depths = [(w.queue_depth + inflight.get(w.worker_id, 0), w.queue_bound(config)) for w in workers]
    if any(depth < bound for depth, bound in depths):
        return None
    figures = ", ".join(f"{w.worker_id} {depth}/{bound}" for w, (depth, bound) in zip(workers, depths))
    return Shed(message=f"Every serving worker is over its queue bound ({figures} waiting); requests below vip "
                        f"priority are refused until the queues drain. Retry after {config.retry_after_s:g} s.",
                retry_after_s=config.retry_after_s)
