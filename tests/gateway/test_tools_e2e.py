"""Tools through the gateway with the `openai` client (a real web process and serving worker): the
gateway forwards `tools`, `tool_choice`, `parallel_tool_calls` and the history's tool messages, so
a tenant's adapter makes a call that parses, streamed as whole, takes its result back, and a
tool_choice naming no tool is the worker's 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from serving.registry import services
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

ORDER = {"type": "function", "function": {
    "name": "order_status",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 9999}},
                   "required": ["order_id"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Where is my order 42?"}]


@pytest.fixture
def tool_bot(registry, tenant_a, adapter_dirs, worker, redis_client) -> None:
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="tool-bot")
    version = upload_version(adapter, adapter_dirs[1], "1.0.0")
    services.adapter_version_deploy(version=version, actor="test")
    wait_for_worker(redis_client, "gw-worker-1")


def test_a_tool_call_round_trip_through_the_gateway(web, tenant_a, tool_bot):
    api = openai.OpenAI(base_url=f"{web.url}/v1", api_key=tenant_a.key, max_retries=0, timeout=120)
    args = dict(model="tool-bot", messages=MESSAGES, tools=[ORDER], parallel_tool_calls=False, max_tokens=200,
                temperature=1.0, seed=3, tool_choice={"type": "function", "function": {"name": "order_status"}})
    choice = api.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "order_status"
    jsonschema.validate(json.loads(call.function.arguments), ORDER["function"]["parameters"])
    with api.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        again = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in again.message.tool_calls] == [
        (call.function.name, call.function.arguments)]

    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"status": "shipped"}'}]
    answer = api.chat.completions.create(model="tool-bot", messages=history, tools=[ORDER], max_tokens=8,
                                         temperature=0).choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")

    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="tool-bot", messages=MESSAGES, tools=[ORDER], max_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "refund"}})
    assert caught.value.body["param"] == "tool_choice" and "'refund'" in caught.value.body["message"]
