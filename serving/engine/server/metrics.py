"""Prometheus metrics of one serving worker, in a registry of its own.

Request metrics are observed by the HTTP layer as requests run; engine state (queue, running
sequences, KV cache, adapter residency, adapter loads) is read from the engine at scrape time, so a
scrape always shows the present and nothing has to be kept in sync. Names carry the `loraplex_`
prefix; latency histograms have no adapter label (their cardinality would grow with every tenant),
request and token counters do.

The time to the first token is broken down as vLLM's request-phase histograms do, into phases that
follow one another (``observe_first_token``): admission (the HTTP layer: an on-request adapter
load, the prompt, the checks, the worker's admission, the hand-over to the engine), queue and
prefill (inside the engine, measured there: serving.engine.outputs.FirstTokenTimes), and delivery
(the output made, across to this process, turned into a delta); they add up to at most the TTFT
observed beside them (docs/serving-worker.md, "Metrics").
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from serving.engine import EngineStats
from serving.engine.outputs import FirstTokenTimes
from serving.engine.server.registry_sync import SyncStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Outcomes of a request, the `status` label of loraplex_requests_total.
OK = "ok"
ABORTED = "aborted"  # the client went away, or the worker shut down before it finished
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
UNAVAILABLE = "unavailable"  # 503: loading, draining or over the queue bound
ERROR = "error"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# The TTFT's phases: admission and delivery take well under a millisecond when nothing is behind them.
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, *_LATENCY_BUCKETS)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "loraplex_requests",
            "Finished HTTP generation requests by model (base id or adapter name) and outcome.",
            ["model", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of admitted requests.", ["model"], registry=self.registry
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Generated tokens.", ["model"], registry=self.registry
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission = Histogram(
            "loraplex_request_admission_seconds",
            "From request arrival to the engine taking it (an on-request adapter load, the prompt built and checked, "
            "admission, the hand-over to the engine).",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "loraplex_request_queue_seconds",
            "From the engine taking a request to the step that first schedules its prompt (grammar, adapter, queue).",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "loraplex_request_prefill_seconds",
            "From the step that first schedules a request's prompt to its first token read from the device.",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.delivery = Histogram(
            "loraplex_request_first_token_delivery_seconds",
            "From a request's first token read from the device to its sending (output, engine to server, delta).",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "loraplex_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.slot_breaker_failures = Counter(
            "loraplex_lora_slot_breaker_failures",
            "Circuit-breaker failures this worker recorded for registry versions whose GPU slot was corrupted.",
            registry=self.registry,
        )
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self._sync = _SyncCollector()
        self.registry.register(self._sync)

    def observe_first_token(self, ttft: float, arrival_ns: int, sent_ns: int, times: FirstTokenTimes | None) -> None:
        """A request's TTFT and its phases. ``arrival_ns`` and ``sent_ns``: ``time.time_ns()`` read
        right after the TTFT's start and right before its end on the clock that measures it, so that
        what runs between the two reads lies outside every phase (FirstTokenTimes says why the
        phases across the engine's process take the wall clock). ``times`` None (an engine whose
        outputs have none) leaves the phases out."""
        self.ttft.observe(ttft)
        if times is None:
            return
        self.admission.observe((times.added_ns - arrival_ns) / 1e9)
        self.queue.observe(times.queue)
        self.prefill.observe(times.prefill)
        self.delivery.observe((sent_ns - times.first_token_ns) / 1e9)

    def render(self, stats: EngineStats | None, sync: SyncStats | None) -> bytes:
        """The exposition text, with engine state from `stats` (None while the model loads) and
        registry sync's counters (None without --registry-url)."""
        self._engine.stats = stats
        self._sync.stats = sync
        return generate_latest(self.registry)


S = TypeVar("S")


class _StatsCollector(Collector, Generic[S]):
    """Metric families read from `stats` at scrape time; nothing while `stats` is None."""

    stats: S | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.stats is not None:
            yield from self._families(self.stats)

    @abstractmethod
    def _families(self, stats: S) -> Iterator[Metric]: ...


class _EngineCollector(_StatsCollector[EngineStats]):
    """Engine state at scrape time; nothing while the model is still loading."""

    def _families(self, stats: EngineStats) -> Iterator[Metric]:
        yield GaugeMetricFamily("loraplex_num_requests_waiting", "Requests queued in the engine.", value=stats.num_waiting)
        yield GaugeMetricFamily("loraplex_num_requests_running", "Sequences in the running batch.", value=stats.num_running)
        yield GaugeMetricFamily(
            "loraplex_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).", value=stats.kv_usage
        )
        yield GaugeMetricFamily(
            "loraplex_kv_cache_blocks_used", "KV-cache blocks in use.", value=stats.kv_blocks_used
        )
        yield GaugeMetricFamily(
            "loraplex_kv_cache_blocks_total", "KV-cache blocks the cache may hand out (without those lent to adapters: --borrow-kv-memory).", value=stats.kv_blocks_total
        )
        if stats.cold_step_shapes is not None:
            yield GaugeMetricFamily(
                "loraplex_engine_cold_step_shapes",
                "Step shapes run since the warm-up whose kernels it did not run (a CUDA graph size, or an uncaptured "
                "step's Triton specialisation: 1, a multiple of 16 or other tokens; LoRA or not).",
                value=stats.cold_step_shapes,
            )
        if stats.cold_step_shapes is not None:
            yield CounterMetricFamily(
                "loraplex_engine_slow_steps",
                "Engine steps since the warm-up that took over 250 ms (the first 20 are logged at WARNING).",
                value=stats.slow_steps,
            )
        # The adaptive token budget's decisions (--decode-stall-target; zero while it is off): how often
        # the step-time model held prompts back for the decodes' sake, and how often the TTFT guard
        # overrode it. Their ratio is what tunes the target and the guard (docs/serving-worker.md).
        yield CounterMetricFamily(
            "loraplex_engine_budget_limited_steps",
            "Steps whose token budget the adaptive budget (--decode-stall-target) lowered to keep decodes fast.",
            value=stats.budget_limited_steps,
        )
        yield CounterMetricFamily(
            "loraplex_engine_wait_guard_steps",
            "Steps given the full token budget because a prompt had waited --decode-stall-max-wait-steps steps.",
            value=stats.wait_guard_steps,
        )
        if stats.cold_steps:
            # One series per cold key, so that one GPU run names the shapes the warm-up missed and
            # what each cost the step that met it first (the worker logs each once, at WARNING).
            cold = GaugeMetricFamily(
                "loraplex_engine_cold_step_seconds",
                "Seconds of the first step after the warm-up to run kernels it never ran (its inputs to the end "
                "of its forward on the device), by layout, kernel key (graph size or Triton specialisation), "
                "LoRA, and that step's own token count.",
                labels=["layout", "kernel_tokens", "lora", "step_tokens"],
            )
            for step in stats.cold_steps:
                layout, kernel_tokens, lora = step.kernels
                cold.add_metric([layout, str(kernel_tokens), str(lora).lower(), str(step.tokens)], step.seconds)
            yield cold
        yield CounterMetricFamily(
            "loraplex_prefill_tokens",
            "Prompt tokens the engine computed (again after a preemption; once for all n completions of a prompt).",
            value=stats.prefill_tokens,
        )
        yield CounterMetricFamily(
            "loraplex_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission (again after a preemption).",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "loraplex_prefix_cache_hits", "Prompt tokens of those lookups found in the prefix cache (not prefilled).",
            value=stats.prefix_cache_hits,
        )
        resident = GaugeMetricFamily(
            "loraplex_lora_resident",
            "1 for each loaded adapter in each tier where it is resident (gpu: a slot, cpu: the CPU cache).",
            labels=["adapter", "tier"],
        )
        for adapter in stats.adapters:
            resident.add_metric([adapter.name, "gpu"], 0.0 if adapter.gpu_slot is None else 1.0)
            resident.add_metric([adapter.name, "cpu"], 1.0 if adapter.in_cpu_cache else 0.0)
        yield resident
        yield GaugeMetricFamily(
            "loraplex_lora_slots_total", "Adapters that may be resident on the GPU at once (max_loras).",
            value=stats.max_loras,
        )
        yield GaugeMetricFamily(
            "loraplex_lora_slots_used",
            "Adapters resident on the GPU.",
            value=sum(1 for slot in stats.gpu_slots if slot is not None),
        )
        yield GaugeMetricFamily(
            "loraplex_lora_memory_bytes", "GPU bytes of the adapter row pool.",
            value=stats.lora_rows_total * stats.lora_row_bytes,
        )
        yield GaugeMetricFamily(
            "loraplex_lora_memory_used_bytes", "GPU bytes of the pool's rows that resident adapters own.",
            value=stats.lora_rows_used * stats.lora_row_bytes,
        )
        yield GaugeMetricFamily("loraplex_lora_cpu_cache_bytes", "Host bytes the CPU adapter cache may hold.",
                                value=stats.cpu_cache_bytes)  # fmt: skip
        yield GaugeMetricFamily("loraplex_lora_cpu_cache_used_bytes", "Host bytes of the CPU adapter cache's entries.",
                                value=stats.cpu_cache_bytes_used)  # fmt: skip
        yield CounterMetricFamily(
            "loraplex_lora_bytes_loaded", "Host-to-GPU bytes copied into the adapter pool.",
            value=stats.lora_bytes_loaded,
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_loads", "Adapters copied into the GPU pool.", value=stats.slot_loads
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_evictions", "Resident adapters evicted from the GPU pool to make room.",
            value=stats.slot_evictions,
        )
        yield CounterMetricFamily(
            "loraplex_lora_cpu_evictions", "Adapters dropped from the CPU cache to make room.",
            value=stats.cpu_evictions,
        )
        yield CounterMetricFamily(
            "loraplex_lora_fill_waits", "Admissions deferred while their adapter's copy into the GPU landed.",
            value=stats.fill_waits,
        )
        loads = SummaryMetricFamily(
            "loraplex_lora_load_seconds",
            "Adapter reads from storage into the CPU cache (validation and digest included).",
            count_value=stats.adapter_loads,
            sum_value=stats.adapter_load_seconds_total,
        )
        yield loads
        yield CounterMetricFamily(
            "loraplex_lora_load_failures", "Adapter loads that failed.", value=stats.adapter_load_failures
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_hits", "Admissions whose adapter was already in a GPU slot.", value=stats.slot_hits
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_misses", "Admissions that had to copy their adapter into a GPU slot first.",
            value=stats.slot_misses,
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_checks", "Checks of every occupied GPU slot's checksum.", value=stats.slot_checks
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_corruptions", "GPU slots whose content changed since they were written.",
            value=stats.slot_corruptions,
        )
        yield CounterMetricFamily(
            "loraplex_lora_slot_repairs", "GPU slots rewritten from storage after failing their checksum.",
            value=stats.slot_repairs,
        )
        yield CounterMetricFamily(
            "loraplex_lora_load_stalls", "Requests that waited for their adapter to be read from storage.",
            value=stats.adapter_load_stalls,
        )
        yield CounterMetricFamily(
            "loraplex_lora_prefetches",
            "Copies into the GPU pool and reads from storage the scheduler started for waiting requests' adapters.",
            value=stats.lora_prefetches,
        )
        yield CounterMetricFamily(
            "loraplex_lora_prefetch_hits", "Admissions whose adapter the scheduler's prefetch had copied into the GPU.",
            value=stats.lora_prefetch_hits,
        )


class _SyncCollector(_StatsCollector[SyncStats]):
    """Registry sync's progress: how an operator sees that a worker converges."""

    def _families(self, stats: SyncStats) -> Iterator[Metric]:
        yield CounterMetricFamily("loraplex_registry_snapshots", "Registry snapshots applied.", value=stats.snapshots)
        yield CounterMetricFamily(
            "loraplex_registry_snapshot_failures", "Registry snapshots that could not be fetched.",
            value=stats.snapshot_failures,
        )
        yield CounterMetricFamily("loraplex_registry_events", "Deploy events applied.", value=stats.events)
        yield CounterMetricFamily(
            "loraplex_registry_load_failures", "Served versions that could not be loaded.", value=stats.load_failures
        )
        yield GaugeMetricFamily(
            "loraplex_registry_revision", "Newest registry audit event this worker has applied.", value=stats.revision
        )
