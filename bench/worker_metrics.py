"""The serving worker's own adapter figures over a benchmark's window, read from its /metrics.

bench/serve.py scrapes /metrics before and after a run and reports the counter deltas: GPU hit
rate, adapter loads and bytes moved per second, CPU-cache evictions; and where the window's time to
the first token went, by the worker's phase histograms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

# Counters read before and after a run's window (serving/engine/server/metrics.py names them). The
# worker may not export all: one it lacks is None in the window's figures (printed "n/a").
_COUNTERS = {
    "slot_hits": "loraplex_lora_slot_hits_total",
    "slot_misses": "loraplex_lora_slot_misses_total",
    "slot_loads": "loraplex_lora_slot_loads_total",
    "slot_evictions": "loraplex_lora_slot_evictions_total",
    "bytes_loaded": "loraplex_lora_bytes_loaded_total",
    "cpu_evictions": "loraplex_lora_cpu_evictions_total",
    "storage_reads": "loraplex_lora_load_seconds_count",
    "load_stalls": "loraplex_lora_load_stalls_total",
    "slow_steps": "loraplex_engine_slow_steps_total",
}
# The worker's TTFT and its phases, which add up to at most it (serving/engine/server/metrics.py):
# each one's mean over the window, from its histogram's _sum and _count deltas.
TTFT_PHASES = {
    "ttft": "loraplex_time_to_first_token_seconds",
    "admission": "loraplex_request_admission_seconds",
    "queue": "loraplex_request_queue_seconds",
    "prefill": "loraplex_request_prefill_seconds",
    "delivery": "loraplex_request_first_token_delivery_seconds",
}
Samples = list[tuple[str, dict[str, str], float]]


async def scrape_metrics(client: httpx.AsyncClient) -> Samples | None:
    """The worker's /metrics as (sample name, labels, value); None when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get("/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(response.text) for s in f.samples]


def total(samples: Samples, name: str, keep: Callable[[dict[str, str]], bool] = lambda labels: True) -> float | None:
    values = [value for sample, labels, value in samples if sample == name and keep(labels)]
    return sum(values) if values else None


def delta(before: Samples, after: Samples, name: str) -> float | None:
    """How much sample ``name`` (summed over its labels) grew over the window; None where it is missing."""
    first, last = total(before, name), total(after, name)
    return None if first is None or last is None else last - first


def window_metrics(before: Samples | None, after: Samples | None, duration: float) -> dict[str, Any]:
    """The worker's adapter figures over one window: counter deltas, and from them the GPU hit rate
    (slot hits / (hits + misses)), adapter loads per second (slot loads; slot misses where the
    worker does not count loads apart) and bytes moved host -> GPU per second."""
    if before is None or after is None:
        return {"metrics": False}
    deltas = {key: delta(before, after, name) for key, name in _COUNTERS.items()}
    not_ok = [total(samples, "loraplex_requests_total", lambda labels: labels.get("status") != "ok") or 0.0
              for samples in (before, after)]
    hits, misses = deltas["slot_hits"], deltas["slot_misses"]
    admissions = (hits or 0) + (misses or 0)
    loads, loads_from = (deltas["slot_loads"], "slot_loads") if deltas["slot_loads"] is not None else (misses, "slot_misses")
    moved = deltas["bytes_loaded"]
    # Step shapes the worker's warm-up never ran that this window ran (None: no warm-up, or an older worker).
    cold_before, cold_after = (total(samples, "loraplex_engine_cold_step_shapes") for samples in (before, after))
    return {
        "cold_step_shapes": None if cold_before is None or cold_after is None else cold_after - cold_before,
        # Each cold step first met in the window, and those met before it (the bench's own warm-up).
        "cold_steps": cold_steps(before, after), "cold_steps_before": cold_steps([], before),
        "metrics": True, **deltas, "worker_not_ok": not_ok[1] - not_ok[0],
        "gpu_hit_rate": hits / admissions if hits is not None and admissions else None,
        "adapter_loads_per_s": loads / duration if loads is not None else None, "adapter_loads_from": loads_from,
        "bytes_moved_per_s": moved / duration if moved is not None else None,
        "ttft_phases_ms": ttft_phases(before, after),
    }  # fmt: skip


def ttft_phases(before: Samples, after: Samples) -> dict[str, float | None]:
    """The worker's mean TTFT and mean of each of its phases over the window, in ms (TTFT_PHASES'
    keys); None for one the worker does not export (an older worker) or no request observed."""
    means: dict[str, float | None] = {}
    for key, name in TTFT_PHASES.items():
        seconds, count = delta(before, after, f"{name}_sum"), delta(before, after, f"{name}_count")
        means[key] = 1000 * seconds / count if seconds is not None and count else None
    return means


def cold_steps(before: Samples, after: Samples) -> list[dict[str, Any]]:
    """The cold steps (loraplex_engine_cold_step_seconds) first met in this window: each one's
    layout, kernel key, LoRA, own token count and milliseconds, slowest first."""
    name = "loraplex_engine_cold_step_seconds"
    seen = {tuple(sorted(labels.items())) for sample, labels, _ in before if sample == name}
    steps = [{**labels, "ms": 1000 * value} for sample, labels, value in after
             if sample == name and tuple(sorted(labels.items())) not in seen]
    return sorted(steps, key=lambda step: -step["ms"])
