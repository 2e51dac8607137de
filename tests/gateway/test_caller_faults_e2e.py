"""One tenant's bad requests never take a worker out of routing for everyone: with two real
workers behind a real web process, six requests carrying the workers' internal `loraplex_adapter`
field (refused by the gateway, never forwarded) and six for a tenant's adapter that no worker can
load (`adapter_load_failed`, the adapter's fault: its breaker's business, not the workers') eject
neither worker, and another tenant's traffic still reaches both.

The web process and its workers serve the base model under a name of their own, so no other
suite's workers are candidates.
"""

from __future__ import annotations

import time

import httpx
import pytest

from serving import services
from serving.engine.tiny import save_random_peft_adapter
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "tiny-caller-faults"
WORKERS = ("cf-worker-a", "cf-worker-b")
BAD_REQUESTS = 6


@pytest.fixture(scope="module")
def faults_web(start_web):
    return start_web(BASE_MODEL_NAME=BASE)


@pytest.fixture(scope="module")
def two_workers(start_worker):
    workers = [start_worker(worker_id, "--served-model-name", BASE, wait=False) for worker_id in WORKERS]
    for worker in workers:  # both start at once
        worker.wait_ready()
    return workers


@pytest.fixture
def ready(registry, two_workers, redis_client):
    for worker_id in WORKERS:
        wait_for_worker(redis_client, worker_id)
    return two_workers


def ejections(web) -> float:
    for line in httpx.get(f"{web.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("loraplex_gateway_worker_ejections_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def served(worker) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("loraplex_requests_total{"))


def complete(web, key: str, model: str = BASE, **extra) -> httpx.Response:
    return httpx.post(f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": model, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0, **extra})


def both_workers_serve(web, key: str, workers) -> None:
    """Another tenant's requests reach both workers (ties between equal workers are drawn at
    random, so 40 requests all on one worker would be a 1-in-10^12 chance)."""
    before = [served(worker) for worker in workers]
    for _ in range(40):
        reply = complete(web, key)
        assert reply.status_code == 200, reply.text
    after = [served(worker) for worker in workers]
    assert all(a > b for a, b in zip(after, before)), f"requests per worker before {before}, after {after}"


def test_internal_fields_from_a_tenant_are_refused_and_eject_no_worker(faults_web, ready, tenant_a, tenant_b,
                                                                       tmp_path):
    before = ejections(faults_web)
    # What the worker would read from storage, were the field passed through.
    for _ in range(BAD_REQUESTS):
        reply = complete(faults_web, tenant_a.key, loraplex_adapter={"artifact_uri": f"file://{tmp_path}/nothing",
                                                                     "manifest_sha256": "0" * 64})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "internal_field" and error["param"] == "loraplex_adapter"
    assert ejections(faults_web) == before
    both_workers_serve(faults_web, tenant_b.key, ready)


def test_an_adapter_no_worker_can_load_ejects_no_worker(faults_web, ready, tenant_a, tenant_b, tiny_model, tmp_path):
    # Rank 32 passes the registry (MAX_LORA_RANK 64) but not these workers (--max-lora-rank 16).
    wide = save_random_peft_adapter(tiny_model, tmp_path / "wide", r=32, lora_alpha=16,
                                    target_modules=("q_proj", "v_proj"), seed=5, init_scale=0.5)
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="wide")
    services.adapter_version_deploy(version=upload_version(adapter, wide, "1.0.0"), actor="test")
    time.sleep(0.6)  # past GATEWAY_CACHE_SECONDS, in case the name was looked up before it existed
    before = ejections(faults_web)
    for _ in range(BAD_REQUESTS):
        reply = complete(faults_web, tenant_a.key, model="wide", allow_degradation=False)
        assert reply.status_code == 500, reply.text
        assert reply.json()["error"]["code"] == "adapter_load_failed"
    assert ejections(faults_web) == before
    both_workers_serve(faults_web, tenant_b.key, ready)
