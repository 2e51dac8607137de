"""The scheduler alone (no model): decodes first, chunked prefill, sequence and token budgets,
preemption by recompute, priority with aging, fairness between adapters, finishing."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.lora.request import LoRARequest
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus


def _scheduler(tmp_path: Path, *, blocks: int = 64, block_size: int = 4, **kwargs: int) -> Scheduler:
    config = EngineConfig(model=str(tmp_path), max_loras=0, block_size=block_size, **kwargs)
    return Scheduler(config, BlockManager(blocks, block_size), None)


def _seq(name: str, prompt_len: int, priority: int = 0, adapter: str | None = None) -> Sequence:
    return Sequence(
        request_id=name,
        prompt=None,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(),
        detokenizer=None,  # type: ignore[arg-type]  # the scheduler never decodes text
        lora_request=LoRARequest(adapter, f"/adapters/{adapter}") if adapter else None,
        priority=priority,
    )


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, then do what the engine does: count computed tokens, append a sampled token."""
    out = scheduler.schedule()
    for seq, num in out.scheduled:
        seq.num_computed_tokens += num
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_decodes_go_first_and_long_prompts_are_chunked(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_batched_tokens=8)
    short, long = _seq("short", 3), _seq("long", 20)
    scheduler.add(short)
    _step(scheduler)
    scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = _step(scheduler)
        assert out.scheduled[0] == (short, 1), "the decode must come first, every step"
        chunks.append(dict(out.scheduled)[long])
        assert sum(n for _, n in out.scheduled) <= 8
    assert sum(chunks) == 20 and max(chunks) == 7 and len(chunks) == 3


def test_max_num_seqs_bounds_the_batch(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=2)
    for i in range(5):
        scheduler.add(_seq(f"s{i}", 4))
    out = _step(scheduler)
    assert [s.request_id for s, _ in out.scheduled] == ["s0", "s1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 3


def test_full_kv_cache_preempts_the_lowest_priority_by_recompute(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, blocks=4, block_size=4, max_model_len=16)
    first, second = _seq("first", 7), _seq("second", 7)
    scheduler.add(first)
    scheduler.add(second)
    _step(scheduler)  # both prefilled: 2 blocks each, the cache is full
    _step(scheduler)  # token 8 of each still fits
    out = _step(scheduler)  # token 9 needs a third block: the later request gives way
    assert out.preempted == [second] and dict(out.scheduled) == {first: 1}
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert second.block_table == [] and second.num_tokens == 9, "its generated tokens are kept"
    assert scheduler.stats.num_preemptions == 1
    scheduler.finish(first)
    out = _step(scheduler)
    assert dict(out.scheduled) == {second: 9}, "resumed by prefilling prompt and output again"


def test_full_kv_cache_preempts_an_earlier_low_priority_request_not_a_later_urgent_one(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, blocks=4, block_size=4, max_model_len=16)
    batch, urgent = _seq("batch", 7, priority=2), _seq("urgent", 7, priority=0)
    scheduler.add(batch)
    _step(scheduler)  # batch prefilled alone: 2 blocks
    scheduler.add(urgent)
    _step(scheduler)  # batch decodes token 8, urgent prefills: the cache is full
    out = _step(scheduler)  # batch's token 9 needs a third block
    assert out.preempted == [batch], "the victim is the lowest priority, not the latest arrival"
    assert dict(out.scheduled) == {urgent: 1} and urgent.status is SequenceStatus.RUNNING
    assert batch.status is SequenceStatus.WAITING and batch.num_computed_tokens == 0


def test_lower_priority_value_is_served_first(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=1)
    scheduler.add(_seq("batch", 4, priority=2))
    scheduler.add(_seq("vip", 4, priority=0))
    out = _step(scheduler)
    assert [s.request_id for s, _ in out.scheduled] == ["vip"]


def test_aging_admits_a_low_priority_request_despite_a_stream_of_urgent_ones(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=1, priority_aging_steps=4)
    low = _seq("low", 2, priority=3)
    scheduler.add(low)
    for step in range(100):
        scheduler.add(_seq(f"urgent{step}", 2, priority=0))
        for seq in list(scheduler.running):
            scheduler.finish(seq)  # every request lasts one step
        _step(scheduler)
        if low.status is not SequenceStatus.WAITING:
            break
    assert low.status is SequenceStatus.RUNNING, "aging must eventually admit the low-priority request"
    assert 3 * 4 <= step <= 4 * 4 + 2, f"admitted after {step} steps; 3 levels of 4 steps expected"


def test_fair_share_between_adapters(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=4)
    for i in range(6):
        scheduler.add(_seq(f"x{i}", 4, adapter="x"))
    scheduler.add(_seq("y0", 4, adapter="y"))
    scheduler.add(_seq("base0", 4))
    out = _step(scheduler)
    assert sorted(s.request_id for s, _ in out.scheduled) == ["base0", "x0", "x1", "y0"]


def test_finishing_frees_blocks_whether_running_or_waiting(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, blocks=8, max_num_seqs=1)
    running, waiting = _seq("running", 9), _seq("waiting", 4)
    scheduler.add(running)
    scheduler.add(waiting)
    _step(scheduler)
    assert scheduler.blocks.num_used_blocks == 3
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert scheduler.blocks.num_used_blocks == 0 and not scheduler.has_unfinished()
    assert _step(scheduler).scheduled == []


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("block_size", 0)])
def test_bad_limits_are_refused(tmp_path: Path, field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(tmp_path), **{field: value})
