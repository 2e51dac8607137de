"""The completion routes' one entry point, the ASGI fast path in front of Django (what uvicorn
serves), its own checks, and what Django's own handler (WSGI, its test client) answers there."""

from __future__ import annotations


import httpx
import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from tests.gateway.conftest import WORKER_KEY, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_asgi_application_serves_the_request_path_in_process(settings, registry, worker, tenant_a, redis_client):
    """lora_platform.asgi's application over httpx's ASGI transport: the same app uvicorn runs,
    in this process, on the test database."""
    from lora_platform.asgi import application

    settings.SERVING_WORKER_API_KEY = WORKER_KEY
    # A new event loop's first Redis call opens its connection: on a loaded 2-core machine that can
    # outlast the guard's 0.25 s, and a guarded-away registry read leaves no worker to route to.
    settings.GATEWAY_REDIS = settings.GATEWAY_REDIS.model_copy(update={"timeout_s": 5.0})
    wait_for_worker(redis_client, "gw-worker-1")
    auth = {"Authorization": f"Bearer {tenant_a.key}"}

    async def requests() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                     timeout=60) as client:
            reply = await client.post("/v1/completions", headers=auth,
                                      json={"model": "gw-tiny-llama", "prompt": "hi", "max_tokens": 3,
                                            # A random model samples its EOS now and then.
                                            "ignore_eos": True})
            wrong_method = await client.get("/v1/chat/completions", headers=auth)
            return reply, wrong_method

    reply, wrong_method = async_to_sync(requests)()
    assert reply.status_code == 200, reply.content
    assert reply.json()["usage"]["completion_tokens"] == 3 and reply.headers["x-ratelimit-limit-requests"] == "400"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert wrong_method.headers["allow"] == "POST"


def test_django_alone_says_the_asgi_application_serves_completions(registry, tenant_a):
    """Django's own handler (WSGI, its test client) has no second way into the request path: it
    answers both routes with a 404 naming the application that serves them."""
    client = AsyncClient()
    auth = {"Authorization": f"Bearer {tenant_a.key}"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = async_to_sync(client.post)(path, {"model": "gw-tiny-llama", "prompt": "hi"},
                                           content_type="application/json", headers=auth)
        assert reply.status_code == 404, reply.content
        error = reply.json()["error"]
        assert error["code"] == "endpoint_not_served" and "lora_platform.asgi:application" in error["message"]


def test_the_fast_path_limits_the_body_and_answers_errors_in_json(web, settings, tenant_a, registry):
    headers = {"Authorization": f"Bearer {tenant_a.key}", "Content-Type": "application/json"}
    too_big = httpx.post(f"{web.url}/v1/completions", headers=headers, timeout=30,
                         content=b'{"model": "x", "prompt": "' + b"a" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}')
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
    not_json = httpx.post(f"{web.url}/v1/chat/completions", headers=headers, content=b"{nope", timeout=30)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    no_model = httpx.post(f"{web.url}/v1/chat/completions", headers=headers, json={"messages": []}, timeout=30)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    # Other methods and paths are Django's, with its JSON errors.
    assert httpx.get(f"{web.url}/v1/completions", headers=headers, timeout=30).status_code == 405
    assert httpx.get(f"{web.url}/v1/nothing-here", timeout=30).json()["error"]["code"] == "not_found"
