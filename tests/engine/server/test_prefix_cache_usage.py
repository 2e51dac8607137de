"""Prefix caching through the worker's API: a prompt sent again reports the tokens its adapter's
cache held in OpenAI's `usage.prompt_tokens_details.cached_tokens` (streamed and not), another
adapter's request of the same prompt reports none, /metrics counts the lookups and hits, and
`--no-enable-prefix-caching` leaves the field out; the flag reaches the engine's settings; vLLM's
`cache_salt` keeps requests of different salts apart."""

from __future__ import annotations

import uuid
from pathlib import Path

import openai
import pytest

from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config
from tests.engine.server.conftest import WorkerProcess

BLOCK = 16  # the worker's default --block-size


def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def _unique_prompt() -> str:
    """A prompt no other test sent, of several full blocks."""
    return f"Run {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog and " * 6


def test_a_repeated_prompt_reports_its_cached_tokens(worker: WorkerProcess, offline) -> None:
    api = client(worker)
    prompt = _unique_prompt()
    prompt_len = len(offline.get_tokenizer()(prompt).input_ids)
    cached = (prompt_len - 1) // BLOCK * BLOCK  # every full block but the last token's
    hits, queries = (worker.metric("loraplex_prefix_cache_hits_total"),
                     worker.metric("loraplex_prefix_cache_queries_total"))  # fmt: skip
    first = api.completions.create(model="alpha", prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens == prompt_len
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = api.completions.create(model="alpha", prompt=prompt, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == cached > 0
    assert again.choices[0].text == first.choices[0].text
    assert worker.metric("loraplex_prefix_cache_hits_total") - hits == cached
    assert worker.metric("loraplex_prefix_cache_queries_total") - queries == 2 * prompt_len

    other = api.completions.create(model="beta", prompt=prompt, max_tokens=3, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another adapter's KV is never shared

    stream = api.chat.completions.create(model="alpha", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=3, temperature=0, stream=True,
                                         stream_options={"include_usage": True})  # fmt: skip
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details.cached_tokens == 0  # the template's prompt is new
    chat = api.chat.completions.create(model="alpha", messages=[{"role": "user", "content": prompt}], max_tokens=3,
                                       temperature=0)  # fmt: skip
    assert chat.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // BLOCK * BLOCK
    api.close()


def test_a_cache_salt_keeps_requests_apart(worker: WorkerProcess) -> None:
    api = client(worker)
    prompt = _unique_prompt()

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        response = api.completions.create(model="tiny-base", prompt=prompt, max_tokens=2, temperature=0,
                                          extra_body=extra)  # fmt: skip
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") > 0
    with pytest.raises(openai.BadRequestError) as refused:
        cached("")
    assert "cache_salt" in str(refused.value)
    api.close()


def test_caching_off_leaves_the_field_out(start_worker, offline) -> None:
    worker = start_worker("--no-enable-prefix-caching", "--served-model-name", "tiny-base")
    api = client(worker)
    prompt = _unique_prompt()
    for _ in range(2):
        response = api.completions.create(model="tiny-base", prompt=prompt, max_tokens=2, temperature=0)
        assert response.usage.prompt_tokens_details is None
    assert worker.metric("loraplex_prefix_cache_hits_total") == 0
    api.close()


def test_the_flag_reaches_the_engine(tiny_model: Path) -> None:
    assert engine_config(parse_args(["--model", str(tiny_model)])).enable_prefix_caching is True
    off = parse_args(["--model", str(tiny_model), "--no-enable-prefix-caching"])
    assert engine_config(off).enable_prefix_caching is False
