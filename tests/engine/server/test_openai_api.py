"""The OpenAI-compatible API through the official `openai` client: completions and chat, streamed
and not, for the base model and several adapters at once, token for token what the offline API
generates; the error statuses the client maps to its exceptions; /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from serving.engine import LoRARequest, SamplingParams
from tests.engine.server.conftest import WorkerProcess

BASE = "tiny-base"
PROMPTS = [
    "The quick brown fox",
    "Hello! How are you today?",
    "Question: What is the capital of Italy? Answer:",
]
CHATS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the sum of 12 and 30?"}],
]
MAX_TOKENS = 16


def client(worker: WorkerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def lora(model: str, adapters: dict[str, Path]) -> LoRARequest | None:
    return None if model == BASE else LoRARequest(model, str(adapters[model]))


def test_completions_and_chat_match_the_offline_api_under_concurrency(worker, offline, adapters):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    models = [BASE, "alpha", "beta"]
    expected_completion = {
        (model, prompt): offline.generate(prompt, greedy, lora(model, adapters))[0] for model in models for prompt in PROMPTS
    }
    expected_chat = {
        (model, i): offline.chat(chat, greedy, lora(model, adapters))[0] for model in models for i, chat in enumerate(CHATS)
    }
    # The adapters change what is generated, so serving the wrong one could not go unnoticed.
    for model in ("alpha", "beta"):
        assert any(
            expected_completion[model, p].outputs[0].token_ids != expected_completion[BASE, p].outputs[0].token_ids
            for p in PROMPTS
        )

    async def completion(api: openai.AsyncOpenAI, model: str, prompt: str, stream: bool) -> tuple[list[int], str, object]:
        args = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
        if not stream:
            response = await api.completions.create(**args)
            return response.choices[0].token_ids, response.choices[0].text, response.usage
        ids, text, usage = [], "", None
        async for chunk in await api.completions.create(**args, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                ids += getattr(choice, "token_ids", None) or []
                text += choice.text
        return ids, text, usage

    async def chat(api: openai.AsyncOpenAI, model: str, messages: list, stream: bool) -> tuple[list[int], str, object]:
        args = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"return_token_ids": True})
        if not stream:
            response = await api.chat.completions.create(**args)
            assert response.choices[0].message.role == "assistant"
            return response.choices[0].token_ids, response.choices[0].message.content, response.usage
        ids, text, usage = [], "", None
        async for chunk in await api.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                ids += getattr(choice, "token_ids", None) or []
                text += choice.delta.content or ""
        return ids, text, usage

    async def run_all() -> list:
        api = client(worker)
        jobs, keys = [], []
        for model in models:
            for stream in (False, True):
                for prompt in PROMPTS:
                    jobs.append(completion(api, model, prompt, stream))
                    keys.append(("completion", model, prompt))
                for i, messages in enumerate(CHATS):
                    jobs.append(chat(api, model, messages, stream))
                    keys.append(("chat", model, i))
        results = await asyncio.gather(*jobs)
        await api.close()
        return list(zip(keys, results))

    results = asyncio.run(run_all())
    assert len(results) == 30
    for (kind, model, which), (ids, text, usage) in results:
        expected = expected_completion[model, which] if kind == "completion" else expected_chat[model, which]
        assert ids == expected.outputs[0].token_ids, (kind, model, which)
        assert text == expected.outputs[0].text, (kind, model, which)
        assert usage.prompt_tokens == len(expected.prompt_token_ids)
        assert usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streams_end_with_done_and_usage_only_when_asked(worker):
    body = {"model": "alpha", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    for include_usage in (False, True):
        request = dict(body, stream_options={"include_usage": include_usage})
        with httpx.stream("POST", f"{worker.url}/v1/completions", json=request, timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        payloads = [httpx.Response(200, content=e.removeprefix("data: ")).json() for e in events[:-1]]
        assert payloads[-1 - include_usage]["choices"][0]["finish_reason"] == "length"
        if include_usage:
            assert payloads[-1]["choices"] == []
            assert payloads[-1]["usage"]["completion_tokens"] == 5
            assert all(p["usage"] is None for p in payloads[:-1])
        else:
            assert all(p.get("usage") is None for p in payloads)


def test_logprobs_and_seeded_sampling(worker):
    api = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    completion = api.completions.create(model="beta", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))  # greedy picks the top token

    chat = api.chat.completions.create(model=BASE, messages=CHATS[0], max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)

    def sample(seed: int) -> str:
        return api.completions.create(model="alpha", prompt="The weather", max_tokens=12, temperature=1.0,
                                      seed=seed).choices[0].text

    assert sample(7) == sample(7)
    api.close()


def test_a_seed_repeats_its_sample_and_other_seeds_sample_differently(worker):
    api = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)

    def sample(seed: int) -> str:
        return api.completions.create(model=BASE, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      seed=seed).choices[0].text

    samples = {seed: sample(seed) for seed in (1, 2, 3)}
    assert sample(2) == samples[2], "the same seed draws the same tokens"
    assert len(set(samples.values())) == 3, f"each seed must draw its own tokens: {samples}"
    api.close()


def test_errors_have_openai_statuses_and_shape(worker):
    api = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert "no-such-adapter" in missing.value.message
    assert missing.value.body["code"] == "model_not_found"

    with pytest.raises(openai.BadRequestError) as too_long:
        api.chat.completions.create(model="alpha", messages=CHATS[0], max_tokens=2040)
    assert "maximum context length is 2048 tokens" in too_long.value.message
    assert too_long.value.body["param"] == "max_tokens"

    with pytest.raises(openai.BadRequestError) as unsupported:
        api.completions.create(model=BASE, prompt="hi", max_tokens=2, suffix="!")
    assert "suffix" == unsupported.value.body["param"]

    with pytest.raises(openai.BadRequestError) as bad_value:
        api.completions.create(model=BASE, prompt="hi", max_tokens=2, temperature=-1)
    assert "temperature" in bad_value.value.message
    api.close()

    raw = httpx.post(f"{worker.url}/v1/chat/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400
    assert raw.json()["error"]["type"] == "invalid_request_error"


def test_models_health_and_metrics(worker, adapters):
    models = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused").models.list()
    by_id = {model.id: model for model in models.data}
    assert by_id[BASE].parent is None
    assert by_id["alpha"].parent == BASE and by_id["beta"].parent == BASE
    assert by_id["alpha"].root == "alpha"  # an open worker shows nobody where adapters are stored

    assert httpx.get(f"{worker.url}/health").json() == {"status": "ready"}
    assert all(status == 503 and state == "loading" for status, state in worker.health_before_ready)

    before = worker.metric("loraplex_requests_total", model="alpha", status="ok")
    httpx.post(f"{worker.url}/v1/completions", json={"model": "alpha", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    httpx.post(f"{worker.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=60)
    assert worker.metric("loraplex_requests_total", model="alpha", status="ok") == before + 1
    assert worker.metric("loraplex_requests_total", model="nope", status="not_found") >= 1
    assert worker.metric("loraplex_time_to_first_token_seconds_count") >= 1
    assert worker.metric("loraplex_e2e_request_latency_seconds_count") >= 1
    assert worker.metric("loraplex_lora_resident", adapter="alpha", tier="cpu") == 1
    assert worker.metric("loraplex_lora_slots_total") == 2
    assert worker.metric("loraplex_kv_cache_blocks_total") == 512


def test_an_sse_event_is_one_line_whatever_the_text_holds():
    """Generated text may hold U+2028, U+2029 or U+0085, which JSON leaves raw and line readers
    such as httpx's iter_lines break at: the event must still be one line and decode back."""
    from serving.contracts.protocol import CompletionChoice, CompletionResponse
    from serving.engine.server.streaming import sse

    text = "a\u2028b\u2029c\x85d\ne"
    event = sse(CompletionResponse(id="x", created=0, model="m", choices=[CompletionChoice(text=text)]))
    lines = [line for line in httpx.Response(200, content=event).iter_lines() if line]
    assert len(lines) == 1
    assert httpx.Response(200, content=lines[0].removeprefix("data: ")).json()["choices"][0]["text"] == text
