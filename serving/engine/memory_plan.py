"""How the engine's memory is shared between the paged KV cache and the adapter row pool.

The policy (docs/adapter-memory.md), in the order it is applied:

1. The KV cache never needs more than ``max_num_seqs`` sequences of ``max_model_len`` tokens; an
   explicit ``num_kv_blocks`` fixes it.
2. The adapter pool is what the operator asked for: ``lora_memory_bytes``, or, with only
   ``max_loras`` given, what ``max_loras`` adapters of ``max_lora_rank`` cost (fixed slots' memory).
3. Otherwise, on CUDA, adapters get what the KV cache leaves of the ``gpu_memory_utilization``
   budget once the KV cache has taken at most ``1 - lora_memory_fraction`` of it: all that the KV
   cache cannot use when sequences are short, and at least ``lora_memory_fraction`` when they are
   long. On CPU they get ``cpu_lora_memory_bytes``.
   Either default holds at least ``DEFAULT_MIN_ADAPTERS`` adapters of ``max_lora_rank`` (on CUDA the
   KV cache gives up what that takes): the default is sized from the model's shape (its rank row's
   bytes) and the max rank, so any model that fits starts without a flag (issue 39, item 1: the flat
   64 MiB held 54 rows of a 135M model, less than one rank-64 adapter). An explicit
   ``lora_memory_bytes`` or ``max_loras`` is taken as asked, and one below an adapter is refused.
4. The slot table holds ``max_loras`` entries when given (an upper bound on resident adapters),
   else one per ``min(8, max_lora_rank)`` rows: rank-8 adapters and larger fill the pool.
5. Where DoRA is served (``EngineConfig.serves_dora``), DoRA's scale tables (``slots + 1`` rows of
   every LoRA layer's output width: docs/adapter-kinds.md) come with the pool. A pool the operator
   sized (``lora_memory_bytes``, ``max_loras``) or the CPU's ``cpu_lora_memory_bytes`` keeps its
   rows and the tables come on top (on CUDA the KV cache gives them up); what the KV cache leaves
   on CUDA by default is shared, each slot's rows paying for its table row.

6. With ``borrow_kv_memory`` (off by default) the pool lives inside the KV cache's tensor, in a flex
   region at the end of every (K or V, layer) range (serving.engine.lora.flex, ``borrow_plan``):
   the region holds the pool the points above size plus up to half of their KV blocks (the KV
   cache keeps the other half and at least one ``max_model_len`` sequence), and the boundary
   between the two moves at run time (serving.engine.lora.borrow). It starts where the fixed split
   is; on CUDA the total memory is the fixed split's.

The CPU cache defaults to twice the GPU pool's bytes (``max_cpu_loras`` entries instead, when the
operator counts them), at most a quarter of the host's memory; ``cpu_lora_cache_bytes`` fixes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from serving.engine.config import EngineConfig
from serving.engine.lora.flex import FlexRegion

# Adapters of max_lora_rank a default pool holds at least: a few tenants' adapters of the largest rank
# stay resident together (a pool of one would reload on every switch between two of them).
DEFAULT_MIN_ADAPTERS = 4


@dataclass(frozen=True)
class MemoryPlan:
    num_kv_blocks: int
    lora_rows: int  # rows of the adapter pool (0: LoRA off)
    lora_slots: int  # entries of the slot table: adapters resident at once, at most
    cpu_cache_bytes: int
    # With borrow_kv_memory: the flex region (num_kv_blocks then counts its blocks, lora_rows its rows).
    flex: FlexRegion | None = None
    kv_blocks_at_start: int | None = None  # the KV cache's capacity to start with (the fixed split's)


def borrow_plan(plan: MemoryPlan, config: EngineConfig, *, block_elements: int, a_elements: int,
                b_elements: int, max_model_len: int, kv_block_bytes: int, lora_row_bytes: int = 0,
                dora_row_bytes: int = 0, on_cuda: bool = False) -> MemoryPlan:
    """``plan`` (the fixed split) with its adapter pool moved into a flex region of the KV cache
    (policy point 6); ``block_elements``: one block of one (K or V, layer) range; ``a_elements``,
    ``b_elements``: one rank row's A and Bt sides of one layer; ``kv_block_bytes``: one block of
    every layer; ``lora_row_bytes``: one rank row of every layer. The slot table grows with the
    region's rows (unless ``max_loras`` fixes it). On CUDA the memory stays the fixed split's: the
    pool's bytes become blocks (a row's two sides differ in width, so they hold a few rows fewer
    than the pool, at least ``max_lora_rank``), and the DoRA scale tables of the slots added are
    paid for by KV blocks the region does not lend. On CPU the blocks hold all the pool's rows."""
    kv_blocks = plan.num_kv_blocks
    pool_blocks = FlexRegion.blocks_for_rows(plan.lora_rows, block_elements, a_elements, b_elements)
    if on_cuda:
        least = FlexRegion.blocks_for_rows(config.max_lora_rank, block_elements, a_elements, b_elements)
        pool_blocks = min(pool_blocks, max(least, plan.lora_rows * lora_row_bytes // kv_block_bytes))
    lend = max(0, min(kv_blocks // 2, kv_blocks - -(-max_model_len // config.block_size)))

    def region_of(lent: int) -> FlexRegion:
        return FlexRegion(base=kv_blocks - lent, blocks=pool_blocks + lent, block_elements=block_elements,
                          a_elements=a_elements, b_elements=b_elements)

    def slots_of(region: FlexRegion) -> int:
        return config.max_loras if config.max_loras is not None else max(1, region.rows // _rows_per_slot(config))

    slots = slots_of(region_of(lend))
    if on_cuda and dora_row_bytes and slots > plan.lora_slots:
        tables_blocks = -(-(slots - plan.lora_slots) * dora_row_bytes // kv_block_bytes)
        kv_blocks -= min(lend, tables_blocks)
        lend -= min(lend, tables_blocks)
    region = region_of(lend)
    return replace(plan, num_kv_blocks=kv_blocks + pool_blocks, lora_rows=region.rows,
                   lora_slots=slots_of(region),
                   flex=region, kv_blocks_at_start=kv_blocks)


def plan_memory(
    config: EngineConfig, *, kv_block_bytes: int, lora_row_bytes: int, max_model_len: int, budget: int | None,
    dora_row_bytes: int = 0,
) -> MemoryPlan:
    """The plan for ``config``; ``budget``: the CUDA bytes left for the KV cache and adapters
    (``gpu_memory_utilization`` of the device less what is in use), None on CPU; ``dora_row_bytes``:
    one slot's row of DoRA's scale tables over all layers (0: no tables). Raises ValueError
    naming the setting when adapters or the KV cache would get less than their minimum."""
    enough = config.max_num_seqs * -(-max_model_len // config.block_size)
    asked = _asked_lora_bytes(config, lora_row_bytes, on_cpu=budget is None)
    least = DEFAULT_MIN_ADAPTERS * config.max_lora_rank * lora_row_bytes if config.lora_enabled else 0
    if config.num_kv_blocks is not None:
        kv_blocks = config.num_kv_blocks
    elif budget is None:
        kv_blocks = min(enough, config.cpu_kv_cache_bytes // kv_block_bytes - 1)
    elif asked is not None:
        tables = _tables_bytes(config, asked // lora_row_bytes, dora_row_bytes)
        kv_blocks = min(enough, (budget - asked - tables) // kv_block_bytes - 1)
    else:
        least += _tables_bytes(config, least // lora_row_bytes, dora_row_bytes)
        kv_share = min(int(budget * (1 - config.lora_memory_fraction)), budget - least)
        kv_blocks = min(enough, kv_share // kv_block_bytes - 1)
    if not config.lora_enabled:
        return MemoryPlan(kv_blocks, 0, 0, 0)
    if asked is None:
        assert budget is not None
        asked = budget - (kv_blocks + 1) * kv_block_bytes
        rows = _rows_with_tables(config, max(0, asked), lora_row_bytes, dora_row_bytes)
    else:
        if budget is None and _operator_sized(config) is None:
            asked = max(asked, least)
        rows = max(0, asked) // lora_row_bytes
    if rows < config.max_lora_rank:
        raise ValueError(
            f"adapter memory of {max(0, asked)} bytes holds {rows} rank rows of {lora_row_bytes} bytes, fewer than one "
            f"adapter of max_lora_rank={config.max_lora_rank} needs; raise lora_memory_bytes (or "
            "gpu_memory_utilization / lora_memory_fraction), or lower max_lora_rank"
        )
    slots = config.max_loras if config.max_loras is not None else max(1, rows // _rows_per_slot(config))
    cpu_bytes = config.cpu_lora_cache_bytes
    if cpu_bytes is None:
        # An operator who counts entries (max_cpu_loras) gets that count, within the host's quarter.
        cpu_bytes = _host_memory() // 4
        if config.max_cpu_loras is None:
            cpu_bytes = min(2 * rows * lora_row_bytes, cpu_bytes)
    return MemoryPlan(kv_blocks, rows, slots, cpu_bytes)


def _asked_lora_bytes(config: EngineConfig, row_bytes: int, *, on_cpu: bool) -> int | None:
    sized = _operator_sized(config)
    if sized == "bytes":
        return config.lora_memory_bytes
    if sized == "count":
        assert config.max_loras is not None
        return config.max_loras * config.max_lora_rank * row_bytes
    return config.cpu_lora_memory_bytes if on_cpu else None


def _rows_per_slot(config: EngineConfig) -> int:
    """Rank rows per slot table entry where ``max_loras`` does not fix the entries (policy point 4)."""
    return min(8, config.max_lora_rank)


def _tables_bytes(config: EngineConfig, rows: int, dora_row_bytes: int) -> int:
    """DoRA's scale tables of the slots a pool of ``rows`` rank rows has: one row per slot and one
    for tokens without an adapter (policy point 5)."""
    slots = config.max_loras if config.max_loras is not None else max(1, rows // _rows_per_slot(config))
    return (slots + 1) * dora_row_bytes


def _rows_with_tables(config: EngineConfig, nbytes: int, row_bytes: int, dora_row_bytes: int) -> int:
    """The most rank rows ``nbytes`` holds with their slots' DoRA scale tables (``_tables_bytes``)."""
    # Only where max_loras does not fix the slots (it sizes the pool). Each run of rows_per_slot rows
    # pays for one table row; the row for "no adapter" comes first.
    per = _rows_per_slot(config)
    return max(0, nbytes - dora_row_bytes) * per // (per * row_bytes + dora_row_bytes)


def _operator_sized(config: EngineConfig) -> str | None:
    """How the operator sized the pool: "bytes" (lora_memory_bytes), "count" (max_loras), None (the default)."""
    if config.lora_memory_bytes is not None:
        return "bytes"
    return "count" if config.max_loras is not None else None


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
