"""Hostile requests through the real web process (uvicorn, the ASGI fast path and Django's views):
megabyte model names, floods of unknown names, lone surrogates, two Authorization headers and a
Host the server does not answer to. Each is a 4xx in OpenAI's shape, never a 500, and none grows
the process's caches without bound (tests/gateway/test_ttl_cache.py has the bounds)."""

from __future__ import annotations

import json

import httpx
import pytest

from tenants.models import Tier
from tenants.services import tenant_create
from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ready(registry, worker, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(web, key: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{web.url}/v1/chat/completions", headers=auth(key), timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra})


def test_a_megabyte_model_name_is_a_400_before_any_lookup(web, registry, tenant_a):
    too_long = chat(web, tenant_a.key, "m" * 1_000_000)  # under the 1 MiB body bound
    assert too_long.status_code == 400, too_long.text[:300]
    error = too_long.json()["error"]
    assert error["code"] == "model_name_too_long" and error["param"] == "model" and "256" in error["message"]
    # Not echoed back: the refusal is small.
    assert len(too_long.content) < 1000
    assert chat(web, tenant_a.key, "m" * 257).status_code == 400
    assert chat(web, tenant_a.key, "m" * 256).json()["error"]["code"] == "model_not_found"


def test_unknown_model_requests_drain_the_request_bucket_then_429(web, registry, settings, tenant_a):
    Tier.objects.create(name="tiny-rpm", requests_per_minute=2, tokens_per_minute=100_000, max_tokens_per_request=16,
                        priority=2, max_concurrent_training_jobs=1, max_adapters=5, degradation_allowed=False)
    _, key = tenant_create(slug="flooder", tier_name="tiny-rpm")
    capacity = round(2 * settings.GATEWAY.bucket_burst)
    replies = [chat(web, key, f"no-such-model-{index}") for index in range(capacity + 2)]
    assert [reply.status_code for reply in replies[:capacity]] == [404] * capacity, [r.text for r in replies]
    assert [reply.headers["x-ratelimit-remaining-requests"] for reply in replies[:capacity]] == [
        str(capacity - 1 - index) for index in range(capacity)]
    for limited in replies[capacity:]:
        assert limited.status_code == 429, limited.text
        assert limited.json()["error"]["code"] == "rate_limit_exceeded" and int(limited.headers["retry-after"]) >= 1
        assert "unknown models" in limited.json()["error"]["message"]


def test_malformed_requests_drain_the_request_bucket_then_429(web, registry, settings, tenant_a):
    # Each refusal cost the gateway its decoding: a flood of them is bounded by the caller's rpm.
    Tier.objects.create(name="tiny-rpm-malformed", requests_per_minute=2, tokens_per_minute=100_000,
                        max_tokens_per_request=16, priority=2, max_concurrent_training_jobs=1, max_adapters=5,
                        degradation_allowed=False)
    _, key = tenant_create(slug="malformer", tier_name="tiny-rpm-malformed")
    capacity = round(2 * settings.GATEWAY.bucket_burst)
    body = f'{{"model": "{settings.BASE_MODEL_NAME}", "prompt": "hi", "max_tokens": 1, "temperature": NaN}}'
    replies = [httpx.post(f"{web.url}/v1/completions", headers={**auth(key), "content-type": "application/json"},
                          content=body, timeout=60) for _ in range(capacity + 1)]
    assert [reply.status_code for reply in replies[:capacity]] == [400] * capacity, [r.text for r in replies]
    assert replies[0].json()["error"]["param"] == "temperature"
    assert replies[capacity - 1].headers["x-ratelimit-remaining-requests"] == "0"
    assert replies[capacity].status_code == 429, replies[capacity].text
    assert "malformed" in replies[capacity].json()["error"]["message"]


@pytest.mark.parametrize("field", ["model", "user", "content", "stop"])
def test_a_lone_surrogate_in_a_field_is_a_400(web, ready, tenant_a, field):
    from django.conf import settings

    body = {"model": settings.BASE_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "user": "u-1", "stop": ["never"]}
    text = json.dumps(body)
    # json.dumps would escape a real surrogate the same way; written out to send exactly "\ud800".
    target = {"model": f'"{settings.BASE_MODEL_NAME}"', "user": '"u-1"', "content": '"hi"', "stop": '["never"]'}[field]
    spoiled = {"model": r'"a\ud800"', "user": r'"u\ud800"', "content": r'"hi \ud800"', "stop": r'["\ud800"]'}[field]
    raw = text.replace(target, spoiled, 1)
    assert raw != text
    reply = httpx.post(f"{web.url}/v1/chat/completions", content=raw.encode(), timeout=60,
                       headers={**auth(tenant_a.key), "Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_unicode" and "surrogate" in error["message"]


def test_two_authorization_headers_are_a_400_on_every_route(web, ready, tenant_a, tenant_b):
    from django.conf import settings

    twice = [("Authorization", f"Bearer {tenant_a.key}"), ("Authorization", f"Bearer {tenant_b.key}")]
    body = {"model": settings.BASE_MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    replies = [
        httpx.post(f"{web.url}/v1/completions", headers=twice, json=body, timeout=60),
        httpx.post(f"{web.url}/v1/chat/completions", headers=twice, timeout=60,
                   json={**body, "messages": [{"role": "user", "content": "hi"}]}),
        httpx.get(f"{web.url}/v1/models", headers=twice, timeout=60),
        # The management API and OpenAI's files route (DRF) refuse it the same way.
        httpx.get(f"{web.url}/api/v1/tenant", headers=twice, timeout=60),
        httpx.get(f"{web.url}/v1/files", headers=twice, timeout=60),
    ]
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "duplicate_authorization" and error["type"] == "invalid_request_error"
    assert httpx.post(f"{web.url}/v1/completions", headers=auth(tenant_a.key), json=body, timeout=60).status_code == 200


def test_a_host_outside_allowed_hosts_is_a_400_on_the_fast_path_as_in_django(web, ready, tenant_a):
    from django.conf import settings

    body = {"model": settings.BASE_MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    for path in ("/v1/completions", "/v1/chat/completions"):
        refused = httpx.post(f"{web.url}{path}", headers={**auth(tenant_a.key), "Host": "evil.example"},
                             json={**body, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "disallowed_host"
    # Django's own routes refuse it too (its 400 page).
    assert httpx.get(f"{web.url}/v1/models", headers={**auth(tenant_a.key), "Host": "evil.example"},
                     timeout=60).status_code == 400
    allowed = httpx.post(f"{web.url}/v1/completions", headers={**auth(tenant_a.key), "Host": "localhost"}, json=body,
                         timeout=60)
    assert allowed.status_code == 200, allowed.text
