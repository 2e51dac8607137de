"""Tier limits through the real web process: max_tokens, 429 in OpenAI's shape with its headers
and retry-after, degradation (allowed, not allowed, opted out) and its own bucket, and refunds
that charge exactly the tokens a request used."""

from __future__ import annotations

import time

import httpx
import pytest

from serving.registry import services
from tenants.models import Tier
from tenants.services import tenant_create
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def tier(name: str, *, rpm: int, tpm: int = 100_000, degradation: bool, max_tokens: int = 16) -> str:
    Tier.objects.create(name=name, requests_per_minute=rpm, tokens_per_minute=tpm, max_tokens_per_request=max_tokens,
                        priority=2, max_concurrent_training_jobs=1, max_adapters=5, degradation_allowed=degradation)
    return name


def tenant_with_adapter(slug: str, tier_name: str, directory) -> str:
    tenant, key = tenant_create(slug=slug, tier_name=tier_name)
    adapter = services.adapter_create(tenant=tenant, name="bot")
    services.adapter_version_deploy(version=upload_version(adapter, directory, "1.0.0"), actor="test")
    return key


def post(web, key: str, **body) -> httpx.Response:
    return httpx.post(f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "bot", "prompt": "hi", "max_tokens": 2, **body})


@pytest.fixture
def ready(registry, worker, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")


def test_max_tokens_over_the_tier_is_a_400_naming_both_numbers(web, ready, adapter_dirs):
    key = tenant_with_adapter("tokens-co", tier("small", rpm=100, degradation=False), adapter_dirs[0])
    refused = post(web, key, max_tokens=17)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "max_tokens_exceeded" and error["param"] == "max_tokens"
    assert "17" in error["message"] and "16" in error["message"] and "'small'" in error["message"]
    chat = httpx.post(f"{web.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    # Not asked: the tier's limit.
    unbounded = post(web, key, max_tokens=None, ignore_eos=True)
    assert unbounded.status_code == 200 and unbounded.json()["usage"]["completion_tokens"] == 16


def test_the_tiers_token_limit_covers_every_completion_of_a_request(web, ready, adapter_dirs):
    """n, best_of and a list of prompts multiply what one request can generate: the tier's per-request
    limit (16) holds for all of its completions together, and a request that leaves max_tokens unset
    shares the limit between them."""
    key = tenant_with_adapter("many-co", tier("many", rpm=100, degradation=False), adapter_dirs[0])
    for fields in ({"n": 2, "max_tokens": 9}, {"best_of": 3, "n": 1, "max_tokens": 6},
                   {"prompt": ["hi", "there"], "max_tokens": 9}):
        refused = post(web, key, **fields)
        assert refused.status_code == 400, (fields, refused.text)
        error = refused.json()["error"]
        assert error["code"] == "max_tokens_exceeded" and error["param"] == "max_tokens", error
        assert "completions" in error["message"] and "'many'" in error["message"], error
    both = post(web, key, n=2, max_tokens=8, ignore_eos=True)
    assert both.status_code == 200, both.text
    assert len(both.json()["choices"]) == 2 and both.json()["usage"]["completion_tokens"] == 16
    # Not asked: 16 shared by 4 completions (2 prompts x n 2), 4 tokens each.
    shared = post(web, key, prompt=["hi", "there"], n=2, max_tokens=None, ignore_eos=True)
    assert shared.status_code == 200, shared.text
    assert [c["index"] for c in shared.json()["choices"]] == [0, 1, 2, 3]
    assert shared.json()["usage"]["completion_tokens"] == 16
    too_many = post(web, key, n=17, max_tokens=None)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n", too_many.text


def test_over_quota_degrades_once_its_own_bucket_allows_then_429(web, ready, adapter_dirs):
    key = tenant_with_adapter("degrade-co", tier("degrading", rpm=1, degradation=True), adapter_dirs[0])
    first = post(web, key)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "200000"
    assert first.headers["x-loraplex-adapter-version"] == "1.0.0" and "x-loraplex-degraded" not in first.headers
    assert post(web, key).status_code == 200

    degraded = post(web, key)
    assert degraded.status_code == 200, degraded.text
    assert degraded.headers["x-loraplex-degraded"] == "quota"
    assert degraded.json()["model"] == "gw-tiny-llama"
    assert "x-loraplex-adapter-version" not in degraded.headers
    assert degraded.headers["x-ratelimit-remaining-requests"] == "0"

    refused = post(web, key)
    assert refused.status_code == 429
    assert refused.json() == {"error": {
        "message": refused.json()["error"]["message"], "type": "rate_limit_error", "param": None,
        "code": "rate_limit_exceeded"}}
    assert "'degrading' tier: 1 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


def test_opting_out_of_degradation_or_a_tier_without_it_gets_429(web, ready, adapter_dirs):
    name = tier("degrading2", rpm=1, degradation=True)
    opted_out = tenant_with_adapter("optout-co", name, adapter_dirs[0])
    assert [post(web, opted_out).status_code for _ in range(2)] == [200, 200]
    assert post(web, opted_out, allow_degradation=False).status_code == 429
    assert post(web, opted_out).headers.get("x-loraplex-degraded") == "quota"

    strict = tenant_with_adapter("strict-co", tier("strict", rpm=1, degradation=False), adapter_dirs[0])
    assert [post(web, strict).status_code for _ in range(3)] == [200, 200, 429]


def _tokens_taken(redis_client, slug: str, capacity: float) -> float:
    level = redis_client.hget(f"loraplex:gateway:bucket:{slug}:tokens", "level")
    return capacity - (float(level) if level is not None else capacity)


def _wait_recorded(request_id: str) -> None:
    from serving.registry.models import UsageRecord

    deadline = time.monotonic() + 30
    while not UsageRecord.objects.filter(request_id=request_id).exists():
        assert time.monotonic() < deadline, f"no usage record for {request_id}"
        time.sleep(0.1)


def test_tokens_are_charged_as_used_and_a_short_stream_refunds_exactly_its_unused_tokens(
        start_web, ready, adapter_dirs, redis_client):
    # A burst of a million minutes at 6 tokens a minute: refill (0.1 token/s) never reaches the
    # capacity during the test, so every charge and refund shows in the level.
    web = start_web(GATEWAY_BUCKET_BURST="1000000")
    capacity = 6 * 1_000_000
    key = tenant_with_adapter("meter-co", tier("metered", rpm=1000, tpm=6, degradation=False), adapter_dirs[0])

    whole = post(web, key, max_tokens=16, temperature=0, return_token_ids=True)
    assert whole.status_code == 200, whole.text
    _wait_recorded(whole.headers["x-request-id"])
    usage = whole.json()["usage"]
    assert round(_tokens_taken(redis_client, "meter-co", capacity)) == usage["total_tokens"]

    # Stop at the fourth generated token: a stream far shorter than its 16 reserved tokens.
    ids = whole.json()["choices"][0]["token_ids"]
    stop = next(token for index, token in enumerate(ids) if index >= 3 and token not in ids[:index])
    before = _tokens_taken(redis_client, "meter-co", capacity)
    with httpx.stream("POST", f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "bot", "prompt": "hi", "max_tokens": 16, "temperature": 0, "stream": True,
                            "stop_token_ids": [stop], "stream_options": {"include_usage": True}}) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        request_id = stream.headers["x-request-id"]
    import json

    streamed = json.loads(events[-2][6:])["usage"]
    assert streamed["completion_tokens"] < 16
    _wait_recorded(request_id)
    assert round(_tokens_taken(redis_client, "meter-co", capacity) - before) == streamed["total_tokens"]
