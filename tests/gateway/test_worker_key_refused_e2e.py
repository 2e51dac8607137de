"""A serving worker that refuses the gateway's operator key (keyed differently, and registered
without the key fingerprint the gateway would skip it by: a worker from before fingerprints, or
one whose key changed at runtime) is a misconfigured worker, not a wrong client key: alone it is
502 upstream_misconfigured naming it, never the worker's 401 relayed; beside a good worker its
requests fail over before the first byte and its refusals count toward its ejection.

The web process and its workers serve the base model under a name of their own, so no other
suite's workers are candidates.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from serving.contracts.registry import WORKERS_KEY, worker_key
from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "tiny-keys"


@pytest.fixture(scope="module")
def keys_web(start_web):
    return start_web(BASE_MODEL_NAME=BASE)


@pytest.fixture(scope="module")
def wrong_key_worker(start_worker):
    # Not in Redis by itself (no --redis-url): the test writes the registration it would have
    # written without a key fingerprint.
    return start_worker("rs-wrong-key", "--served-model-name", BASE, "--api-key", "not-the-gateways-key",
                        "--redis-url", "")


def register_without_fingerprint(redis_client, worker, worker_id: str) -> None:
    now = time.time()
    document = {"worker_id": worker_id, "url": worker.url, "state": "ready", "base_model": BASE,
                "served_model_names": [BASE], "max_loras": 2, "max_model_len": 2048, "queue_depth": 0,
                "kv_cache_usage": 0.0, "adapters": [], "started_at": now, "heartbeat_at": now, "ttl": 300}
    redis_client.set(worker_key(worker_id), json.dumps(document), ex=300)
    redis_client.zadd(WORKERS_KEY, {worker_id: now})


def complete(web, key: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "stream": stream}
    return httpx.post(f"{web.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def metric(web, name: str) -> float:
    for line in httpx.get(f"{web.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_worker_refusing_the_operator_key_alone_is_502_misconfigured(registry, keys_web, wrong_key_worker,
                                                                       tenant_a, redis_client):
    register_without_fingerprint(redis_client, wrong_key_worker, "rs-wrong-key")
    for stream in (False, True):
        reply = complete(keys_web, tenant_a.key, stream=stream)
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error["code"] == "upstream_misconfigured"
        assert "rs-wrong-key" in error["message"] and "operator key" in error["message"]
        assert "your API key is fine" in error["message"]
    # The client's own key still works: the gateway's /v1/models answers it.
    models = httpx.get(f"{keys_web.url}/v1/models", headers={"Authorization": f"Bearer {tenant_a.key}"}, timeout=30)
    assert models.status_code == 200


def test_requests_fail_over_from_a_worker_refusing_the_key_and_it_is_ejected(
        registry, keys_web, wrong_key_worker, start_worker, tenant_a, redis_client):
    start_worker("rs-right-key", "--served-model-name", BASE)
    wait_for_worker(redis_client, "rs-right-key")
    register_without_fingerprint(redis_client, wrong_key_worker, "rs-wrong-key")
    retries, ejections = (metric(keys_web, "loraplex_gateway_failover_retries_total"),
                          metric(keys_web, "loraplex_gateway_worker_ejections_total"))
    # Ties between the two are broken at random: in 40 requests the wrong-key worker is tried
    # first far more than the 5 consecutive times that eject it. Sent two at a time (one streamed)
    # until it is ejected, up to 40.
    for n in range(40):
        reply = complete(keys_web, tenant_a.key, stream=n % 2 == 1)
        assert reply.status_code == 200, reply.text
        if n % 2 == 1 and metric(keys_web, "loraplex_gateway_worker_ejections_total") >= ejections + 1:
            break
    assert metric(keys_web, "loraplex_gateway_failover_retries_total") >= retries + 5
    assert metric(keys_web, "loraplex_gateway_worker_ejections_total") >= ejections + 1
