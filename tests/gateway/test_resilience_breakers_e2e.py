"""Breakers and the canary guard through a real web process and a real serving worker.

A version whose artifact is corrupted in storage fails every load on the worker (500
adapter_load_failed): the worker answers 5xx for that version only. As a canary it is taken out of
traffic by its breaker and aborted by the canary guard (one audit event); as the active version its
breaker answers 503 adapter_unavailable, or the base model where the tier allows degradation.
Other versions and other tenants are served throughout.

The web process is the file's own, its breakers opening at 10 calls (GATEWAY_BREAKER_MINIMUM_CALLS)
instead of production's 50: what is tested is that the breaker's opening takes the version out of
traffic, which 10 calls show as well as 50 (tests/gateway/test_breakers.py holds the counts
themselves), at a fifth of the failing requests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from runtime.breakers import KEY_PREFIX, State
from serving.registry import services
from serving.registry.models import AdapterVersion, DeploymentEvent
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
MINIMUM_CALLS = 10


@pytest.fixture(scope="module")
def web(start_web):
    """A web process whose breakers open after MINIMUM_CALLS calls (all failed)."""
    return start_web(GATEWAY_BREAKER_MINIMUM_CALLS=str(MINIMUM_CALLS))


def corrupt(version: AdapterVersion) -> None:
    """Flip bytes of the stored weights: the artifact no longer matches its manifest's sha256."""
    weights = Path(urlparse(version.artifact_uri).path) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(255 - b for b in data[-16:])
    weights.write_bytes(bytes(data))


def complete(web, key: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{web.url}/v1/completions", json={**BODY, "model": model, **extra},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture
def two_tenants(registry, tenant_a, tenant_b, adapter_dirs, worker, redis_client):
    """alice-co/support-bot 1.0.0 active and bob-co/helper 1.0.0 active, both good."""
    bot = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    services.adapter_version_deploy(version=upload_version(bot, adapter_dirs[0], "1.0.0"), actor="test")
    helper = services.adapter_create(tenant=tenant_b.tenant, name="helper")
    services.adapter_version_deploy(version=upload_version(helper, adapter_dirs[1], "1.0.0"), actor="test")
    wait_for_worker(redis_client, "gw-worker-1")
    return bot, helper


def test_a_failing_canary_is_taken_out_of_traffic_and_aborted_once(web, tenant_a, tenant_b, two_tenants,
                                                                   adapter_dirs):
    bot, _ = two_tenants
    canary = upload_version(bot, adapter_dirs[2], "1.1.0")
    corrupt(canary)
    services.adapter_canary_start(version=canary, weight=0.5, actor="test")
    time.sleep(0.6)  # the web process's caches of served versions (GATEWAY_CACHE_SECONDS)

    canary_calls, other_tenant = [], []
    aborted_after: int | None = None
    abort_round = 0

    def one(_: int) -> tuple[str, int]:
        reply = complete(web, tenant_a.key, "support-bot")
        return reply.headers.get("x-loraplex-adapter-version", ""), reply.status_code

    with ThreadPoolExecutor(4) as pool:
        for round_ in range(60):
            for version, status in pool.map(one, range(4)):
                if version == "1.1.0":
                    canary_calls.append(status)
                else:
                    assert (version, status) == ("1.0.0", 200)
            other_tenant.append(complete(web, tenant_b.key, "helper").status_code)
            if aborted_after is None and DeploymentEvent.objects.filter(kind="abort").exists():
                aborted_after, abort_round = len(canary_calls), round_
            if aborted_after is not None and round_ >= abort_round + 3:
                break

    assert aborted_after is not None, f"the canary was never aborted ({len(canary_calls)} canary calls)"
    # Out of traffic within 50 more of its own calls than the breaker's minimum: what was in flight.
    assert MINIMUM_CALLS <= len(canary_calls) <= MINIMUM_CALLS + 50 and set(canary_calls) == {500}
    events = list(DeploymentEvent.objects.filter(actor="system:canary-guard"))
    assert len(events) == 1 and (events[0].kind, events[0].from_version, events[0].to_version) == (
        "abort", "1.1.0", "1.0.0")
    assert "circuit breaker" in events[0].reason and "1.1.0" in events[0].reason
    canary.refresh_from_db()
    assert canary.status == "deprecated"
    # Every later request is the active version's, and the other tenant never noticed.
    for _ in range(10):
        reply = complete(web, tenant_a.key, "support-bot")
        assert (reply.status_code, reply.headers["x-loraplex-adapter-version"]) == (200, "1.0.0")
    assert set(other_tenant) == {200}


def test_an_open_breaker_on_the_active_version_refuses_or_degrades(web, tenant_a, tenant_b, two_tenants,
                                                                  adapter_dirs, redis_client):
    faq = services.adapter_create(tenant=tenant_a.tenant, name="faq-bot")
    broken = upload_version(faq, adapter_dirs[2], "2.0.0")
    corrupt(broken)
    services.adapter_version_deploy(version=broken, actor="test")
    time.sleep(0.6)
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: complete(web, tenant_a.key, "faq-bot", allow_degradation=False).status_code,
                                 range(MINIMUM_CALLS)))
    assert set(statuses) == {500}  # the worker's own answer until the breaker has its minimum of calls
    # The gateway counts a call on its breaker after the reply (off the reply's path), so the last
    # calls' counts may land a moment after their 500s: wait for the shared breaker to open.
    breaker = KEY_PREFIX + broken.qualified_name
    deadline = time.monotonic() + 10
    while redis_client.hget(breaker, "state") != State.OPEN.value.encode():
        assert time.monotonic() < deadline, (
            f"the breaker is {redis_client.hget(breaker, 'state')!r} after {MINIMUM_CALLS} failures")
        time.sleep(0.05)

    refused = complete(web, tenant_a.key, "faq-bot", allow_degradation=False)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "adapter_unavailable"
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    # The standard tier allows degradation: the base model answers and says why.
    degraded = complete(web, tenant_a.key, "faq-bot")
    assert degraded.status_code == 200 and degraded.headers["x-loraplex-degraded"] == "circuit_open"
    assert degraded.json()["model"] != "faq-bot"
    # The tenant's other adapter and the other tenant are untouched.
    assert complete(web, tenant_a.key, "support-bot").status_code == 200
    assert complete(web, tenant_b.key, "helper").status_code == 200
