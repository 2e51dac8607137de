"""One error body on every `/v1` route (serving.contracts.errors), as the official `openai` SDK reads it
through the web process: a 404 has one type whether the gateway (chat) or the files API answers,
each with its code; the worker's context-length refusal carries OpenAI's code."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)


def client(web, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_404_is_one_type_on_chat_and_on_files_each_with_its_code(web, registry, tenant_a):
    api = client(web, tenant_a.key)
    with pytest.raises(openai.NotFoundError) as chat:
        api.chat.completions.create(model="no-such-bot", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as files:
        api.files.retrieve("file-987654")
    with pytest.raises(openai.NotFoundError) as model:
        api.models.retrieve("no-such-bot")
    bodies = [chat.value.body, files.value.body, model.value.body]
    assert {body["type"] for body in bodies} == {"invalid_request_error"}
    assert [body["code"] for body in bodies] == ["model_not_found", "file_not_found", "model_not_found"]
    assert all(set(body) == {"message", "type", "code", "param"} for body in bodies)
    assert chat.value.body == model.value.body


def test_the_context_length_error_has_openais_code(web, worker, registry, tenant_a, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")
    base = client(web, tenant_a.key).models.list().data[0].id
    # Far past the worker's 2048-token context, well under the gateway's body limit.
    prompt = "The quick brown fox jumps over the lazy dog. " * 1000
    with pytest.raises(openai.BadRequestError) as refused:
        client(web, tenant_a.key).completions.create(model=base, prompt=prompt)
    body = refused.value.body
    assert (body["type"], body["code"]) == ("invalid_request_error", "context_length_exceeded"), body
    assert "maximum context length is 2048 tokens" in body["message"]
