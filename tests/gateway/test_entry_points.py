"""Both ways into the request path: the ASGI fast path in front of Django (what uvicorn serves)
and the Django async views (what Django's own handler serves), and the fast path's own checks."""

from __future__ import annotations

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from tests.gateway.conftest import WORKER_KEY, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_django_view_serves_the_same_request_path(settings, registry, worker, tenant_a, redis_client):
    settings.SERVING_WORKER_API_KEY = WORKER_KEY
    wait_for_worker(redis_client, "gw-worker-1")
    client = AsyncClient()
    auth = {"Authorization": f"Bearer {tenant_a.key}"}
    reply = async_to_sync(client.post)("/v1/completions", {"model": "gw-tiny-llama", "prompt": "hi", "max_tokens": 3},
                                       content_type="application/json", headers=auth)
    assert reply.status_code == 200, reply.content
    assert reply.json()["usage"]["completion_tokens"] == 3 and reply["x-ratelimit-limit-requests"] == "400"
    wrong_method = async_to_sync(client.get)("/v1/chat/completions", headers=auth)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"


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
