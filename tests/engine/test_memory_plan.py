"""How the engine shares memory between the KV cache and the adapter row pool
(serving/engine/memory_plan.py; the policy is stated there and in docs/adapter-memory.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.engine.config import EngineConfig
from serving.engine.memory_plan import DEFAULT_MIN_ADAPTERS, plan_memory

GIB = 1 << 30
ROW = 5 << 20  # the Llama-3-8B shape's rank row: 5.24 MB in bf16
BLOCK = 2 << 20  # a 16-token KV block of that shape


def config(tmp_path: Path, **kwargs: object) -> EngineConfig:
    return EngineConfig(model=str(tmp_path), device="cpu", **kwargs)  # type: ignore[arg-type]


def plan(cfg: EngineConfig, budget: int | None, max_model_len: int = 8192):
    return plan_memory(cfg, kv_block_bytes=BLOCK, lora_row_bytes=ROW, max_model_len=max_model_len, budget=budget)


def test_by_default_adapters_get_what_long_sequences_leave_at_least_a_fifth(tmp_path: Path) -> None:
    p = plan(config(tmp_path), budget=100 * GIB)  # 256 sequences of 8,192 tokens would need 256 GiB
    assert p.num_kv_blocks == int(100 * GIB * 0.8) // BLOCK - 1
    assert p.lora_rows == (100 * GIB - (p.num_kv_blocks + 1) * BLOCK) // ROW
    assert p.lora_rows * ROW >= 20 * GIB - ROW
    assert p.lora_slots == p.lora_rows // 8, "one slot per 8 rows: rank-8 adapters and up fill the pool"


def test_short_sequences_leave_adapters_everything_else(tmp_path: Path) -> None:
    p = plan(config(tmp_path, max_num_seqs=16), budget=100 * GIB, max_model_len=1024)
    assert p.num_kv_blocks == 16 * 1024 // 16, "the KV cache takes no more than its sequences need"
    assert p.lora_rows == (100 * GIB - (p.num_kv_blocks + 1) * BLOCK) // ROW


def test_an_explicit_byte_budget_is_the_pool_and_max_loras_only_bounds_the_count(tmp_path: Path) -> None:
    p = plan(config(tmp_path, lora_memory_bytes=10 * GIB, max_loras=100), budget=100 * GIB)
    assert (p.lora_rows, p.lora_slots) == (10 * GIB // ROW, 100)
    assert p.num_kv_blocks == (90 * GIB) // BLOCK - 1


def test_max_loras_alone_sizes_the_pool_as_fixed_slots_did(tmp_path: Path) -> None:
    p = plan(config(tmp_path, max_loras=32, max_lora_rank=16), budget=100 * GIB)
    assert (p.lora_rows, p.lora_slots) == (32 * 16, 32)
    p = plan(config(tmp_path, max_loras=4, max_lora_rank=16), budget=None)
    assert (p.lora_rows, p.lora_slots) == (64, 4)


def test_on_cpu_adapters_get_their_own_bytes(tmp_path: Path) -> None:
    p = plan(config(tmp_path, cpu_lora_memory_bytes=ROW * 160), budget=None)
    assert (p.lora_rows, p.lora_slots) == (160, 20)
    assert p.cpu_cache_bytes == 2 * 160 * ROW


def test_lora_off_takes_no_memory(tmp_path: Path) -> None:
    p = plan(config(tmp_path, max_loras=0), budget=100 * GIB)
    assert (p.lora_rows, p.lora_slots) == (0, 0)
    assert p.num_kv_blocks == 100 * GIB // BLOCK - 1


def test_a_budget_below_one_adapter_of_max_rank_is_refused_naming_the_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds 15 rank rows .* max_lora_rank=16 .* lora_memory_bytes"):
        plan(config(tmp_path, lora_memory_bytes=15 * ROW), budget=100 * GIB)


def test_the_cpu_cache_counts_entries_when_the_operator_does(tmp_path: Path) -> None:
    counted = plan(config(tmp_path, max_cpu_loras=500), budget=100 * GIB)
    default = plan(config(tmp_path), budget=100 * GIB)
    assert default.cpu_cache_bytes <= 2 * default.lora_rows * ROW
    assert counted.cpu_cache_bytes >= default.cpu_cache_bytes
    fixed = plan(config(tmp_path, cpu_lora_cache_bytes=GIB), budget=100 * GIB)
    assert fixed.cpu_cache_bytes == GIB


SMOLLM_ROW = 30 * 10176 * 4  # SmolLM2-135M's rank row in fp32 (30 layers of 10,176 elements): 1.22 MB


def test_the_cpu_default_holds_a_few_adapters_of_the_max_rank_whatever_the_model(tmp_path: Path) -> None:
    # Issue 39, item 1: the flat 64 MiB held 54 rows of SmolLM2-135M, less than one rank-64 adapter.
    cfg = config(tmp_path, max_lora_rank=64)
    p = plan_memory(cfg, kv_block_bytes=BLOCK, lora_row_bytes=SMOLLM_ROW, max_model_len=2048, budget=None)
    assert p.lora_rows == DEFAULT_MIN_ADAPTERS * 64
    small = plan_memory(config(tmp_path, max_lora_rank=8), kv_block_bytes=BLOCK, lora_row_bytes=1024,
                        max_model_len=2048, budget=None)
    assert small.lora_rows == (64 << 20) // 1024, "a small model keeps the 64 MiB floor"


def test_the_cuda_default_gives_up_kv_cache_for_a_few_adapters_of_the_max_rank(tmp_path: Path) -> None:
    p = plan(config(tmp_path, max_lora_rank=64), budget=3 * GIB)  # a fifth (0.6 GiB) holds 122 rows of 5 MB
    assert p.lora_rows >= DEFAULT_MIN_ADAPTERS * 64
    assert (p.num_kv_blocks + 1) * BLOCK + p.lora_rows * ROW <= 3 * GIB


def test_an_explicit_pool_is_taken_as_asked_even_below_the_default_minimum(tmp_path: Path) -> None:
    p = plan(config(tmp_path, max_lora_rank=64, lora_memory_bytes=100 * ROW), budget=None)
    assert p.lora_rows == 100
    p = plan(config(tmp_path, max_lora_rank=64, max_loras=1), budget=100 * GIB)
    assert p.lora_rows == 64



DORA_ROW = 43008 * 32 * 2  # one slot's DoRA scale row over the 8B shape's 32 layers in bf16: 2.75 MB


def dora_plan(cfg: EngineConfig, budget: int | None):
    return plan_memory(cfg, kv_block_bytes=BLOCK, lora_row_bytes=ROW, max_model_len=8192, budget=budget,
                       dora_row_bytes=DORA_ROW)  # fmt: skip


def test_by_default_dora_scale_tables_share_what_the_kv_cache_leaves_with_the_rows(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    plain, dora = plan(cfg, budget=100 * GIB), dora_plan(cfg, budget=100 * GIB)
    assert dora.num_kv_blocks == plain.num_kv_blocks
    pool = plain.lora_rows * ROW
    assert dora.lora_slots == dora.lora_rows // 8
    with_tables = dora.lora_rows * ROW + (dora.lora_slots + 1) * DORA_ROW
    assert pool - 9 * ROW < with_tables <= pool + ROW, "the rows and their tables fill what the rows alone had"
    assert dora.lora_rows < plain.lora_rows


@pytest.mark.parametrize("sizing", [{"max_loras": 32}, {"lora_memory_bytes": 32 * 16 * ROW, "max_loras": 32}],
                         ids=["count", "bytes"])
def test_an_operator_sized_pool_keeps_its_rows_and_the_kv_cache_gives_up_the_tables(
        tmp_path: Path, sizing: dict[str, int]) -> None:
    """The 8B shape with 32 rank-16 slots: the adapters keep their 512 rows; the tables take 91 MB more."""
    cfg = config(tmp_path, **sizing)
    plain, dora = plan(cfg, budget=100 * GIB), dora_plan(cfg, budget=100 * GIB)
    assert (dora.lora_rows, dora.lora_slots) == (plain.lora_rows, plain.lora_slots) == (32 * 16, 32)
    assert 33 * DORA_ROW == 90_832_896
    assert (plain.num_kv_blocks - dora.num_kv_blocks) * BLOCK >= 33 * DORA_ROW


def test_on_cpu_the_pool_asked_for_keeps_its_rows_with_dora(tmp_path: Path) -> None:
    cfg = config(tmp_path, cpu_lora_memory_bytes=64 * ROW)
    assert dora_plan(cfg, budget=None).lora_rows == plan(cfg, budget=None).lora_rows == 64
