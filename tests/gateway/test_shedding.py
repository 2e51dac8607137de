"""Load shedding by priority: below vip is refused when every worker is over its queue bound."""

from __future__ import annotations

from serving.gateway.shedding import Saturation, ShedConfig, shed_decision

CONFIG = ShedConfig(queue_fraction=0.5, default_queue_bound=8, retry_after_s=2)


def worker(worker_id: str, queue: int, max_queued: int | None = 10) -> Saturation:
    return Saturation.parse({"worker_id": worker_id, "queue_depth": queue, "max_queued_requests": max_queued,
                             "kv_cache_usage": 0.5, "gpu_memory_free_bytes": 1 << 30})


def test_every_worker_over_its_bound_sheds_standard_and_batch_but_not_vip() -> None:
    workers = [worker("w1", 5), worker("w2", 7)]
    for priority in (1, 2):
        shed = shed_decision(workers, priority=priority, inflight={}, config=CONFIG)
        assert shed is not None and shed.retry_after_s == 2
        assert "w1 5/5" in shed.message and "w2 7/5" in shed.message
    assert shed_decision(workers, priority=0, inflight={}, config=CONFIG) is None


def test_one_worker_with_room_admits_everyone() -> None:
    assert shed_decision([worker("w1", 9), worker("w2", 4)], priority=2, inflight={}, config=CONFIG) is None


def test_this_process_in_flight_counts_and_unreported_bounds_use_the_default() -> None:
    assert shed_decision([worker("w1", 3)], priority=1, inflight={"w1": 2}, config=CONFIG) is not None
    assert shed_decision([worker("w1", 7, max_queued=None)], priority=1, inflight={}, config=CONFIG) is None
    assert shed_decision([worker("w1", 8, max_queued=None)], priority=1, inflight={}, config=CONFIG) is not None


def test_no_workers_is_not_overload() -> None:
    # No candidate at all is the router's 503 no_serving_worker, not shedding.
    assert shed_decision([], priority=2, inflight={}, config=CONFIG) is None
