"""The gateway's Prometheus metrics, served at `/metrics` on the web process.

With several web processes, set PROMETHEUS_MULTIPROC_DIR to a directory they share (emptied
before they start), as prometheus_client's multiprocess mode requires: every process writes its
samples there and any process's `/metrics` reports the sum over all of them (in-flight as the live
sum). Without it, `/metrics` reports this process alone.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

REQUESTS = Counter("loraplex_gateway_requests_total", "Requests answered by the gateway.",
                   ["tier", "endpoint", "status"])
RATE_LIMITED = Counter("loraplex_gateway_rate_limited_total", "Requests refused with 429 (over quota).", ["tier"])
DEGRADED = Counter("loraplex_gateway_degraded_total", "Requests over quota served by the base model instead.",
                   ["tier"])
UPSTREAM_FIRST_BYTE = Histogram("loraplex_gateway_upstream_first_byte_seconds",
                                "From sending to a serving worker to its first response bytes.",
                                buckets=_LATENCY_BUCKETS)
UPSTREAM_DURATION = Histogram("loraplex_gateway_upstream_duration_seconds",
                              "From sending to a serving worker to the end of its response.", ["status"],
                              buckets=_LATENCY_BUCKETS)
IN_FLIGHT = Gauge("loraplex_gateway_requests_in_flight", "Requests the gateway is relaying now.",
                  multiprocess_mode="livesum")


def render() -> tuple[bytes, str]:
    """The exposition text (all processes' in multiprocess mode) and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
