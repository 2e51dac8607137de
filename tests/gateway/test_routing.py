"""Worker choice: live workers from the registry's documents, adapter affinity against queue and
KV load, and the gateway's own in-flight count; read from a real Redis."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from serving.contracts.registry import WORKERS_KEY, api_key_id, worker_key
from serving.gateway.routing import (RoundRobin, RoutingConfig, Weights, WorkerView, live_workers, pick_worker,
                                     read_registry, route, score_workers)

ADAPTER = "alice-co/support-bot@1.0.0"
NOW = 1_000_000.0


def document(worker_id: str, *, adapters=(), queue=0, kv=0.0, state="ready", heartbeat=NOW, max_loras=2,
             base="tiny-llama") -> dict:
    return {"worker_id": worker_id, "url": f"http://{worker_id}:8100", "state": state, "base_model": base,
            "served_model_names": [base], "max_loras": max_loras, "max_model_len": 2048, "queue_depth": queue,
            "kv_cache_usage": kv, "adapters": list(adapters), "heartbeat_at": heartbeat, "ttl": 3}


def resident(name: str = ADAPTER, *, gpu=True, cpu=True) -> dict:
    return {"name": name, "digest": "d", "gpu": gpu, "cpu": cpu}


def views(*documents: dict) -> list[WorkerView]:
    return live_workers(documents, base_models=["tiny-llama"], key_id=api_key_id("gateway-key"), now=NOW)


def test_the_worker_with_the_adapter_resident_gets_requests_until_its_queue_grows():
    full = [resident(f"other/x@{index}") for index in range(2)]
    warm = document("warm", adapters=[resident(), resident("other/y@1")])
    cold = document("cold", adapters=full)
    candidates = views(warm, cold)
    rng = random.Random(0)
    assert {pick_worker(candidates, adapter=ADAPTER, inflight={}, rng=rng).worker_id for _ in range(50)} == {"warm"}
    # The gateway's own in-flight requests count at once, before any heartbeat reports them.
    assert pick_worker(candidates, adapter=ADAPTER, inflight={"warm": 3}).worker_id == "cold"
    busy = views(document("warm", adapters=[resident(), resident("other/y@1")], queue=8), cold)
    assert pick_worker(busy, adapter=ADAPTER, inflight={}).worker_id == "cold"


def test_affinity_grades_gpu_free_slot_cpu_and_nothing():
    gpu = WorkerView.parse(document("a", adapters=[resident()], max_loras=1))
    free = WorkerView.parse(document("b", adapters=[], max_loras=1))
    cpu = WorkerView.parse(document("c", adapters=[resident(gpu=False), resident("o/z@1")], max_loras=1))
    none = WorkerView.parse(document("d", adapters=[resident("o/z@1")], max_loras=1))
    assert [worker.affinity(ADAPTER) for worker in (gpu, free, cpu, none)] == [1.0, 0.8, 0.6, 0.0]
    assert none.affinity(None) == 1.0  # the base model is everywhere


def test_queue_and_kv_are_normalised_across_candidates():
    candidates = views(document("a", queue=10, kv=0.5), document("b", queue=5, kv=0.25))
    scores = dict((worker.worker_id, score) for score, worker in
                  score_workers(candidates, adapter=None, inflight={}, weights=Weights()))
    assert scores == pytest.approx({"a": 1 - 2 - 2, "b": 1 - 1 - 1})


def test_ties_are_broken_at_random():
    candidates = views(document("a"), document("b"), document("c"))
    rng = random.Random(7)
    counts = Counter(pick_worker(candidates, adapter=None, inflight={}, rng=rng).worker_id for _ in range(600))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 150


def test_a_worker_keyed_differently_from_the_gateway_is_never_chosen():
    # Its every answer would be a 401 that the client would take for its own key being refused.
    ours = {**document("ours"), "api_key_id": api_key_id("gateway-key")}
    theirs = {**document("theirs"), "api_key_id": api_key_id("another-deployment-key")}
    open_worker = {**document("open"), "api_key_id": None}
    assert [worker.worker_id for worker in views(ours, theirs, open_worker, document("older"))] == [
        "ours", "open", "older"]
    assert api_key_id("") is None and api_key_id("k") != api_key_id("k2") and len(api_key_id("k")) == 16


def test_stale_heartbeats_other_bases_and_unready_workers_are_never_chosen():
    candidates = views(
        document("stale", adapters=[resident()], heartbeat=NOW - 10),
        document("draining", adapters=[resident()], state="draining"),
        document("other-base", adapters=[resident()], base="llama-8b"),
        {"worker_id": "broken"},
        document("fresh"),
    )
    assert [worker.worker_id for worker in candidates] == ["fresh"]
    assert pick_worker(views(document("stale", heartbeat=NOW - 10)), adapter=None, inflight={}) is None


def test_a_tensor_parallel_worker_is_one_worker_with_its_size_and_older_entries_read_as_one():
    sharded, older = {**document("tp2"), "tensor_parallel_size": 2}, document("old")
    assert [(view.worker_id, view.tensor_parallel_size) for view in views(sharded, older)] == [("tp2", 2), ("old", 1)]
    assert views({**sharded, "state": "failed"}) == [], "a worker whose rank died is not routed to"


def test_round_robin_cycles_through_live_workers_and_skips_dead_ones():
    config = RoutingConfig(policy="round_robin")
    rotation = RoundRobin()
    # Adapter residency and queues play no part: "c" holds the adapter and "a" is the busiest.
    fleet = [document("c", adapters=[resident()]), document("a", queue=9), document("b"),
             document("dead", heartbeat=NOW - 10)]

    def picks(count: int, documents: list[dict]) -> list[str]:
        return [route(views(*documents), adapter=ADAPTER, inflight={"a": 5}, config=config,
                      rotation=rotation)[0].worker_id for _ in range(count)]

    assert picks(6, fleet) == ["a", "b", "c", "a", "b", "c"]
    # "b" stops heartbeating mid-cycle: the turn passes to the next live worker.
    fleet[2] = document("b", heartbeat=NOW - 10)
    assert picks(4, fleet) == ["a", "c", "a", "c"]
    # A worker that joins takes its turn in id order; the fallbacks are the next ones in turn.
    fleet.append(document("bb"))
    assert picks(3, fleet) == ["a", "bb", "c"]
    assert [worker.worker_id for worker in route(views(*fleet), adapter=None, inflight={}, config=config,
                                                 rotation=rotation)] == ["a", "bb", "c"]
    assert route([], adapter=None, inflight={}, config=config, rotation=rotation) == []


def test_affinity_routing_picks_the_best_scored_with_the_rest_as_fallbacks():
    config = RoutingConfig()
    candidates = views(document("cold", queue=1), document("warm", adapters=[resident()]), document("busy", queue=4))
    order = route(candidates, adapter=ADAPTER, inflight={}, config=config, rotation=RoundRobin())
    assert [worker.worker_id for worker in order] == ["warm", "cold", "busy"]


def test_the_routing_policy_is_read_from_gateway_routing():
    assert RoutingConfig.from_environ({}) == RoutingConfig(policy="affinity", weights=Weights())
    assert RoutingConfig.from_environ({"GATEWAY_ROUTING": "ROUND_ROBIN", "GATEWAY_WEIGHT_QUEUE": "3"}) == \
        RoutingConfig(policy="round_robin", weights=Weights(queue=3.0))
    with pytest.raises(ValueError, match="GATEWAY_ROUTING must be one of affinity, round_robin, got 'random'"):
        RoutingConfig.from_environ({"GATEWAY_ROUTING": "random"})


def test_read_registry_returns_live_documents_from_redis(redis_client):
    from django.conf import settings

    async def scenario() -> list[dict]:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        # An hour ahead: a serving worker of an earlier test on this xdist worker (same Redis database)
        # may still write its heartbeat, scored at the real time, after the fixture emptied the
        # database; read at this `now`, it is older than any member counts, so only these are read.
        now = time.time() + 3600
        for name in ("w1", "w2"):
            await client.set(worker_key(name), json.dumps(document(name, heartbeat=now)), ex=5)
            await client.zadd(WORKERS_KEY, {name: now})
        await client.zadd(WORKERS_KEY, {"expired": now})  # its document is gone
        await client.set(worker_key("stale"), json.dumps(document("stale", heartbeat=now - 3600)), ex=5)
        await client.zadd(WORKERS_KEY, {"stale": now - 3600})  # its document is there, its member too old
        documents = await read_registry(client, now=now)
        await client.aclose()
        return documents

    documents = asyncio.run(scenario())
    assert sorted(item["worker_id"] for item in documents) == ["w1", "w2"]
