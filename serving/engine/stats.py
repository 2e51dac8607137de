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
    in_cpu_cache: bool
    active_requests: int
    load_seconds: float


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
    gpu_slots: tuple[str | None, ...]
    cpu_cached: tuple[str, ...]
    adapters: tuple[LoRAInfo, ...]
