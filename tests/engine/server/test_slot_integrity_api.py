"""Slot integrity through the worker (docs/resilience.md, "Slot integrity"): a slot corrupted in
place is found by `POST /v1/verify_lora_slots` (behind the worker's key), repaired from storage,
shown in /metrics, and counted as one failure on the version's shared circuit breaker.

The worker runs in this process (its real app and lifespan, over Starlette's test client), so the
test can write into a slot tensor as a stray kernel would.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.conf import settings
from fastapi.testclient import TestClient

from serving.engine.server.app import build_app
from serving.engine.server.cli import LoRAModule, ServerArgs
from serving.engine.server.worker import Worker
from tests.conftest import shared_breaker

KEY = "operator-key"
VERSION = "acme/support-bot@1.0.0"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _metric(client: TestClient, name: str) -> float:
    match = re.search("^" + re.escape(name) + r" (\S+)$", client.get("/metrics", headers=AUTH).text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _completion(client: TestClient) -> str:
    body = {"model": VERSION, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert isinstance(text, str)
    return text


def _breaker_failures() -> int:
    return shared_breaker(VERSION).failures


def test_a_corrupted_slot_is_detected_repaired_and_counted_on_the_breaker(
    redis_client: object, tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=61)
    args = ServerArgs(model=str(tiny_model), device="cpu", api_key=KEY, redis_url=settings.REDIS_URL,
                      lora_modules=[LoRAModule(VERSION, str(adapter))], max_loras=2, max_lora_rank=16,
                      max_model_len=256, num_gpu_blocks_override=128, slot_verify_interval=0)
    worker = Worker(args)
    with TestClient(build_app(worker)) as client:
        _wait(lambda: client.get("/health").status_code == 200, "the worker to be ready")
        before = _completion(client)
        assert client.post("/v1/verify_lora_slots", headers=AUTH).json() == {"repaired": []}

        assert worker.engine is not None
        engine = worker.engine.engine
        (info,) = engine.list_loras()
        assert info.gpu_slot is not None and info.gpu_row is not None
        layer = next(iter(engine.runner.model.lora_layers()))
        layer.lora_B[0][info.gpu_row, 0] += 0.5  # a stray write into the slot

        assert client.post("/v1/verify_lora_slots").status_code == 401, "the operator's key is needed"
        reply = client.post("/v1/verify_lora_slots", headers=AUTH)
        assert reply.json() == {"repaired": [{"slot": info.gpu_slot, "digest": info.digest, "names": [VERSION], "stopped": 0}]}
        _wait(lambda: _metric(client, "loraplex_lora_slot_repairs_total") == 1, "the repair")
        assert _metric(client, "loraplex_lora_slot_corruptions_total") == 1
        assert _metric(client, "loraplex_lora_slot_breaker_failures_total") == 1
        assert _breaker_failures() == 1, "the corruption is one failed call of the version, for every gateway"

        assert client.post("/v1/verify_lora_slots", headers=AUTH).json() == {"repaired": []}
        assert _completion(client) == before, "the repaired slot serves what it served before"


def test_the_periodic_check_finds_a_corrupted_slot_by_itself(
    redis_client: object, tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=62)
    args = ServerArgs(model=str(tiny_model), device="cpu", api_key=KEY, lora_modules=[LoRAModule("local", str(adapter))],
                      max_loras=2, max_lora_rank=16, max_model_len=256, num_gpu_blocks_override=128,
                      slot_verify_interval=0.2)
    worker = Worker(args)
    with TestClient(build_app(worker)) as client:
        _wait(lambda: client.get("/health").status_code == 200, "the worker to be ready")
        body = {"model": "local", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        _wait(lambda: _metric(client, "loraplex_lora_slot_checks_total") >= 1, "a periodic check")
        assert _metric(client, "loraplex_lora_slot_corruptions_total") == 0

        assert worker.engine is not None
        engine = worker.engine.engine
        (info,) = engine.list_loras()
        assert info.gpu_slot is not None and info.gpu_row is not None
        next(iter(engine.runner.model.lora_layers())).lora_A[0][info.gpu_row + 1, 2] -= 0.5

        _wait(lambda: _metric(client, "loraplex_lora_slot_repairs_total") == 1, "the periodic check to repair it")
        assert _metric(client, "loraplex_lora_slot_corruptions_total") == 1
        assert _metric(client, "loraplex_lora_slot_breaker_failures_total") == 0, "a local name has no breaker"
