"""Each generation request is counted once in loraplex_requests_total, with the status of how it
ended (a finished stream, a client leaving mid-stream or mid-reply, a refused request), and only
admitted requests count their prompt tokens. The requests go to an adapter name of this test's
own, so the counts it reads are its requests' alone."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.serving_worker.conftest import LONG_TOKENS

NAME = "outcomes"
PROMPT = [1, 45, 99, 173, 201, 32]  # token ids: their number is the prompt's length


def requests_by_status(worker, model: str) -> dict[str, float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    pattern = r'^loraplex_requests_total\{model="' + re.escape(model) + r'",status="([a-z_]+)"\} (\S+)$'
    return {status: float(value) for status, value in re.findall(pattern, text, re.MULTILINE) if float(value)}


def settled(worker, model: str, total: float, timeout: float = 60.0) -> dict[str, float]:
    """The counts once `total` requests of `model` are counted and nothing runs any more."""
    deadline = time.monotonic() + timeout
    while sum(requests_by_status(worker, model).values()) < total or worker.metric("loraplex_num_requests_running"):
        assert time.monotonic() < deadline, f"not settled: {requests_by_status(worker, model)}"
        time.sleep(0.1)
    return requests_by_status(worker, model)


@pytest.fixture
def served(worker, make_adapter):
    path = make_adapter(r=4, target_modules=("q_proj",), seed=41)
    response = httpx.post(f"{worker.url}/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(path)},
                          timeout=60)
    assert response.status_code == 200, response.text
    yield NAME
    httpx.post(f"{worker.url}/v1/unload_lora_adapter", json={"lora_name": NAME}, timeout=60)


def test_each_request_is_counted_once_with_how_it_ended(worker, served):
    long = {"model": served, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=worker.url, timeout=120) as client:
        # A stream that runs to its end.
        with client.stream("POST", "/v1/completions", json={**long, "max_tokens": 4, "stream": True}) as response:
            assert response.status_code == 200
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
        assert settled(worker, served, 1) == {"ok": 1}

        # A stream the client leaves after a few events.
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
        assert settled(worker, served, 2) == {"ok": 1, "aborted": 1}

        # A whole reply the client stops waiting for.
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=long, timeout=1.0)
        assert settled(worker, served, 3) == {"ok": 1, "aborted": 2}

        # Refused before admission: more tokens than the context holds, a field this worker cannot do.
        assert client.post("/v1/completions", json={**long, "max_tokens": 4096}).status_code == 400
        assert client.post("/v1/chat/completions", json={
            "model": served, "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True,
        }).status_code == 400
        assert settled(worker, served, 5) == {"ok": 1, "aborted": 2, "bad_request": 2}

    # Only the three admitted requests counted their prompts.
    assert worker.metric("loraplex_prompt_tokens_total", model=served) == 3 * len(PROMPT)


def test_a_refused_model_is_counted_once_as_not_found(worker):
    model = "outcomes-nowhere"
    response = httpx.post(f"{worker.url}/v1/completions", json={"model": model, "prompt": "Hi", "stream": True},
                          timeout=60)
    assert response.status_code == 404
    assert requests_by_status(worker, model) == {"not_found": 1}
    assert worker.metric("loraplex_prompt_tokens_total", model=model) == 0
