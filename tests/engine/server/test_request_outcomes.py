"""Each generation request is counted once in loraplex_requests_total, with the status of how it
ended (a finished stream, a client leaving mid-stream or mid-reply, a refused request, an engine
step failing under a stream), and only admitted requests count their prompt tokens. The requests go to an adapter name of this test's
own, so the counts it reads are its requests' alone."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from serving.engine.server.cli import LoRAModule, ServerArgs
from tests.engine.server.conftest import LONG_TOKENS, serve_in_process

NAME = "outcomes"
PROMPT = [1, 45, 99, 173, 201, 32]  # token ids: their number is the prompt's length


def requests_by_status(url: str, model: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r'^loraplex_requests_total\{model="' + re.escape(model) + r'",status="([a-z_]+)"\} (\S+)$'
    return {status: float(value) for status, value in re.findall(pattern, text, re.MULTILINE) if float(value)}


def running(url: str) -> float:
    match = re.search(r"^loraplex_num_requests_running (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def settled(url: str, model: str, total: float, timeout: float = 60.0) -> dict[str, float]:
    """The counts once `total` requests of `model` are counted and nothing runs any more."""
    deadline = time.monotonic() + timeout
    while sum(requests_by_status(url, model).values()) < total or running(url):
        assert time.monotonic() < deadline, f"not settled: {requests_by_status(url, model)}"
        time.sleep(0.1)
    return requests_by_status(url, model)


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
        assert settled(worker.url, served, 1) == {"ok": 1}

        # A stream the client leaves after a few events.
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
        assert settled(worker.url, served, 2) == {"ok": 1, "aborted": 1}

        # A whole reply the client stops waiting for.
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=long, timeout=1.0)
        assert settled(worker.url, served, 3) == {"ok": 1, "aborted": 2}

        # Refused before admission: more tokens than the context holds, a field this worker cannot do.
        assert client.post("/v1/completions", json={**long, "max_tokens": 4096}).status_code == 400
        assert client.post("/v1/completions", json={**long, "suffix": "!", "stream": True}).status_code == 400
        assert settled(worker.url, served, 5) == {"ok": 1, "aborted": 2, "bad_request": 2}

    # Only the three admitted requests counted their prompts.
    assert worker.metric("loraplex_prompt_tokens_total", model=served) == 3 * len(PROMPT)


def test_a_refused_model_is_counted_once_as_not_found(worker):
    model = "outcomes-nowhere"
    response = httpx.post(f"{worker.url}/v1/completions", json={"model": model, "prompt": "Hi", "stream": True},
                          timeout=60)
    assert response.status_code == 404
    assert requests_by_status(worker.url, model) == {"not_found": 1}
    assert worker.metric("loraplex_prompt_tokens_total", model=model) == 0


def test_an_engine_step_failing_mid_stream_counts_once_as_error_and_the_worker_serves_on(tiny_model, make_adapter):
    """The engine's real step fails under a running stream: the test gives the stream's sequence
    a GPU slot index past the last slot (state a bug could leave), so the next step's LoRA lookup
    raises. The engine fails that step's requests and keeps running (AsyncEngine._run): the stream
    ends with an error event and `[DONE]`, counts once as `error`, and the worker stays ready."""
    path = make_adapter(r=4, target_modules=("q_proj",), seed=42)
    args = ServerArgs(model=str(tiny_model), device="cpu", lora_modules=[LoRAModule(NAME, str(path))], max_loras=2,
                      max_lora_rank=16, max_model_len=2048, num_gpu_blocks_override=512, slot_verify_interval=0)
    long = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
    with serve_in_process(args) as (worker, url), httpx.Client(base_url=url, timeout=120) as client:
        engine = worker.engine.engine
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line)
            next(lines)  # the stream is under way: its first event has been sent
            (seq,) = engine.scheduler.running
            seq.lora_slot = args.max_loras + 7
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "engine step failed" in error["message"], error
        assert settled(url, NAME, 1) == {"error": 1}

        assert client.get("/health").status_code == 200
        reply = client.post("/v1/completions", json={**long, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert settled(url, NAME, 2) == {"error": 1, "ok": 1}
        assert engine.stats().kv_blocks_used == 0
