"""The prewarm plan: the ranking fills every worker's slots, then their CPU caches; what a worker
already holds stays there; new placements spread over the workers."""

from __future__ import annotations

from serving.gateway.prewarm_plan import Placement, plan_prefetch
from serving.gateway.routing import WorkerView


def worker(worker_id: str, *, slots: int, cpu: int, adapters: dict[str, str] | None = None) -> WorkerView:
    return WorkerView(worker_id=worker_id, url=f"http://{worker_id}", base_model="base", served_model_names=("base",),
                      max_loras=slots, max_model_len=None, queue_depth=0, kv_cache_usage=0.0,
                      adapters=adapters or {}, max_cpu_loras=cpu)


def test_slots_first_then_cpu_caches_then_nothing() -> None:
    plan = plan_prefetch([f"v{i}" for i in range(10)], [worker("w1", slots=2, cpu=4)])
    assert plan == {"w1": [Placement("v0", True), Placement("v1", True), Placement("v2", False),
                           Placement("v3", False)]}


def test_a_held_version_stays_on_its_worker_and_new_ones_spread() -> None:
    workers = [worker("w1", slots=2, cpu=4, adapters={"v2": "gpu"}), worker("w2", slots=2, cpu=4,
                                                                           adapters={"v3": "cpu"})]
    plan = plan_prefetch(["v0", "v1", "v2", "v3", "v4"], workers)
    placed = {p.name: (worker_id, p.to_gpu) for worker_id, items in plan.items() for p in items}
    assert placed["v2"] == ("w1", True) and placed["v3"] == ("w2", True)
    # Four slots in all: the fifth version goes to a CPU cache.
    assert sorted(to_gpu for _, to_gpu in placed.values()) == [False, True, True, True, True]
    assert {worker_id for worker_id, _ in placed.values()} == {"w1", "w2"}
    assert sum(1 for worker_id, to_gpu in placed.values() if worker_id == "w1" and to_gpu) == 2


def test_a_version_in_a_slot_keeps_it_and_the_others_go_around_it() -> None:
    # v1 holds w1's only slot: it stays, and the better-ranked v0 takes w2's instead of moving v1.
    workers = [worker("w1", slots=1, cpu=1, adapters={"v1": "gpu"}), worker("w2", slots=1, cpu=2)]
    plan = plan_prefetch(["v0", "v1", "v2"], workers)
    assert plan == {"w1": [Placement("v1", True)], "w2": [Placement("v0", True), Placement("v2", False)]}


def test_no_workers_no_plan() -> None:
    assert plan_prefetch(["v0"], []) == {}


def test_a_cpu_only_read_is_planned_only_for_readable_versions() -> None:
    # v0 takes the slot; v1 and v3 would need a storage read, v2 is in the CPU cache already.
    # Only v1 is worth a read: v3 is left to on-demand loading, v2 is still touched (no read).
    workers = [worker("w1", slots=1, cpu=4, adapters={"v2": "cpu", "v3": "loaded"})]
    plan = plan_prefetch(["v0", "v1", "v2", "v3"], workers, readable={"v0", "v1"})
    assert plan == {"w1": [Placement("v0", True), Placement("v1", False), Placement("v2", False)]}
    # A slot placement is not held to it.
    assert plan_prefetch(["v0"], workers, readable=set()) == {"w1": [Placement("v0", True)]}
