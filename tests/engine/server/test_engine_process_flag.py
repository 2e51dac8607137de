"""The worker's --engine-process: the engine core in a child process of the worker.

The shared worker (the engine on a thread) is the reference: a worker started with the flag answers
/v1/completions with the same text, streamed and whole, base and adapter. Its engine child is a real
process: killing it fails the worker (503 naming why, /readyz says so), and a drained worker leaves
no process behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from serving.engine import SamplingParams
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import Worker, uses_engine_process
from tests.engine.server.conftest import LONG_TOKENS

PROMPTS = ["The quick brown fox", "Once upon a time"]


def _engine_children(pid: int) -> list[psutil.Process]:
    """The worker's spawned children (the engine core; not multiprocessing's resource tracker)."""
    return [child for child in psutil.Process(pid).children() if "spawn_main" in " ".join(child.cmdline())]


def _text(url: str, model: str, prompt: str, stream: bool) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return str(answer.json()["choices"][0]["text"])
    parts: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [choice["text"] for choice in json.loads(line[len("data: "):])["choices"]]
    return "".join(parts)


def test_the_same_text_as_the_thread_engine_and_no_process_left(
        worker: Any, start_worker: Callable[..., Any], adapters: dict[str, Path]) -> None:
    flagged = start_worker("--engine-process", "--lora-modules", f"alpha={adapters['alpha']}",
                           "--max-loras", "2", "--max-lora-rank", "16", "--served-model-name", "tiny-base")
    children = _engine_children(flagged.process.pid)
    assert len(children) == 1, "one engine-core process"
    for model in ("tiny-base", "alpha"):
        for prompt in PROMPTS:
            for stream in (False, True):
                want = _text(worker.url, model, prompt, stream)
                assert _text(flagged.url, model, prompt, stream) == want, (model, prompt, stream)
    assert flagged.stop() == 0
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)


def test_a_killed_engine_process_fails_the_worker(start_worker: Callable[..., Any]) -> None:
    flagged = start_worker("--engine-process", "--served-model-name", "tiny-base")
    (child,) = _engine_children(flagged.process.pid)
    child.kill()
    deadline = time.monotonic() + 60
    while (ready := httpx.get(f"{flagged.url}/readyz", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, flagged.log()
        time.sleep(0.1)
    assert "engine-core process exited" in ready.json()["checks"]["engine"]["error"]
    body = {"model": "tiny-base", "prompt": "Hello", "max_tokens": 3}
    failed = httpx.post(f"{flagged.url}/v1/completions", json=body, timeout=60)
    assert failed.status_code == 503 and "engine-core process exited" in failed.json()["error"]["message"]
    assert flagged.process.poll() is None, "the worker stays up to say why (/healthz, /readyz)"


def test_the_flag_is_on_by_default_for_one_cuda_device_only(tiny_model: Path) -> None:
    assert parse_args(["--model", str(tiny_model)]).engine_process is None
    assert parse_args(["--model", str(tiny_model), "--engine-process"]).engine_process is True
    assert parse_args(["--model", str(tiny_model), "--no-engine-process"]).engine_process is False
    assert uses_engine_process(None, "cuda", 1) is True
    assert uses_engine_process(None, "cpu", 1) is False
    assert uses_engine_process(None, "cuda", 2) is False
    assert uses_engine_process(False, "cuda", 1) is False
    assert uses_engine_process(True, "cpu", 1) is True
    assert Worker(parse_args(["--model", str(tiny_model), "--device", "cpu"])).engine_process is False


def test_streams_that_start_beside_running_ones_keep_their_chunks_and_usage(
        start_worker: Callable[..., Any], offline: Any) -> None:
    """Under --engine-process a step's first tokens cross the pipe in a message ahead of the step's
    other outputs (EngineCore, LLMEngine.step's on_first_outputs). Streams started while another
    decodes, so their first tokens share steps with its later ones: each streamed request's tokens,
    text, finish reason and usage are the offline API's; an n=2 stream's are its own whole answer's."""
    flagged = start_worker("--engine-process", "--served-model-name", "tiny-base")
    url = flagged.url

    def stream(body: dict[str, Any]) -> tuple[dict[int, list[int]], dict[int, str], dict[int, str], dict[str, int]]:
        ids: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        usage: dict[str, int] = {}
        request = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    if choice["finish_reason"] is not None:
                        assert choice["index"] not in finish, "one finish reason a choice"
                        finish[choice["index"]] = choice["finish_reason"]
        return ids, texts, finish, usage

    greedy = [("The quick brown fox", 12), ("Once upon a time", 1), ("Hello! How are you today?", 9)]
    sampled = {"model": "tiny-base", "prompt": "A story:", "max_tokens": 7, "temperature": 1.0, "seed": 5, "n": 2,
               "ignore_eos": True}
    long_body = {"model": "tiny-base", "prompt": "In the beginning", "max_tokens": LONG_TOKENS, "temperature": 0,
                 "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(4) as pool, \
            httpx.stream("POST", f"{url}/v1/completions", json=long_body, timeout=120) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the engine is decoding
        started = [pool.submit(stream, {"model": "tiny-base", "prompt": prompt, "max_tokens": tokens,
                                        "temperature": 0, "ignore_eos": True}) for prompt, tokens in greedy]
        started_n = pool.submit(stream, sampled)
        results = [job.result() for job in started]
        n_result = started_n.result()
        chunk = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        assert chunk["choices"][0]["finish_reason"] is None, "the long stream decoded beside them all along"
    for (prompt, tokens), (ids, texts, finish, usage) in zip(greedy, results):
        (want,) = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        assert (ids, texts, finish) == ({0: want.outputs[0].token_ids}, {0: want.outputs[0].text}, {0: "length"})
        prompt_tokens = len(want.prompt_token_ids)
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            prompt_tokens, tokens, prompt_tokens + tokens)
    ids, texts, finish, usage = n_result
    whole = httpx.post(f"{url}/v1/completions", json={**sampled, "return_token_ids": True}, timeout=120).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert ids == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert finish == {0: "length", 1: "length"} and usage == whole["usage"]
    assert usage["completion_tokens"] == 14
