"""Sampling through the gateway with the `openai` client (a real web process and serving worker):
the gateway forwards `n`, the penalties, `logit_bias`, vLLM's `repetition_penalty` and
`min_tokens`, `best_of`, `echo` and a list of prompts, so a tenant's adapter answers them as the
worker does, streamed and not, and a bad value is the worker's 400 naming the field."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from serving.registry import services
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = ["The quick brown fox", "Question: What is the capital of Italy? Answer:"]


@pytest.fixture
def sampler_bot(registry, tenant_a, adapter_dirs, worker, redis_client) -> None:
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="sampler-bot")
    version = upload_version(adapter, adapter_dirs[0], "1.0.0")
    services.adapter_version_deploy(version=version, actor="test")
    wait_for_worker(redis_client, "gw-worker-1")


def test_sampling_fields_through_the_gateway(web, tenant_a, sampler_bot):
    api = openai.OpenAI(base_url=f"{web.url}/v1", api_key=tenant_a.key, max_retries=0, timeout=120)
    args = dict(model="sampler-bot", prompt=PROMPTS, max_tokens=6, temperature=0, n=2, presence_penalty=0.5,
                frequency_penalty=0.5, logit_bias={"17": 2}, extra_body={"repetition_penalty": 1.3, "min_tokens": 3, "ignore_eos": True})
    whole = api.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text and whole.choices[2].text == whole.choices[3].text
    assert whole.usage.completion_tokens == 4 * 6
    texts: dict[int, str] = defaultdict(str)
    for chunk in api.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert dict(texts) == {c.index: c.text for c in whole.choices}

    echoed = api.completions.create(model="sampler-bot", prompt=PROMPTS[0], max_tokens=4, temperature=1.0, seed=1,
                                    n=1, best_of=3, echo=True)
    assert echoed.choices[0].text.startswith(PROMPTS[0])

    chat = api.chat.completions.create(model="sampler-bot", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=1.0, seed=4, n=2)
    assert [c.index for c in chat.choices] == [0, 1]

    # Each forwarded: the worker's refusal of a bad value comes back naming it.
    for extra, param in (({"min_tokens": 5}, "min_tokens"), ({"repetition_penalty": 0}, "repetition_penalty")):
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model="sampler-bot", prompt="Hi", max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="sampler-bot", prompt="Hi", max_tokens=2, logit_bias={"-1": 5})
    assert caught.value.body["param"] == "logit_bias"
