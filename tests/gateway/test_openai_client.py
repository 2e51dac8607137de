"""The `openai` client against a real web process and a real serving worker: chat and completions,
streamed or not, give what the worker gives when called directly; two tenants never see each
other's adapters; a version the worker never held is loaded on its first request."""

from __future__ import annotations

import httpx
import openai
import pytest

from serving.registry import services
from tests.gateway.conftest import WORKER_KEY, upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

GREEDY = {"temperature": 0, "max_tokens": 12}


def client(web, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120)


def direct(worker, path: str, body: dict) -> dict:
    reply = httpx.post(f"{worker.url}{path}", json=body, timeout=120, headers={"Authorization": f"Bearer {WORKER_KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture
def deployed(registry, tenant_a, adapter_dirs, worker, redis_client):
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    version = upload_version(adapter, adapter_dirs[0], "1.0.0")
    services.adapter_version_deploy(version=version, actor="test")
    wait_for_worker(redis_client, "gw-worker-1")
    return version


def test_chat_and_completions_through_the_gateway_equal_the_worker(web, worker, tenant_a, deployed):
    api = client(web, tenant_a.key)
    messages = [{"role": "user", "content": "Say hello"}]

    chat = api.chat.completions.with_raw_response.create(model="support-bot", messages=messages, **GREEDY)
    assert chat.headers["x-loraplex-adapter-version"] == "1.0.0"
    assert chat.headers["x-ratelimit-limit-requests"] == "400"
    reply = chat.parse()
    assert reply.model == "support-bot"
    # The gateway loaded the version on this first request: now the worker serves it by name.
    expected = direct(worker, "/v1/chat/completions",
                      {"model": "alice-co/support-bot@1.0.0", "messages": messages, **GREEDY})
    assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"]

    streamed = api.chat.completions.create(model="support-bot", messages=messages, stream=True, **GREEDY)
    chunks = list(streamed)
    assert all(chunk.model == "support-bot" for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)  # not asked for: not shown
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content

    with_usage = list(api.chat.completions.create(model="support-bot", messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY))
    assert with_usage[-1].usage.completion_tokens == reply.usage.completion_tokens

    completion = api.completions.create(model="support-bot", prompt="Once upon a time", **GREEDY)
    expected = direct(worker, "/v1/completions",
                      {"model": "alice-co/support-bot@1.0.0", "prompt": "Once upon a time", **GREEDY})
    assert completion.model == "support-bot"
    assert completion.choices[0].text == expected["choices"][0]["text"]
    text = "".join(chunk.choices[0].text for chunk in api.completions.create(
        model="support-bot", prompt="Once upon a time", stream=True, **GREEDY) if chunk.choices)
    assert text == completion.choices[0].text

    base = api.completions.create(model=deployed.base_model, prompt="Once upon a time", **GREEDY)
    expected = direct(worker, "/v1/completions", {"model": deployed.base_model, "prompt": "Once upon a time", **GREEDY})
    assert base.choices[0].text == expected["choices"][0]["text"]
    assert base.model == deployed.base_model


def test_another_tenant_gets_the_same_404_as_a_missing_model(web, tenant_a, tenant_b, deployed):
    bob = client(web, tenant_b.key)
    errors = []
    for model in ("support-bot", "support-bot@1.0.0", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as caught:
            bob.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        errors.append(caught.value.body)
        with pytest.raises(openai.NotFoundError):
            bob.models.retrieve(model)
    assert all(error["code"] == "model_not_found" for error in errors)
    assert {error["message"].replace(model, "") for error, model in
            zip(errors, ("support-bot", "support-bot@1.0.0", "no-such-adapter"))} == {errors[2]["message"].replace(
                "no-such-adapter", "")}

    listed_b = {model.id for model in bob.models.list()}
    listed_a = {model.id: model for model in client(web, tenant_a.key).models.list()}
    assert listed_b == {deployed.base_model}
    assert {"support-bot", "support-bot@1.0.0", deployed.base_model} == set(listed_a)
    assert listed_a["support-bot"].parent == deployed.base_model
    assert client(web, tenant_a.key).models.retrieve("support-bot@1.0.0").id == "support-bot@1.0.0"


def test_keys_are_checked_before_anything_else(web, tenant_a, registry):
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    missing = httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer lp-000000000000.nope"})
    assert wrong.status_code == 401
    from tenants.services import api_key_create

    manage_only, key = api_key_create(tenant=tenant_a.tenant, name="ops", scopes=["manage"])
    scoped = httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {key}"})
    assert scoped.status_code == 403 and scoped.json()["error"]["code"] == "insufficient_scope"
