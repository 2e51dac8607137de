"""The GPU tier's placement rules (serving/engine/lora/gpu_slots.py): rows sized by rank, the
eviction order, and copies in flight.

The table is driven directly here, with a ``write`` that records where each adapter went and hands
back a copy the test says has landed or not (the engine's is the model runner's CUDA event); the
engine-level behaviour (PEFT-exact tokens across evictions) is in tests/engine/test_llm_multi_lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from serving.engine.lora.gpu_slots import RowPool, SlotTable
from serving.engine.lora.records import AdapterHandle, CachedAdapter


@dataclass
class Copy:
    landed: bool = False

    def query(self) -> bool:
        return self.landed


class Writes:
    """The table's ``write``: records each placement; copies land at once unless ``in_flight``."""

    def __init__(self) -> None:
        self.placed: list[tuple[str, int, int]] = []
        self.in_flight = False
        self.copies: list[Copy] = []

    def __call__(self, slot: int, row: int, adapter: CachedAdapter) -> Copy | None:
        self.placed.append((adapter.digest, slot, row))
        if not self.in_flight:
            return None
        copy = Copy()
        self.copies.append(copy)
        return copy


def adapter(name: str, rank: int) -> CachedAdapter:
    return CachedAdapter(digest=name, path=f"/adapters/{name}", rank=rank, lora_alpha=rank, scaling=1.0,
                         target_modules=("q_proj",), weights={}, load_seconds=0.0, nbytes=rank * 100)


def waiting_request(a: CachedAdapter) -> None:
    a.handles.add(AdapterHandle(a.digest, adapter=a))


def test_rows_are_best_fit_and_freed_runs_merge() -> None:
    pool = RowPool(64)
    starts = [pool.alloc(n) for n in (16, 8, 16, 8)]
    assert starts == [0, 16, 24, 40] and pool.free_rows == 16
    pool.free(16, 8)
    pool.free(40, 8)
    assert pool.alloc(8) == 16, "of two exact fits, the first"
    pool.free(16, 8)
    assert pool.alloc(24) == 40, "the run after 40 (48..64, merged with the freed 40..48) is the only fit"
    assert pool.alloc(9) is None and pool.alloc(8) == 16
    pool.free(0, 16)
    pool.free(16, 8)
    pool.free(24, 16)
    assert pool.alloc(40) == 0, "neighbours merged back into one run"


def test_memory_that_holds_four_rank_64_adapters_holds_thirty_two_rank_8_ones() -> None:
    big = SlotTable(num_slots=64, num_rows=4 * 64, write=Writes())
    bigs = [adapter(f"r64-{i}", 64) for i in range(5)]
    assert [big.pin(a) for a in bigs[:4]] == [0, 1, 2, 3]
    assert big.pin(bigs[4]) is None, "a fifth rank-64 adapter finds no room while the four run"
    small = SlotTable(num_slots=64, num_rows=4 * 64, write=Writes())
    smalls = [adapter(f"r8-{i}", 8) for i in range(33)]
    assert all(small.pin(a) is not None for a in smalls[:32])
    assert small.rows_used == 256 and small.pin(smalls[32]) is None


def test_idle_adapters_go_first_then_waiting_ones_and_running_ones_never() -> None:
    writes = Writes()
    table = SlotTable(num_slots=8, num_rows=48, write=writes)
    running, waited_for, idle_old, idle_new = (adapter(n, 16) for n in ("running", "waited-for", "idle-old", "idle-new"))
    for a in (running, waited_for, idle_old):
        assert table.pin(a) is not None
    for a in (waited_for, idle_old):
        table.unpin(a)
    waiting_request(waited_for)
    assert table.pin(idle_new) is not None, "room made by evicting the idle adapter"
    assert idle_old.slot is None and waited_for.slot is not None and table.evictions == 1
    table.unpin(idle_new)
    newcomer = adapter("newcomer", 16)
    assert table.pin(newcomer) is not None
    assert idle_new.slot is None and waited_for.slot is not None, "the idle one goes before the waited-for one"
    assert table.pin(adapter("one-more", 16)) is not None
    assert waited_for.slot is None, "an adapter only waiting requests use goes when nothing idle is left"
    assert running.slot is not None and running.running == 1
    assert table.pin(adapter("no-room", 16)) is None, "running adapters are never evicted"


def test_nothing_is_evicted_for_a_placement_that_cannot_succeed() -> None:
    table = SlotTable(num_slots=4, num_rows=32, write=Writes())
    runner, idle = adapter("runner", 16), adapter("idle", 16)
    table.pin(runner)
    table.pin(idle)
    table.unpin(idle)
    assert table.pin(adapter("too-big", 32)) is None
    assert idle.slot is not None and table.evictions == 0


def test_a_prefetch_placement_evicts_only_idle_adapters_outside_keep() -> None:
    table = SlotTable(num_slots=4, num_rows=32, write=Writes())
    kept, waited_for = adapter("kept", 16), adapter("waited-for", 16)
    table.place(kept)
    table.place(waited_for)
    waiting_request(waited_for)
    assert table.place(adapter("predicted", 16), keep=[kept]) is None
    assert kept.slot is not None and waited_for.slot is not None


def test_an_adapter_whose_copy_is_in_flight_is_not_admitted_and_not_evicted() -> None:
    writes = Writes()
    writes.in_flight = True
    table = SlotTable(num_slots=4, num_rows=32, write=writes)
    first, second = adapter("first", 16), adapter("second", 16)
    assert table.pin(first) == "filling" and table.pin(first) == "filling"
    assert first.running == 0 and table.misses == 1
    assert table.pin(second) == "filling"
    assert table.pin(adapter("third", 16)) is None, "copies in flight hold their rows"
    writes.copies[0].landed = True
    assert table.pin(first) == first.slot and first.running == 1
    assert (table.hits, table.misses) == (0, 2), "the admission that waited for the copy is the miss, not a hit"
    assert table.pin(first) == first.slot and table.hits == 1
    assert [a.digest for a in table.landed()] == ["first"]


@pytest.mark.parametrize("ranks", [(8, 16, 4, 16, 8, 12), (16, 16, 16)])
def test_rows_of_resident_adapters_never_overlap(ranks: tuple[int, ...]) -> None:
    writes = Writes()
    table = SlotTable(num_slots=16, num_rows=40, write=writes)
    for i in range(40):
        a = adapter(f"a{i}", ranks[i % len(ranks)])
        if table.pin(a) is not None:
            table.unpin(a)
        resident = [x for x in table.slots() if x is not None]
        spans = sorted((x.row, x.row + x.rank) for x in resident if x.row is not None)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
        assert len({x.slot for x in resident}) == len(resident)
        assert table.rows_used == sum(x.rank for x in resident)
