"""Adapters that borrow idle KV memory (docs/adapter-memory.md; ``EngineConfig.borrow_kv_memory``):
the moving boundary's primitives (the block manager's capacity, the row pool's floor, the flex
region's arithmetic), then the engine on CPU with the tiny model: the pools are views into the KV
tensor, an idle engine lends blocks to rows and a burst of prompts takes them back without touching
a running sequence's blocks or rows, slot checksums hold across the give-back, and the greedy
tokens are those of the same engine with the option off.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from transformers import AutoTokenizer

from kernels import use_backend
from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.lora.flex import FlexRegion
from serving.engine.lora.gpu_slots import RowPool, SlotTable
from serving.engine.lora.records import AdapterHandle, CachedAdapter
from serving.engine.memory_plan import MemoryPlan, borrow_plan
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = "The quick brown fox jumps over the lazy dog and then it runs away into the forest".split()
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytestmark = pytest.mark.usefixtures("one_thread")


class _InLine(Executor):
    """Runs each adapter read at submit: the engine's steps then see every load finish at the same
    step on any machine, so when the boundary moves does not hang on thread timing."""

    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  # the engine reads the failure from the future
            future.set_exception(exc)
        return future


def _reads_in_line(llm: LLM) -> None:
    loader = llm.llm_engine.lora_cache._loader  # noqa: SLF001  # the test's one reach inside: its threads
    loader._executor = loader._background = _InLine()  # noqa: SLF001


# ---- the primitives ---------------------------------------------------------------------------


def _seq(seq_id: int, tokens: int) -> Sequence:
    return Sequence(request_id=str(seq_id), prompt=None, prompt_token_ids=list(range(1, tokens + 1)),
                    sampling_params=SamplingParams(), detokenizer=None)  # type: ignore[arg-type]  # never decoded


def test_capacity_hands_out_only_blocks_below_it_and_never_shrinks_under_a_held_block() -> None:
    blocks = BlockManager(16, 4)
    blocks.set_capacity(8)
    assert (blocks.capacity, blocks.num_free_blocks, blocks.num_used_blocks) == (8, 8, 0)
    held = _seq(0, 12)
    blocks.allocate(held, 12)
    assert held.block_table == [0, 1, 2]  # lowest first once a capacity is set: the top stays free to lend
    assert blocks.usage == 3 / 8
    with pytest.raises(ValueError, match="block 2 is in use"):
        blocks.set_capacity(2)
    assert blocks.capacity == 8 and blocks.num_free_blocks == 5  # refused: nothing changed
    blocks.set_capacity(3)
    assert blocks.num_free_blocks == 0 and not blocks.can_allocate(_seq(1, 4), 4)
    blocks.set_capacity(16)
    other = _seq(1, 16)
    blocks.allocate(other, 16)
    assert other.block_table == [3, 4, 5, 6]
    blocks.free(held)
    assert blocks.highest_held_from(0) == 6 and blocks.highest_held_from(7) == 6
    blocks.set_capacity(7)
    assert blocks.num_free_blocks == 3 and blocks.num_used_blocks == 4


def test_shrinking_drops_cached_blocks_above_the_capacity_with_their_keys() -> None:
    blocks = BlockManager(8, 4, enable_prefix_caching=True)
    blocks.set_capacity(8)
    first = _seq(0, 30)  # 8 blocks, the first 7 full
    assert blocks.find_prefix(first) == []  # (and makes its keys)
    blocks.allocate(first, 30)
    blocks.register_full(first, 30)
    blocks.step_done(written=True)
    blocks.free(first)
    assert blocks.num_cached_blocks == 7 and blocks.num_free_blocks == 8
    blocks.set_capacity(4)
    assert blocks.num_cached_blocks == 4 and blocks.num_free_blocks == 4
    again = _seq(1, 30)
    assert len(blocks.find_prefix(again)) == 4  # the prompt's head is still cached, its tail was dropped


def test_the_row_floor_never_rises_over_an_allocated_run() -> None:
    pool = RowPool(32)
    pool.set_floor(16)
    assert (pool.size, pool.free_rows, pool.lowest_allocated) == (16, 16, 32)
    first = pool.alloc(8)
    assert first == 16
    second = pool.alloc(4)
    assert second == 24 and pool.lowest_allocated == 16
    with pytest.raises(ValueError, match="row 16 is allocated"):
        pool.set_floor(17)
    pool.set_floor(4)  # the rows taken in join the free run below the first adapter
    assert pool.free_rows == 16 and pool.alloc(12) == 4
    pool.free(4, 12)
    pool.free(16, 8)
    assert pool.lowest_allocated == 24
    pool.set_floor(24)
    assert (pool.floor, pool.free_rows, pool.alloc(5)) == (24, 4, None)
    pool.set_floor(20)
    assert pool.alloc(4) == 20 and pool.free_rows == 4


def test_the_region_never_puts_a_row_over_a_kv_block() -> None:
    # Rows wider on the B side than the A side, neither a multiple of a block.
    region = FlexRegion(base=10, blocks=40, block_elements=96, a_elements=88, b_elements=100)
    assert region.rows == 40 * 96 // 100
    widths = (region.a_elements, region.b_elements)
    # Each side's rows end at the region's end.
    assert [region.start(side) + region.rows * widths[side] for side in (0, 1)] == [region.elements] * 2

    def row_start(side: int, row: int) -> int:
        return region.start(side) + row * widths[side]

    for kv in range(region.blocks + 1):
        floor = region.floor_for(kv)
        if floor < region.rows:  # the rows from the floor up start past the KV blocks' last element
            assert min(row_start(0, floor), row_start(1, floor)) >= kv * region.block_elements
            assert floor == 0 or min(row_start(0, floor - 1), row_start(1, floor - 1)) < kv * region.block_elements
        assert region.kv_blocks_below(floor) >= kv
    for floor in range(region.rows + 1):
        kv = region.kv_blocks_below(floor)
        assert kv * region.block_elements <= min(row_start(0, floor), row_start(1, floor))
        assert region.floor_for(kv) <= floor
    assert region.floor_for(0) == 0 and region.kv_blocks_below(region.rows) == region.blocks


def test_the_plan_moves_the_pool_into_the_kv_tensor_at_the_same_memory(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path), device="cpu", block_size=16, max_lora_rank=16)
    fixed = MemoryPlan(num_kv_blocks=1000, lora_rows=200, lora_slots=25, cpu_cache_bytes=1 << 20)
    block_bytes = 4 * 2048 * 2

    row_bytes = 4 * (2000 + 2300) * 2  # four layers of bf16

    def moved(max_model_len: int, dora_row_bytes: int = 0, on_cuda: bool = False) -> MemoryPlan:
        return borrow_plan(fixed, config, block_elements=1024, a_elements=2000, b_elements=2300,
                           max_model_len=max_model_len, kv_block_bytes=block_bytes, lora_row_bytes=row_bytes,
                           dora_row_bytes=dora_row_bytes, on_cuda=on_cuda)

    plan = moved(4096)
    region = plan.flex
    assert region is not None
    pool_blocks = -(-200 * 2300 // 1024)  # the pool's rows, in blocks of the wider side
    assert plan.num_kv_blocks == 1000 + pool_blocks and plan.kv_blocks_at_start == 1000
    assert region.base == 500 and region.blocks == 500 + pool_blocks  # half the KV blocks may be lent
    assert region.rows - region.floor_for(500) >= 200  # at the start the pool has its rows
    assert plan.lora_rows == region.rows and plan.lora_slots == region.rows // 8
    # A long context keeps one whole sequence's blocks out of the region.
    long_context = moved(16 * 900).flex
    assert long_context is not None and long_context.base == 900
    # On CUDA the pool's bytes become blocks (the rows' sides differ in width: a few rows fewer), and
    # the DoRA tables of the slots added are paid for with KV blocks the region does not lend.
    on_cuda = moved(4096, on_cuda=True)
    assert on_cuda.flex is not None and on_cuda.num_kv_blocks == 1000 + 200 * row_bytes // block_bytes
    assert 180 <= on_cuda.flex.rows - on_cuda.flex.floor_for(500) < 200
    with_dora = moved(4096, dora_row_bytes=4096, on_cuda=True)
    assert with_dora.flex is not None and with_dora.flex.base == region.base
    paid = -(-(on_cuda.lora_slots - fixed.lora_slots) * 4096 // block_bytes)
    assert with_dora.kv_blocks_at_start == 1000 - paid and with_dora.flex.blocks == on_cuda.flex.blocks - paid


def _adapter(digest: str, rank: int) -> CachedAdapter:
    return CachedAdapter(digest=digest, path=digest, rank=rank, lora_alpha=rank, scaling=1.0, target_modules=ALL,
                         weights={}, load_seconds=0.0, nbytes=0, checksum=0)


def test_a_give_back_evicts_idle_adapters_below_the_lowest_one_in_use() -> None:
    table = SlotTable(4, 32, lambda slot, row, adapter: None)
    idle, wanted, pinned, above = (_adapter(name, 8) for name in ("idle", "wanted", "pinned", "above"))
    for adapter in (idle, wanted, pinned, above):
        assert table.place(adapter) is not None
    assert (idle.row, wanted.row, pinned.row, above.row) == (0, 8, 16, 24)
    wanted.handles.add(AdapterHandle("wanted", adapter=wanted))  # a waiting request's
    pinned.handles.add(AdapterHandle("pinned", adapter=pinned))
    assert table.pin(pinned) == pinned.slot
    # The idle one below the first adapter in use goes; those in use, and the idle one above them, stay.
    assert table.evict_below(32) == 8
    assert idle.slot is None and (wanted.row, pinned.row, above.row) == (8, 16, 24)
    assert table.evictions == 1 and table.placement_evictions == 0
    wanted.handles.clear()
    table.unpin(pinned)
    pinned.handles.clear()
    assert table.evict_below(20) == 24  # the run from the floor up to row 24 is free now


# ---- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {f"b{i}": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=ALL, seed=90 + i, init_scale=0.5)
            for i in range(6)}  # fmt: skip


def _engine(model: Path, *, borrow: bool, max_num_seqs: int = 8, async_scheduling: bool = False,
            device: str = "cpu") -> LLM:
    """A pool of two rank-8 adapters (16 rows of 8,192 bytes: the tiny Llama's rank row in float32)
    beside 128 KV blocks of 4 tokens; with ``borrow`` the boundary may move. On CUDA the flat steps
    replay CUDA graphs, which captured the pools' views."""
    llm = LLM(str(model), max_lora_rank=8, lora_memory_bytes=16 * 8192, device=device, dtype="float32",
              enforce_eager=device == "cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
              block_size=4, num_kv_blocks=128, borrow_kv_memory=borrow, async_scheduling=async_scheduling)
    assert llm.llm_engine.runner.lora_row_bytes == 8192
    _reads_in_line(llm)
    borrower = llm.llm_engine.scheduler.borrow
    if borrower is not None:
        borrower.patience = 2  # a few quiet steps, not 64: the tiny workload is over in a few dozen
    return llm


def _requests(adapters: dict[str, Path], count: int) -> tuple[list[str], list[LoRARequest]]:
    names = list(adapters)
    prompts = [" ".join(WORDS[: 3 + (i * 5) % 11]) for i in range(count)]
    return prompts, [LoRARequest(names[i % len(names)], str(adapters[names[i % len(names)]])) for i in range(count)]


def test_the_option_off_leaves_the_pools_apart_and_the_capacity_whole(tiny_llama_dir: Path) -> None:
    llm = _engine(tiny_llama_dir, borrow=False)
    try:
        engine = llm.llm_engine
        assert engine.scheduler.borrow is None and engine.runner.flex is None
        assert engine.block_manager.capacity == engine.block_manager.num_blocks == 128
        storage = engine.runner.kv_cache.untyped_storage().data_ptr()
        assert all(pool.untyped_storage().data_ptr() != storage for pool in engine.runner.lora_pools())
    finally:
        llm.llm_engine.shutdown()


def test_the_pools_are_views_into_the_kv_tensor(tiny_llama_dir: Path) -> None:
    llm = _engine(tiny_llama_dir, borrow=True)
    try:
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        region = runner.flex
        assert region is not None
        kv = runner.kv_cache
        # The fixed split's 128 KV blocks to start with, the pool's 16 rows' blocks more in the tensor.
        assert engine.block_manager.capacity == 128 and engine.block_manager.num_blocks == 128 + 64
        assert engine.lora_cache is not None and engine.lora_cache.row_pool.size >= 16
        for layer in runner.model.lora_layers():
            for pool, side in [*((a, 0) for a in layer.lora_A), *((b, 1) for b in layer.lora_B)]:
                assert pool.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
                first = kv[side, layer.layer_idx, region.base].data_ptr()
                last = kv[side, layer.layer_idx, region.base + region.blocks - 1, -1, -1, -1].data_ptr()
                assert first <= pool.data_ptr() and pool[-1, -1].data_ptr() <= last
        # A write through a pool lands in the KV tensor's region (and nowhere in the KV blocks below it).
        layer = next(runner.model.lora_layers())
        before = kv[:, :, : region.base].clone()
        layer.lora_B[0][region.rows - 1].fill_(3.0)
        assert (kv[1, layer.layer_idx, region.base:] == 3.0).sum() == layer.slice_widths[0]
        assert torch.equal(kv[:, :, : region.base], before)
        layer.lora_B[0][region.rows - 1].zero_()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("device", "async_scheduling"), [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cpu", True, id="cpu-async"),
    pytest.param("cuda", True, marks=_CUDA, id="cuda-graphs-async"),
])  # fmt: skip
def test_greedy_tokens_equal_the_fixed_split_with_more_adapters_than_it_holds(
    tiny_llama_dir: Path, adapters: dict[str, Path], device: str, async_scheduling: bool
) -> None:
    prompts, loras = _requests(adapters, 12)
    outputs = {}
    for borrow in (False, True):
        llm = _engine(tiny_llama_dir, borrow=borrow, async_scheduling=async_scheduling, device=device)
        try:
            outputs[borrow] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras)]
            stats = llm.llm_engine.stats()
            assert stats.slot_evictions > 0 or borrow, "six adapters over a pool of two must swap"
            if borrow:
                borrower = llm.llm_engine.scheduler.borrow
                assert borrower is not None and borrower.blocks_lent > 0, "waiting adapters borrow idle KV blocks"
                # The KV figures count the blocks the cache may hand out, not those lent to rows.
                blocks = llm.llm_engine.scheduler.blocks
                assert stats.kv_blocks_total == blocks.capacity < blocks.num_blocks
                cache = llm.llm_engine.lora_cache
                assert cache is not None and cache.row_pool.size > 16
                assert llm.llm_engine.verify_slots() == []
            if device == "cuda":
                graphs = llm.llm_engine.runner.graphs
                assert graphs is not None and graphs.replays > 0, "the graphs captured the pools' views"
        finally:
            llm.llm_engine.shutdown()
    assert len({tuple(tokens) for tokens in outputs[True]}) > 6, "the adapters must change the tokens"
    if device == "cpu":
        assert outputs[True] == outputs[False]
    # Both are PEFT's tokens (on CUDA, where the batches differ between the two, up to a near-tie).
    reference = PeftReference(tiny_llama_dir, adapters)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for prompt, lora, *ours in zip(prompts, loras, outputs[False], outputs[True]):
        want = reference.generate(tokenizer(prompt).input_ids, lora.lora_name, MAX_TOKENS)
        for tokens in ours:
            assert_greedy_match(tokens, want, f"{lora.lora_name} {prompt!r}")


@pytest.mark.slow  # Triton's interpreter
def test_the_triton_kernels_read_the_views_as_they_read_a_pool_of_its_own(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """The kernels the GPU runs (here in Triton's interpreter), LoRA and paged attention, over pools
    that are strided views into the KV tensor: the tokens of the torch reference over the same views.
    Only the borrowing engine runs interpreted (the costly part): that the reference over the views
    gives the tokens of the engine with the option off is the test above that compares them."""
    import kernels.triton_lora

    if not kernels.triton_lora.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    prompts, loras = _requests(dict(list(adapters.items())[:3]), 3)
    # Two tokens: a prompt's step and a decode's, each kernel over the views at least once; each
    # further token is one more interpreted step of every kernel and tests nothing more.
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            llm = LLM(str(tiny_llama_dir), max_lora_rank=8, lora_memory_bytes=32 * 8192, device="cpu", dtype="float32",
                      attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      block_size=4, num_kv_blocks=64, borrow_kv_memory=True)
            try:
                assert llm.llm_engine.scheduler.borrow is not None
                outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
            finally:
                llm.llm_engine.shutdown()
    assert outputs["triton"] == outputs["torch"]


def _step_until(llm: LLM, done: Callable[[], bool], limit: int = 400) -> None:
    engine = llm.llm_engine
    for _ in range(limit):
        if done():
            return
        engine.step()
        if not engine.scheduler.running:
            engine.wait_for_loads(0.05)
    raise AssertionError("the engine did not get there")


def test_a_burst_of_prompts_takes_the_blocks_back_without_touching_a_running_sequence(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = _engine(tiny_llama_dir, borrow=True, max_num_seqs=16)
    try:
        engine = llm.llm_engine
        borrower, cache, blocks = engine.scheduler.borrow, engine.lora_cache, engine.block_manager
        assert borrower is not None and cache is not None and engine.slot_checksums is not None
        # An idle engine: six adapters in demand over a pool of two lend it the region's blocks.
        prompts, loras = _requests(adapters, 12)
        llm.generate(prompts, GREEDY, lora_request=loras)
        assert borrower.blocks_lent > 0 and blocks.capacity < 128
        lent_capacity = blocks.capacity

        # A long request runs on an adapter; then a burst of long base prompts needs more KV than is left.
        name = "b0"
        engine.add_request("long", " ".join(WORDS[:8]), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           LoRARequest(name, str(adapters[name])))
        _step_until(llm, lambda: any(s.status is SequenceStatus.RUNNING for s in engine.scheduler.running))
        running = engine.scheduler.running[0]
        adapter = cache.get(name)
        assert adapter is not None and adapter.slot is not None
        slot, row = adapter.slot, adapter.row
        table = list(running.block_table)
        burst = " ".join(WORDS + WORDS[:4])  # ~48 tokens: a dozen of them at once need ~180 blocks
        for i in range(15):
            engine.add_request(f"burst{i}", burst, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        returned = borrower.blocks_returned
        while engine.has_unfinished_requests():
            engine.step()
            if running.status is SequenceStatus.RUNNING:
                # Its blocks only ever grow at the end, and its adapter keeps its slot and rows.
                assert running.block_table[: len(table)] == table
                table = list(running.block_table)
                assert (adapter.slot, adapter.row) == (slot, row)
                assert row is not None and cache.row_pool.floor <= row
            if not engine.scheduler.running:
                engine.wait_for_loads(0.05)
        assert borrower.blocks_returned > returned and blocks.capacity > lent_capacity
        assert engine.scheduler.stats.num_preemptions == 0
        # Every resident adapter's rows still hold what was copied in.
        placed = [(a.slot, a.row, a.rank) for a in cache.landed() if a.slot is not None and a.row is not None]
        assert placed and engine.slot_checksums.mismatched(placed) == []
        assert engine.verify_slots() == []
    finally:
        llm.llm_engine.shutdown()


def test_the_worker_flag_sets_the_option_and_tensor_parallelism_refuses_it(tiny_llama_dir: Path) -> None:
    assert engine_config(parse_args(["--model", str(tiny_llama_dir), "--borrow-kv-memory"])).borrow_kv_memory
    assert not engine_config(parse_args(["--model", str(tiny_llama_dir)])).borrow_kv_memory
    with pytest.raises(ValueError, match="borrow_kv_memory is not supported with tensor_parallel_size > 1"):
        EngineConfig(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, borrow_kv_memory=True)
    with pytest.raises(ValueError, match="borrow_kv_memory needs LoRA on"):
        EngineConfig(model=str(tiny_llama_dir), device="cpu", max_loras=0, borrow_kv_memory=True)


def test_the_borrower_grows_after_quiet_steps_within_the_watermark_and_gives_back_unowned_rows_first(
    tiny_llama_dir: Path,
) -> None:
    llm = _engine(tiny_llama_dir, borrow=True)
    try:
        engine = llm.llm_engine
        borrower, blocks, cache = engine.scheduler.borrow, engine.block_manager, engine.lora_cache
        assert borrower is not None and cache is not None and engine.runner.flex is not None
        region = engine.runner.flex
        borrower.patience = 3
        held = _seq(0, 40 * 4)  # 40 blocks in use: under half of 128
        blocks.allocate(held, 40 * 4)
        table = list(held.block_table)
        # Rows wanted (a rank-8 adapter found no room): nothing moves before three quiet steps.
        for _ in range(2):
            borrower.step(rows_wanted=8, kv_blocks_wanted=0)
            assert blocks.capacity == 128
        borrower.step(rows_wanted=8, kv_blocks_wanted=0)
        # 24 rows wanted (96 blocks of this layout), but the KV cache keeps twice what is in use (the
        # 50 % watermark) and its own half of the planned blocks.
        assert blocks.capacity == 80 and borrower.blocks_lent == 48
        assert blocks.capacity == region.base + region.kv_blocks_below(cache.row_pool.floor)
        assert cache.row_pool.size > 16 and held.block_table == table
        # The step wants more than is free: the unowned rows just above the floor go back, and no
        # resident adapter moves.
        resident = [(a.slot, a.row) for a in cache.slots() if a is not None]
        borrower.step(rows_wanted=0, kv_blocks_wanted=blocks.num_free_blocks + 10)
        assert blocks.capacity == 90 and borrower.blocks_returned == 10
        assert cache.row_pool.floor >= region.floor_for(26)
        assert [(a.slot, a.row) for a in cache.slots() if a is not None] == resident and held.block_table == table
    finally:
        llm.llm_engine.shutdown()


def test_adapters_of_mixed_ranks_under_kv_pressure_keep_the_fixed_splits_tokens(
    tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """Ranks 4 to 16 over a pool of 16 rows, and prompts long enough that the KV cache takes blocks
    back while adapters are resident: rows freed and taken at the floor in runs of every size."""
    specs = [(4, ("q_proj", "v_proj")), (16, ALL), (12, ("v_proj", "up_proj")), (8, ("k_proj", "o_proj")),
             (16, ("gate_proj", "down_proj")), (4, ALL), (12, ALL)]  # fmt: skip
    mixed = {f"m{i}": make_adapter(tiny_llama_dir, r=r, lora_alpha=2 * r, target_modules=mods, seed=120 + i,
                                   init_scale=0.5)
             for i, (r, mods) in enumerate(specs)}  # fmt: skip
    names = list(mixed)
    prompts = [" ".join((WORDS * 2)[i % 5 : i % 5 + 6 + (i * 7) % 17]) for i in range(24)]
    loras = [LoRARequest(names[(i * 3) % len(names)], str(mixed[names[(i * 3) % len(names)]])) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for borrow in (False, True):
        llm = LLM(str(tiny_llama_dir), max_lora_rank=16, lora_memory_bytes=16 * 8192, device="cpu", dtype="float32",
                  enforce_eager=True, max_num_seqs=12, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                  num_kv_blocks=96, borrow_kv_memory=borrow)
        try:
            _reads_in_line(llm)
            borrower = llm.llm_engine.scheduler.borrow
            if borrower is not None:
                borrower.patience = 2
            outputs[borrow] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
            if borrower is not None:
                assert borrower.blocks_lent > 0 and borrower.blocks_returned > 0
                assert llm.llm_engine.verify_slots() == []
        finally:
            llm.llm_engine.shutdown()
    assert outputs[True] == outputs[False]
