"""Fairness between tenants (serving.engine.fairness, the Virtual Token Counter): a tenant flooding
the queue gets its share of the batch, not the batch; priority tiers still come first; a tenant
returning from idle is lifted to the least-served active one; preemption takes the most-served
tenant's newest sequence. On the scheduler alone (no model), then on the tiny CPU engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from serving.engine import LLM, SamplingParams
from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.fairness import VirtualTokenCounter
from serving.engine.lora.request import LoRARequest
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus

W_P, W_Q = 1, 2  # the defaults: the paper's weights


def _scheduler(tmp_path: Path, *, blocks: int = 1024, block_size: int = 4, **kwargs: int) -> Scheduler:
    config = EngineConfig(model=str(tmp_path), max_loras=0, block_size=block_size, **kwargs)
    return Scheduler(config, BlockManager(blocks, block_size), None)


def _seq(name: str, tenant: str, prompt_len: int = 4, *, priority: int = 0, max_tokens: int = 1,
         adapter: str | None = None) -> Sequence:
    return Sequence(
        request_id=name,
        prompt=None,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        detokenizer=None,  # type: ignore[arg-type]  # the scheduler never decodes text
        lora_request=LoRARequest(adapter, f"/adapters/{adapter}") if adapter else None,
        priority=priority,
        cache_salt=f"tenant-{tenant}",
    )


def _tenant(seq: Sequence) -> str:
    assert seq.cache_salt is not None
    return seq.cache_salt.removeprefix("tenant-")


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, then do what the engine does: count computed tokens, append a sampled token, and
    finish a sequence at its max_tokens."""
    out = scheduler.schedule()
    for seq, num in out.scheduled:
        seq.num_computed_tokens += num
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= (seq.sampling_params.max_tokens or 0):
                scheduler.finish(seq)
    return out


def _admissions(scheduler: Scheduler, steps: int) -> list[str]:
    """Run ``steps`` steps; the request ids in the order their prefill started."""
    admitted: list[str] = []
    for _ in range(steps):
        admitted += [seq.request_id for seq, _ in _step(scheduler).scheduled if seq.request_id not in admitted]
    return admitted


def test_a_later_tenant_is_admitted_before_a_flooders_backlog_drains(tmp_path: Path) -> None:
    # Aging of 4 steps: the flood's requests are several levels older than the newcomer's by the
    # time it arrives; age must not rank them above another tenant's requests of the same tier.
    scheduler = _scheduler(tmp_path, max_num_seqs=2, priority_aging_steps=4)
    for i in range(100):
        scheduler.add(_seq(f"a{i}", "a"))
    first = _admissions(scheduler, 20)
    assert first == [f"a{i}" for i in range(len(first))] and len(first) >= 20, "alone, the flood runs in order"
    for i in range(5):
        scheduler.add(_seq(f"b{i}", "b"))
    order = _admissions(scheduler, 10)
    assert [r for r in order if r.startswith("b")] == [f"b{i}" for i in range(5)]
    last_b = order.index("b4")
    assert last_b < 11, f"b's five requests wait behind the flood: {order}"
    # Alternating: never two of b's in a row while a's backlog waits.
    assert all(not (x.startswith("b") and y.startswith("b")) for x, y in zip(order, order[1:]))
    assert scheduler.num_waiting >= 40, "a's backlog has not drained"


def test_service_over_a_window_is_within_a_bound_of_equal_share(tmp_path: Path) -> None:
    """Two backlogged tenants with requests of very different sizes: over any window the weighted
    tokens each is served differ by at most 2U (the paper's bound, U = one request's largest cost)."""
    scheduler = _scheduler(tmp_path, max_num_seqs=4, max_num_batched_tokens=32)
    big_prompt, big_out, small_prompt, small_out = 24, 12, 3, 2
    for i in range(200):
        scheduler.add(_seq(f"a{i}", "a", big_prompt, max_tokens=big_out))
        scheduler.add(_seq(f"b{i}", "b", small_prompt, max_tokens=small_out))
    served: dict[str, int] = Counter()
    window: list[dict[str, int]] = []
    for _ in range(150):
        out = scheduler.schedule()
        for seq, num in out.scheduled:
            samples = seq.num_computed_tokens + num == seq.num_tokens
            served[_tenant(seq)] += (num - 1) * W_P + W_Q if samples else num * W_P
        window.append(dict(served))
        for seq, num in out.scheduled:
            seq.num_computed_tokens += num
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= (seq.sampling_params.max_tokens or 0):
                    scheduler.finish(seq)
    assert scheduler.num_waiting > 0, "both tenants stay backlogged through the window"
    bound = 2 * (big_prompt * W_P + big_out * W_Q)
    for start in range(0, len(window), 10):
        for end in range(start + 10, len(window), 10):
            a = window[end]["a"] - window[start].get("a", 0)
            b = window[end]["b"] - window[start].get("b", 0)
            assert abs(a - b) <= bound, f"steps {start}-{end}: a served {a}, b {b}"
    assert window[-1]["b"] > 1000, "both are served throughout"


def test_priority_tiers_win_over_fairness(tmp_path: Path) -> None:
    """Within the vip tier two tenants share; the batch tier's fresh tenant, though the least
    served, waits for every vip request."""
    scheduler = _scheduler(tmp_path, max_num_seqs=1)
    for i in range(10):
        scheduler.add(_seq(f"a{i}", "a", priority=0))
    _admissions(scheduler, 4)
    for i in range(3):
        scheduler.add(_seq(f"b{i}", "b", priority=0))
    for i in range(3):
        scheduler.add(_seq(f"c{i}", "c", priority=2))
    order = _admissions(scheduler, 20)
    assert order[:6] == ["a4", "b0", "a5", "b1", "a6", "b2"], order
    assert order[6:] == ["a7", "a8", "a9", "c0", "c1", "c2"], order


def test_a_tenants_request_of_another_tier_does_not_hide_its_requests_of_this_one(tmp_path: Path) -> None:
    """b's degraded request (priority 10) waits behind the tier a floods; b's priority-1 request,
    queued after it for the same model, still competes in that tier as the least served."""
    scheduler = _scheduler(tmp_path, max_num_seqs=1, priority_aging_steps=4)
    for i in range(100):
        scheduler.add(_seq(f"a{i}", "a", priority=1))
    scheduler.add(_seq("b-degraded", "b", priority=10))
    _admissions(scheduler, 40)  # the degraded one ages past a fresh priority-1 request's rank
    scheduler.add(_seq("b-tier", "b", priority=1))
    order = _admissions(scheduler, 2)
    assert "b-tier" in order, order
    assert "b-degraded" not in order and scheduler.num_waiting > 50


def test_a_returning_tenant_is_lifted_to_the_least_served_active_one(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=1)
    fairness = scheduler.fairness
    for i in range(40):
        scheduler.add(_seq(f"a{i}", "a"))
    scheduler.add(_seq("b-early", "b"))
    _admissions(scheduler, 30)  # b's one request served early; then b idles while a is served
    assert not fairness.is_active("tenant-b")
    a_counter = fairness.counter("tenant-a")
    assert a_counter >= 25 * (3 * W_P + W_Q)
    for i in range(10):
        scheduler.add(_seq(f"b{i}", "b"))
    assert fairness.counter("tenant-b") == a_counter, "idling banked no credit"
    order = _admissions(scheduler, 10)
    assert 4 <= sum(r.startswith("b") for r in order) <= 6, f"b must share, not take a run of the batch: {order}"


def test_an_over_served_tenant_that_leaves_keeps_its_counter() -> None:
    vtc = VirtualTokenCounter(W_P, W_Q)
    vtc.join("a")
    vtc.join("b")
    vtc.charge("a", 100, samples=False)
    vtc.charge("b", 10, samples=True)
    assert vtc.counter("b") == 9 * W_P + W_Q
    vtc.leave("a")
    vtc.join("a")
    assert vtc.counter("a") == 100, "the lift is a max: leaving does not wipe what it was served"
    vtc.leave("a")
    vtc.leave("b")
    vtc.join("c")
    assert vtc.counter("c") == 9 * W_P + W_Q, "with no one active, the last to leave sets the floor"
    vtc.join("a")
    assert vtc.counter("a") == 100, "an over-served client is remembered while idle"


def test_preemption_takes_the_most_served_tenants_newest_sequence(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, blocks=4, block_size=4, max_model_len=16)
    first, second = _seq("first", "a", 7, max_tokens=8), _seq("second", "b", 7, max_tokens=8)
    scheduler.add(first)
    _step(scheduler)  # first prefilled alone: 2 blocks
    scheduler.add(second)  # b is lifted to a's counter as it arrives
    scheduler.fairness.charge("tenant-a", 100, samples=False)  # then a is served far more (elsewhere)
    _step(scheduler)  # first decodes token 8, second prefills: the cache is full
    out = _step(scheduler)  # first's token 9 needs a third block
    assert out.preempted == [first], "the most-served tenant gives way, though its request is older"
    assert dict(out.scheduled) == {second: 1} and first.status is SequenceStatus.WAITING


def test_a_tenants_adapters_and_base_requests_share_one_counter(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, max_num_seqs=1)
    for i in range(20):
        for adapter in ("a/x@1", "a/y@1", None):
            scheduler.add(_seq(f"a{i}-{adapter}", "a", adapter=adapter))
    for i in range(20):
        scheduler.add(_seq(f"b{i}", "b"))
    order = _admissions(scheduler, 30)
    assert 14 <= sum(r.startswith("b") for r in order) <= 16, f"b gets half, not a third or none: {order}"


@pytest.mark.parametrize("field", ["fairness_prompt_weight", "fairness_output_weight"])
def test_negative_weights_are_refused(tmp_path: Path, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(tmp_path), **{field: -1})  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_engine_admits_a_later_tenant_before_a_flood_drains(tiny_llama_dir: Path) -> None:
    """The tiny CPU engine behind the offline API: 30 requests of tenant a, then 5 of tenant b,
    two sequences at a time; b's all start before a's 15th."""
    llm = LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    started: list[str] = []

    def add(name: str, tenant: str) -> None:
        engine.add_request(name, {"prompt_token_ids": [5, 6, 7, 8], "cache_salt": f"tenant-{tenant}"}, params)

    def step(until: Callable[[], bool]) -> None:
        while not until():
            for output in engine.step():
                assert output.error is None
                if output.request_id not in started:
                    started.append(output.request_id)

    for i in range(30):
        add(f"a{i}", "a")
    step(lambda: len(started) >= 4)
    for i in range(5):
        add(f"b{i}", "b")
    step(lambda: not engine.has_unfinished_requests())
    assert sorted(started) == sorted([f"a{i}" for i in range(30)] + [f"b{i}" for i in range(5)])
    assert max(started.index(f"b{i}") for i in range(5)) < started.index("a14"), started


def test_a_returning_client_is_lifted_to_the_smallest_active_counter_not_the_largest() -> None:
    vtc = VirtualTokenCounter(W_P, W_Q)
    for client, tokens in (("light", 10), ("heavy", 500)):
        vtc.join(client)
        vtc.charge(client, tokens, samples=False)
    vtc.join("back")
    assert vtc.counter("back") == 10, "lifted to the least-served active client: level with it, not behind all"
    vtc.leave("light")
    vtc.join("later")
    assert vtc.counter("later") == 10, "the least served of those active now ('back', at 10)"
