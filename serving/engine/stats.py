"""Snapshots of the engine's state for metrics and the adapter endpoints (immutable values, safe to
read from another thread)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.block_manager import BlockManager
    from serving.engine.config import EngineConfig
    from serving.engine.lora.cache import LoRACache
    from serving.engine.lora.integrity import SlotChecksums
    from serving.engine.lora.records import CachedAdapter
    from serving.engine.model_runner import ColdStep, ModelRunner
    from serving.engine.scheduler import Scheduler


@dataclass(frozen=True)
class LoRAInfo:
    """One named adapter: what it is and where it lives right now."""

    name: str
    path: str
    digest: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    gpu_slot: int | None
    gpu_row: int | None  # its first row in the GPU adapter pool, while resident
    in_cpu_cache: bool
    active_requests: int
    load_seconds: float
    kind: str = "lora"  # serving.contracts.artifact.ADAPTER_KINDS: "lora" or "dora"


@dataclass(frozen=True)
class SlotRepair:
    """A GPU slot whose checksum failed: which adapter it held (its re-read from storage is under
    way) and how many requests were stopped because they had produced tokens from it."""

    slot: int
    digest: str
    names: tuple[str, ...]
    stopped: int


@dataclass
class TokenCounts:
    """The engine's token counters: prompts queued, prompt tokens prefilled, tokens generated."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generation_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """Counters are totals since start; the rest is the state after the last step."""

    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    num_preemptions: int
    peak_waiting: int
    steps: int
    prompt_tokens: int
    # Prompt tokens computed by steps (again after a preemption); a request's n sequences share one
    # prefill, so n = 4 adds its prompt once.
    prefill_tokens: int
    generation_tokens: int
    # Prefix caching: prompt tokens looked up at admission (again after a preemption), those found
    # cached (the hit rate is hits / queries), and the KV blocks registered in the cache now.
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_blocks_cached: int
    max_loras: int
    max_cpu_loras: int
    adapters_loading: int
    adapter_loads: int
    adapter_load_failures: int
    adapter_load_seconds_total: float
    adapter_last_load_seconds: float
    slot_loads: int
    slot_evictions: int
    cpu_evictions: int
    slot_waits: int
    # Admissions whose adapter was already in a GPU slot, and those that had to copy it in first:
    # the GPU-slot hit rate is hits / (hits + misses). A request counts again after a preemption.
    slot_hits: int
    slot_misses: int
    # The GPU adapter pool (docs/adapter-memory.md): its rows, those resident adapters own, one
    # row's bytes; host-to-device bytes copied in; admissions that waited for a copy to land.
    lora_rows_total: int
    lora_rows_used: int
    lora_row_bytes: int
    lora_bytes_loaded: int
    fill_waits: int
    cpu_cache_bytes: int
    cpu_cache_bytes_used: int
    # Requests that had to wait for their adapter to be read from storage (each counts once).
    adapter_load_stalls: int
    # Slot integrity: verifications run, slots found changed since written, slots rewritten.
    slot_checks: int
    slot_corruptions: int
    slot_repairs: int
    # The scheduler's look-ahead (EngineConfig.lora_prefetch_groups): copies into the GPU pool and reads
    # from storage it started for waiting requests, and admissions that found an adapter it had copied in.
    lora_prefetches: int
    lora_prefetch_hits: int
    gpu_slots: tuple[str | None, ...]
    cpu_cached: tuple[str, ...]
    adapters: tuple[LoRAInfo, ...]
    # The driver's free memory on the engine's CUDA device (other processes' use included); None on
    # CPU. Read where the engine runs, so a server whose engine is a child process opens no CUDA
    # context of its own to report it.
    gpu_memory_free_bytes: int | None = None
    # Step kernels (StepShape.kernels) run since the warm-up that it did not run (serving.engine.warmup);
    # None: no warm-up.
    cold_step_shapes: int | None = None
    # The first step to run each of those kernels: its token count and seconds (ModelRunner.cold_kernels).
    cold_steps: tuple[ColdStep, ...] = ()
    # Engine steps since the warm-up slower than llm_engine.SLOW_STEP_S.
    slow_steps: int = 0
    # The adaptive token budget (EngineConfig.decode_stall_target): steps whose token budget the
    # step-time model lowered, and steps the TTFT guard gave the full budget though the model had a fit.
    budget_limited_steps: int = 0
    wait_guard_steps: int = 0


def lora_infos(cache: LoRACache, names: Collection[str] | None = None) -> list[LoRAInfo]:
    """The loaded adapters by name, or only ``names`` (those of them loaded, in their order)."""
    if names is None:
        pairs = sorted(cache.named().items())
    else:
        pairs = [(name, a) for name in names if (a := cache.get(name)) is not None]
    return [
        LoRAInfo(
            name=name,
            path=a.path,
            digest=a.digest,
            rank=a.rank,
            lora_alpha=a.lora_alpha,
            target_modules=a.target_modules,
            gpu_slot=a.slot,
            gpu_row=a.row,
            in_cpu_cache=a.weights is not None,
            active_requests=a.refs,
            load_seconds=a.load_seconds,
            kind="dora" if a.dora else "lora",
        )
        for name, a in pairs
    ]


def engine_stats(*, scheduler: Scheduler, blocks: BlockManager, runner: ModelRunner, config: EngineConfig,
                 lora_cache: LoRACache | None, checksums: SlotChecksums | None, counts: TokenCounts,
                 adapters: tuple[LoRAInfo, ...]) -> EngineStats:
    """The snapshot of an engine's state and counters, from its parts (on the engine's thread)."""
    import torch  # here: whatever imports this module for its values need not load torch

    cache = lora_cache
    lora = cache.stats if cache is not None else None
    return EngineStats(
        num_waiting=scheduler.num_waiting,
        num_running=scheduler.num_running,
        # What the cache may hand out: with borrow_kv_memory, blocks lent to adapter rows are not KV's.
        kv_blocks_total=blocks.capacity,
        kv_blocks_used=blocks.num_used_blocks,
        kv_usage=blocks.usage,
        num_preemptions=scheduler.stats.num_preemptions,
        peak_waiting=scheduler.stats.peak_waiting,
        steps=scheduler.step_count,
        prompt_tokens=counts.prompt_tokens,
        prefill_tokens=counts.prefill_tokens,
        generation_tokens=counts.generation_tokens,
        prefix_cache_queries=blocks.prefix_queries,
        prefix_cache_hits=blocks.prefix_hits,
        kv_blocks_cached=blocks.num_cached_blocks,
        max_loras=runner.memory.lora_slots,
        max_cpu_loras=config.max_cpu_loras or 0,
        adapters_loading=cache.num_loading if cache is not None else 0,
        adapter_loads=lora.loads if lora else 0,
        adapter_load_failures=lora.load_failures if lora else 0,
        adapter_load_seconds_total=lora.load_seconds_total if lora else 0.0,
        adapter_last_load_seconds=lora.last_load_seconds if lora else 0.0,
        slot_loads=lora.slot_loads if lora else 0,
        slot_evictions=lora.slot_evictions if lora else 0,
        cpu_evictions=lora.cpu_evictions if lora else 0,
        slot_waits=scheduler.stats.slot_waits,
        budget_limited_steps=scheduler.stats.budget_limited_steps,
        wait_guard_steps=scheduler.stats.wait_guard_steps,
        slot_hits=lora.slot_hits if lora else 0,
        slot_misses=lora.slot_misses if lora else 0,
        lora_rows_total=runner.memory.lora_rows,
        lora_rows_used=lora.rows_used if lora else 0,
        lora_row_bytes=runner.lora_row_bytes,
        lora_bytes_loaded=lora.bytes_loaded if lora else 0,
        fill_waits=scheduler.stats.fill_waits,
        cpu_cache_bytes=runner.memory.cpu_cache_bytes,
        cpu_cache_bytes_used=lora.cpu_bytes if lora else 0,
        adapter_load_stalls=lora.load_stalls if lora else 0,
        slot_checks=checksums.checks if checksums is not None else 0,
        slot_corruptions=checksums.mismatches if checksums is not None else 0,
        slot_repairs=lora.slot_repairs if lora else 0,
        lora_prefetches=lora.prefetches if lora else 0,
        lora_prefetch_hits=lora.prefetch_hits if lora else 0,
        gpu_slots=tuple(_label(a) for a in cache.slots()) if cache is not None else (),
        cpu_cached=tuple(_label(a) or a.digest for a in cache.cpu_resident()) if cache is not None else (),
        adapters=adapters,
        gpu_memory_free_bytes=int(torch.cuda.mem_get_info(runner.device)[0]) if runner.device.type == "cuda" else None,
        cold_step_shapes=len(runner.cold_kernels) if runner.warm_kernels is not None else None,
        cold_steps=tuple(runner.cold_kernels.values()),
        slow_steps=runner.slow_steps,
    )


def _label(adapter: CachedAdapter | None) -> str | None:
    """An adapter's name for metrics (its first name, else its digest), None for an empty slot."""
    if adapter is None:
        return None
    return min(adapter.names) if adapter.names else adapter.digest[:12]
