"""The prewarm loop on real parts: demand recorded in Redis, deployed versions in the registry, a
real serving worker with two GPU slots. One round puts the two most wanted versions in its slots
and the third in its CPU cache, as its registration then shows; another gateway process in the
same interval finds the lock taken; a prefetch never evicts a version it also lists for a slot;
the worker's prefetch endpoint is the operator's only."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from serving.registry import services
from serving.gateway import catalog
from serving.gateway.prewarm import DemandModel
from serving.gateway.prewarm_loop import PREFETCH_PATH, Prewarmer, PrewarmLoopConfig
from runtime.redis_guard import RedisGuard
from serving.gateway.routing import WorkerView
from serving.contracts.registry import worker_key
from tests.gateway.conftest import WORKER_KEY, upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def registration(redis_client, worker_id: str) -> dict:
    return json.loads(redis_client.get(worker_key(worker_id)))


def test_a_round_fills_the_slots_with_the_most_wanted_then_the_cpu_cache(
        registry, start_worker, tenant_a, adapter_dirs, redis_client):
    from django.conf import settings

    worker = start_worker("pw-worker", "--max-cpu-loras", "4")
    wait_for_worker(redis_client, "pw-worker")
    names = []
    for index, directory in enumerate(adapter_dirs):
        adapter = services.adapter_create(tenant=tenant_a.tenant, name=f"bot-{index}")
        version = upload_version(adapter, directory, "1.0.0")
        services.adapter_version_deploy(version=version, actor="test")
        names.append(f"{tenant_a.tenant.slug}/bot-{index}@1.0.0")
    # An archived version with demand is not prefetched: it is no longer served.
    retired = services.adapter_create(tenant=tenant_a.tenant, name="retired")
    upload_version(retired, adapter_dirs[0], "1.0.0")

    async def scenario() -> tuple:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        demand = DemandModel(client)
        now = time.time()
        for name, count in zip([*names, f"{tenant_a.tenant.slug}/retired@1.0.0"], (3, 5, 1, 9)):
            for _ in range(count):
                await demand.record(name, now)

        async def workers() -> list[WorkerView]:
            return [WorkerView.parse(registration(redis_client, "pw-worker"))]

        async with httpx.AsyncClient(timeout=60) as http:
            def prewarmer() -> Prewarmer:
                return Prewarmer(redis=client, demand=demand, guard=RedisGuard(timeout_s=5), workers=workers,
                                 served=catalog.served_versions, client=http, api_key=WORKER_KEY,
                                 # Every ranked version worth a CPU read here (a request or
                                 # few a minute are not): the threshold has its own tests.
                                 config=PrewarmLoopConfig(interval_s=60, min_expected=0.0))

            first = await prewarmer().round(now)
            second = await prewarmer().round(now)  # another process, the same interval
        await client.aclose()
        return first, second

    first, second = asyncio.run(scenario())
    # The slots are filled before the worker answers; the CPU cache's version is read after.
    assert first is not None and (first.planned, first.gpu, first.queued, first.failed) == (3, 2, 1, 0), first
    assert second is None

    def places() -> dict[str, str]:
        entry = registration(redis_client, "pw-worker")
        return {a["name"]: "gpu" if a["gpu"] else "cpu" if a["cpu"] else "-" for a in entry["adapters"]}

    deadline = time.monotonic() + 10
    while places() != {names[1]: "gpu", names[0]: "gpu", names[2]: "cpu"}:
        assert time.monotonic() < deadline, places()
        time.sleep(0.2)

    # A call never evicts one of its own slot versions for another: with both slots holding versions
    # it lists for a slot, a third listed for one stays in the CPU cache (plain LRU order would
    # have given it the least recently used of the two).
    catalogued = asyncio.run(catalog.served_versions(names))
    body = {"adapters": [{"lora_name": name, "artifact_uri": catalogued[name].artifact_uri,
                          "manifest_sha256": catalogued[name].manifest_sha256, "to_gpu": True}
                         for name in (names[2], names[1], names[0])]}
    response = httpx.post(f"{worker.url}{PREFETCH_PATH}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {WORKER_KEY}"})
    assert response.status_code == 200, response.text
    assert {e["lora_name"]: e["gpu"] for e in response.json()["data"]} == {names[2]: False, names[1]: True,
                                                                            names[0]: True}

    # The endpoint reads storage and fills slots: not for a caller without the operator key.
    body = {"adapters": [{"lora_name": names[2], "artifact_uri": "file:///elsewhere", "manifest_sha256": "0" * 64,
                          "to_gpu": True}]}
    assert httpx.post(f"{worker.url}{PREFETCH_PATH}", json=body, timeout=30).status_code == 401
