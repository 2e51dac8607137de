"""Snapshots of the engine's state for metrics and the adapter endpoints (immutable values, safe to
read from another thread)."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class SlotRepair:
    """A GPU slot whose checksum failed: which adapter it held (its re-read from storage is under
    way) and how many requests were stopped because they had produced tokens from it."""

    slot: int
    digest: str
    names: tuple[str, ...]
    stopped: int


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
    generation_tokens: int
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
    gpu_slots: tuple[str | None, ...]
    cpu_cached: tuple[str, ...]
    adapters: tuple[LoRAInfo, ...]
