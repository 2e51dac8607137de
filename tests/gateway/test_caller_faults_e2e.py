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

from serving.registry import services
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
    random, so 40 requests all on one worker would be a 1-in-10^12 chance). Sent four at a time
    until both have served one: an ejected worker gets none of the 40, a routed one a few."""
    before = [served(worker) for worker in workers]
    after = before
    for _ in range(10):
        for _ in range(4):
            reply = complete(web, key)
            assert reply.status_code == 200, reply.text
        after = [served(worker) for worker in workers]
        if all(a > b for a, b in zip(after, before)):
            return
    raise AssertionError(f"40 requests did not reach both workers: per worker before {before}, after {after}")


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


def test_malformed_and_oversized_requests_are_400s_the_workers_never_see(faults_web, ready, tenant_a, tenant_b):
    """Issue 37: a NaN temperature (the gateway's json.dumps of the worker's request raised: a 500
    counted against the worker, twelve ejected it), a 100,000-deep body (RecursionError: 500), 95,000
    stop strings and 19,000 tools (each held a worker's loop for seconds) are refused by the gateway
    with a 400 naming the field, before any bucket or worker; a grammar that matches nothing is the
    worker's 400, the caller's fault. No worker is ejected, and another tenant reaches both."""
    headers = {"Authorization": f"Bearer {tenant_a.key}", "Content-Type": "application/json"}
    url = f"{faults_web.url}/v1/completions"
    before, seen_before = ejections(faults_web), [served(worker) for worker in ready]
    for _ in range(12):
        reply = httpx.post(url, headers=headers, timeout=60,
                           content=f'{{"model": "{BASE}", "prompt": "hi", "max_tokens": 1, "temperature": NaN}}')
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "temperature" and reply.json()["error"]["code"] == "non_finite_number"
    deep = httpx.post(url, headers=headers, content="[" * 100_000 + "]" * 100_000, timeout=60)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "nesting_too_deep", deep.text[:300]
    for extra, param in (({"stop": [f"s{i}" for i in range(95_000)]}, "stop"),
                         ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(19_000)],
                           "tool_choice": {"type": "function", "function": {"name": "none-of-them"}}}, "tools")):
        reply = complete(faults_web, tenant_a.key, **extra)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text[:300]
    assert [served(worker) for worker in ready] == seen_before  # none of it was forwarded
    endless = complete(faults_web, tenant_a.key, guided_grammar="root ::= root root")
    assert endless.status_code == 400 and endless.json()["error"]["param"] == "guided_grammar", endless.text
    assert ejections(faults_web) == before
    both_workers_serve(faults_web, tenant_b.key, ready)
