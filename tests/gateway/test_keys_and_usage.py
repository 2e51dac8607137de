"""Through real web processes: revocation and suspension hold on a second process within 1 s; the
usage API's totals equal the sum of the responses' usage; metrics add up over two processes; a
client that leaves mid-stream aborts the worker's request; no live worker is a 503 (the application
in this process: the router's answer, not the process's)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from serving.registry import services
from tenants.models import ApiKey
from tenants.services import api_key_revoke, tenant_suspend
from tests.gateway.conftest import WORKER_KEY, upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def models(web, key: str) -> httpx.Response:
    return httpx.get(f"{web.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.fixture(scope="module")
def two_webs(start_web, tmp_path_factory: pytest.TempPathFactory):
    """Two web processes of the file's own, their metrics in one multiprocess directory (as
    production's workers of one host): what a key's revocation must reach and what the metrics
    add up over."""
    directory = tmp_path_factory.mktemp("prometheus")
    return start_web(PROMETHEUS_MULTIPROC_DIR=str(directory)), start_web(PROMETHEUS_MULTIPROC_DIR=str(directory))


def test_a_revoked_key_and_a_suspended_tenant_are_refused_by_a_second_process_within_1s(
        two_webs, registry, tenant_a, tenant_b):
    for process in two_webs:
        assert models(process, tenant_a.key).status_code == 200  # cached now
        assert models(process, tenant_b.key).status_code == 200
    api_key_revoke(api_key=ApiKey.objects.get(tenant=tenant_a.tenant))
    tenant_suspend(slug=tenant_b.tenant.slug)
    time.sleep(1.0)
    for process in two_webs:
        revoked = models(process, tenant_a.key)
        assert revoked.status_code == 401 and revoked.json()["error"]["code"] == "invalid_api_key"
        suspended = models(process, tenant_b.key)
        assert suspended.status_code == 403 and suspended.json()["error"]["code"] == "tenant_suspended"


def test_usage_api_totals_equal_the_responses_usage(web, worker, registry, tenant_a, tenant_b, adapter_dirs,
                                                    redis_client, client_a):
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="usage-bot")
    services.adapter_version_deploy(version=upload_version(adapter, adapter_dirs[0], "1.0.0"), actor="test")
    wait_for_worker(redis_client, "gw-worker-1")
    api = openai.OpenAI(base_url=f"{web.url}/v1", api_key=tenant_a.key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "count to three"}]
    prompt = completion = 0
    for model in ("usage-bot", "gw-tiny-llama", "usage-bot@1.0.0"):
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=5)
        prompt += reply.usage.prompt_tokens
        completion += reply.usage.completion_tokens
        last = list(api.completions.create(model=model, prompt="abc", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))[-1]
        prompt += last.usage.prompt_tokens
        completion += last.usage.completion_tokens
    # Bob's traffic is his own.
    openai.OpenAI(base_url=f"{web.url}/v1", api_key=tenant_b.key, max_retries=0).completions.create(
        model="gw-tiny-llama", prompt="x", max_tokens=3)

    # Usage is recorded after each reply's last byte, off the reply's path: the last ones may still be
    # on their way when the replies are in. Wait for all six, then compare every figure.
    deadline = time.monotonic() + 30
    while (body := client_a.get("/api/v1/usage").json())["totals"]["requests"] < 6:
        assert time.monotonic() < deadline, f"the usage records never all arrived: {body['totals']}"
        time.sleep(0.1)
    assert body["totals"] == {"requests": 6, "prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion, "degraded_requests": 0}
    by_adapter = {row["adapter"]: row for row in client_a.get("/api/v1/usage?group_by=adapter").json()["data"]}
    assert set(by_adapter) == {None, "usage-bot"} and by_adapter["usage-bot"]["requests"] == 4
    by_key = client_a.get("/api/v1/usage?group_by=key").json()["data"]
    assert len(by_key) == 1 and by_key[0]["total_tokens"] == prompt + completion
    days = client_a.get("/api/v1/usage?group_by=day&start=2000-01-01").json()["data"]
    assert sum(row["requests"] for row in days) == 6
    assert client_a.get("/api/v1/usage?end=2000-01-01").json()["totals"]["requests"] == 0
    bad = client_a.get("/api/v1/usage?group_by=month")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"

    from serving.registry.models import UsageRecord

    record = UsageRecord.objects.filter(tenant=tenant_a.tenant, version="1.0.0").first()
    assert record.status == "ok" and record.worker == "gw-worker-1" and record.ttft_ms is not None


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def test_metrics_add_up_over_two_web_processes(two_webs, worker, registry, tenant_a, redis_client):
    first, second = two_webs
    wait_for_worker(redis_client, "gw-worker-1")
    # The processes are the file's: counted from what another test of it left.
    before = httpx.get(f"{first.url}/metrics", timeout=30).text
    requests_before = _sample(before, "loraplex_gateway_requests_total", tier="standard", endpoint="completions",
                              status="200")
    upstream_before = _sample(before, "loraplex_gateway_upstream_duration_seconds_count", status="ok")
    for process, count in ((first, 2), (second, 3)):
        for _ in range(count):
            # A web process's first read of the worker registry can time out on a loaded machine (its
            # Redis guard); it then answers 503 no_serving_worker with Retry-After, and a client retries.
            # Those 503s are counted under their own status, so the 200s below still add up to five.
            deadline = time.monotonic() + 30
            while True:
                reply = httpx.post(f"{process.url}/v1/completions", headers={"Authorization": f"Bearer {tenant_a.key}"},
                                   json={"model": "gw-tiny-llama", "prompt": "x", "max_tokens": 1}, timeout=60)
                if reply.status_code != 503 or "no_serving_worker" not in reply.text or time.monotonic() > deadline:
                    break
                time.sleep(float(reply.headers.get("retry-after", "1")))
            assert reply.status_code == 200, reply.text
    text = httpx.get(f"{first.url}/metrics", timeout=30).text
    assert _sample(text, "loraplex_gateway_requests_total", tier="standard", endpoint="completions",
                   status="200") - requests_before == 5
    assert _sample(text, "loraplex_gateway_upstream_duration_seconds_count", status="ok") - upstream_before == 5
    assert "loraplex_gateway_requests_in_flight 0.0" in text


def test_a_client_that_leaves_mid_stream_aborts_the_worker_request(web, worker, registry, tenant_a, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")
    aborted = worker.metric("loraplex_requests_total", model="gw-tiny-llama", status="aborted")
    with httpx.stream("POST", f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {tenant_a.key}"},
                      json={"model": "gw-tiny-llama", "prompt": "x", "max_tokens": 256, "ignore_eos": True, "stream": True},
                      timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        request_id = stream.headers["x-request-id"]
    deadline = time.monotonic() + 30
    while worker.metric("loraplex_requests_total", model="gw-tiny-llama", status="aborted") <= aborted:
        assert time.monotonic() < deadline, "the worker's request was not aborted"
        time.sleep(0.2)
    from serving.registry.models import UsageRecord
    from serving.registry.usage import usage_records_flush

    while not UsageRecord.objects.filter(request_id=request_id).exists():
        usage_records_flush()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    record = UsageRecord.objects.get(request_id=request_id)
    # Charged its reservation: the worker generated past what was relayed (issue 37, item 4).
    assert record.status == "aborted" and record.completion_tokens == 256


def test_no_live_worker_for_the_base_model_is_a_503_with_retry_after(settings, registry, tenant_a):
    """The router's answer, not the process's: lora_platform.asgi's application (what uvicorn runs) in
    this process over httpx's ASGI transport, on a base model no worker serves."""
    from asgiref.sync import async_to_sync

    from lora_platform.asgi import application

    settings.BASE_MODEL_NAME = "absent-base"
    # A new event loop's first Redis call opens its connection, which a loaded machine can hold past
    # the guard's 0.25 s (tests/gateway/test_entry_points.py): the worker registry is read, not guarded away.
    settings.GATEWAY_REDIS = settings.GATEWAY_REDIS.model_copy(update={"timeout_s": 5.0})

    async def request() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                     timeout=60) as client:
            return await client.post("/v1/completions", headers={"Authorization": f"Bearer {tenant_a.key}"},
                                     json={"model": "absent-base", "prompt": "x", "max_tokens": 1})

    reply = async_to_sync(request)()
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "no_serving_worker" and reply.headers["retry-after"] == "1"


def test_the_worker_loads_on_demand_only_for_its_key_holder_and_only_the_recorded_digest(
        worker, registry, tenant_a, adapter_dirs):
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="digest-bot")
    version = upload_version(adapter, adapter_dirs[1], "1.0.0")
    body = {"model": version.qualified_name, "prompt": "x", "max_tokens": 1,
            "loraplex_adapter": {"artifact_uri": version.artifact_uri, "manifest_sha256": "0" * 64}}
    refused = httpx.post(f"{worker.url}/v1/completions", timeout=30, json=body)
    assert refused.status_code == 401
    operator = {"Authorization": f"Bearer {WORKER_KEY}"}
    mismatch = httpx.post(f"{worker.url}/v1/completions", timeout=60, headers=operator, json=body)
    assert mismatch.status_code == 500 and mismatch.json()["error"]["code"] == "adapter_digest_mismatch"
    served = {m["id"] for m in httpx.get(f"{worker.url}/v1/models", timeout=30, headers=operator).json()["data"]}
    assert version.qualified_name not in served
    body["loraplex_adapter"]["manifest_sha256"] = version.manifest_sha256
    assert httpx.post(f"{worker.url}/v1/completions", timeout=60, headers=operator, json=body).status_code == 200
