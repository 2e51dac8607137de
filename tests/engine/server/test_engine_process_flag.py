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
from pathlib import Path
from typing import Any

import httpx
import psutil

from serving.engine.server.cli import parse_args
from serving.engine.server.worker import Worker, uses_engine_process

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
