"""A key's own controls through the real web process and serving worker (docs/keys.md): a key past
its expiry, a model outside its allow-list, a key over its own rpm (while the tenant's other keys
go on), a key over its monthly budget (counted from the usage it recorded, and seeded from the
usage records when Redis holds no count) each refused with its code in OpenAI's shape."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.utils import timezone

from serving.registry import services
from serving.gateway.key_budget import Month
from serving.registry.models import UsageRecord
from tenants.models import ApiKey
from tenants.services import api_key_create, tenant_create
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ready(registry, worker, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")


@pytest.fixture
def tenant(ready, adapter_dirs):
    """A standard tenant with two deployed adapters, `bot` and `other`."""
    created, _ = tenant_create(slug=f"keys-{time.monotonic_ns() % 10**9}", tier_name="standard")
    for index, name in enumerate(("bot", "other")):
        adapter = services.adapter_create(tenant=created, name=name)
        services.adapter_version_deploy(version=upload_version(adapter, adapter_dirs[index], "1.0.0"), actor="test")
    return created


def key_for(tenant, **controls) -> tuple[ApiKey, str]:
    return api_key_create(tenant=tenant, name=f"key {len(controls)} {time.monotonic_ns()}", scopes=["inference"],
                          controls=controls)


def post(web, key: str, model: str = "bot", **body) -> httpx.Response:
    return httpx.post(f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": model, "prompt": "hi", "max_tokens": 2, **body})


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def wait_recorded(request_id: str) -> UsageRecord:
    deadline = time.monotonic() + 30
    while (record := UsageRecord.objects.filter(request_id=request_id).first()) is None:
        assert time.monotonic() < deadline, f"no usage record for {request_id}"
        time.sleep(0.1)
    return record


def test_a_key_past_its_expiry_is_refused_401_key_expired(web, tenant):
    row, key = key_for(tenant, expires_at=timezone.now() + timedelta(days=1))
    assert post(web, key).status_code == 200
    ApiKey.objects.filter(pk=row.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    time.sleep(1.0)  # the gateway's key cache (GATEWAY_CACHE_SECONDS, 0.5 s)
    refused = post(web, key)
    assert refused.status_code == 401
    error = error_of(refused)
    assert (error["code"], error["type"]) == ("key_expired", "authentication_error")
    assert f"(lp-{row.prefix}…) expired at" in error["message"]
    models = httpx.get(f"{web.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert models.status_code == 401 and error_of(models)["code"] == "key_expired"


def test_a_model_outside_the_keys_allow_list_is_refused_403_model_not_allowed(web, tenant):
    row, key = key_for(tenant, allowed_models=["bot"])
    assert post(web, key, "bot").status_code == 200
    pinned = post(web, key, "bot@1.0.0")
    assert pinned.status_code == 200 and pinned.headers["x-loraplex-adapter-version"] == "1.0.0"
    for model in ("other", "gw-tiny-llama"):
        refused = post(web, key, model)
        assert refused.status_code == 403, refused.text
        error = error_of(refused)
        assert (error["code"], error["type"], error["param"]) == ("model_not_allowed", "permission_error", "model")
        assert f"may not call '{model}': it is limited to bot" in error["message"]
        # Charged like an unknown model: the refusal carries the rate-limit headers.
        assert "x-ratelimit-remaining-requests" in refused.headers
    listed = httpx.get(f"{web.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    assert sorted(entry["id"] for entry in listed["data"]) == ["bot", "bot@1.0.0"]
    # The tenant's key without an allow-list calls everything.
    _, open_key = key_for(tenant)
    assert post(web, open_key, "other").status_code == 200


def test_a_key_over_its_own_rpm_is_refused_429_while_the_tenants_other_keys_go_on(web, tenant):
    row, key = key_for(tenant, requests_per_minute=1)  # a bucket of 2 (GATEWAY_BUCKET_BURST minutes)
    first = post(web, key)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"  # the key's bucket, tighter than the tier's 400
    assert post(web, key).status_code == 200
    refused = post(web, key)  # the standard tier degrades over its quota, but not over a key's own
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert f"API key lp-{row.prefix}… (its own limit: 1 requests per minute)" in error["message"]
    assert "x-loraplex-degraded" not in refused.headers and int(refused.headers["retry-after"]) >= 1
    _, other_key = key_for(tenant)
    assert post(web, other_key).status_code == 200


def test_a_key_over_its_monthly_budget_is_refused_429_key_budget_exceeded(web, tenant):
    row, key = key_for(tenant, monthly_token_budget=10)
    first = post(web, key, max_tokens=12, ignore_eos=True)
    assert first.status_code == 200, first.text
    wait_recorded(first.headers["x-request-id"])  # the spend counter grows with the usage record
    refused = post(web, key)
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert (error["code"], error["type"]) == ("key_budget_exceeded", "rate_limit_error")
    used = first.json()["usage"]["total_tokens"]
    assert f"(lp-{row.prefix}…) has used {used} tokens this month, its monthly budget is 10" in error["message"]
    assert Month.of(time.time()).iso_end() in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 31 * 86_400


def test_a_budget_counts_this_months_usage_records_when_redis_holds_no_count(web, tenant):
    row, key = key_for(tenant, monthly_token_budget=50)
    month = Month.of(time.time())
    recorded = dict(tenant=tenant, api_key_prefix=row.prefix, endpoint="completions", model="bot", adapter="bot",
                    version="1.0.0", status="ok", http_status=200, latency_ms=5.0)
    # Last month's 1,000 tokens do not count; this month's 44 do.
    UsageRecord.objects.create(request_id=f"old-{row.prefix}", prompt_tokens=500, completion_tokens=500,
                               created_at=datetime.fromtimestamp(month.start - 3600, tz=UTC), **recorded)
    UsageRecord.objects.create(request_id=f"now-{row.prefix}", prompt_tokens=4, completion_tokens=40,
                               created_at=datetime.fromtimestamp(max(month.start, time.time() - 5), tz=UTC),
                               **recorded)
    first = post(web, key, max_tokens=8, ignore_eos=True)
    assert first.status_code == 200, first.text  # 44 < 50
    wait_recorded(first.headers["x-request-id"])
    refused = post(web, key)
    assert refused.status_code == 429 and error_of(refused)["code"] == "key_budget_exceeded"
    assert f"has used {44 + first.json()['usage']['total_tokens']} tokens this month" in error_of(refused)["message"]
