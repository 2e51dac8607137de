"""A worker at --tensor-parallel-size 2 (two processes over gloo, on the CPU) registers as one worker
whose Redis entry carries its size, and serves. When its other rank dies, the next request fails
naming the rank (503, engine_dead), the worker turns failed in its registration at once, so the
gateway's routing leaves it out, and /readyz answers 503 with the reason; nothing hangs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config
from serving.gateway.routing import live_workers
from serving.contracts.registry import WORKERS_KEY, worker_key

WORKER_ID = "tp-test-worker"

def _entry(redis_client: Any) -> dict[str, Any]:
    raw = redis_client.get(worker_key(WORKER_ID))
    assert raw is not None, "the worker is registered"
    return dict(json.loads(raw))


def test_the_flag_reaches_the_engine_and_a_size_below_one_is_refused(
        tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_config(parse_args(["--model", str(tiny_model), "-tp", "2"])).tensor_parallel_size == 2
    assert engine_config(parse_args(["--model", str(tiny_model)])).tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_model), "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.django_db(transaction=True)
def test_tp_worker_is_one_worker_and_fails_cleanly_when_a_rank_dies(
        settings: Any, redis_client: Any, start_worker: Callable[..., Any], tiny_model: Path) -> None:
    worker = start_worker("--tensor-parallel-size", "2", "--device", "cpu", "--redis-url", settings.REDIS_URL,
                          "--worker-id", WORKER_ID, "--heartbeat-interval", "0.5",
                          "--served-model-name", tiny_model.name)  # fmt: skip
    body = {"model": tiny_model.name, "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}
    answer = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text

    deadline = time.monotonic() + 30
    while (entry := _entry(redis_client))["state"] != "ready":
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.1)
    assert entry["tensor_parallel_size"] == 2
    # Other files' workers on this test process register here too (tests flush Redis, their heartbeats
    # put them back): no entry but this worker's may point at it.
    others = [json.loads(redis_client.get(worker_key(member.decode())) or b"{}")
              for member in redis_client.zrange(WORKERS_KEY, 0, -1) if member != WORKER_ID.encode()]
    assert [entry for entry in others if entry.get("url") == worker.url] == [], "its ranks never register"
    assert [view.tensor_parallel_size for view in live_workers([entry], base_models=[tiny_model.name], key_id=None)] == [2]

    ranks = [child for child in psutil.Process(worker.process.pid).children()
             if "serving.engine.distributed.rank_worker" in child.cmdline()]  # fmt: skip
    assert len(ranks) == 1, "one process per rank beyond rank 0"
    ranks[0].kill()  # rank 0 (the worker) reaps it

    failed = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] in ("engine_dead", "failed") and "tensor-parallel rank 1" in error["message"]

    deadline = time.monotonic() + 30
    while (entry := _entry(redis_client))["state"] != "failed":
        assert time.monotonic() < deadline, (entry, worker.log())
        time.sleep(0.1)
    assert live_workers([entry], base_models=[tiny_model.name], key_id=None) == [], "the gateway routes elsewhere"
    ready = httpx.get(f"{worker.url}/readyz", timeout=10)
    assert ready.status_code == 503
    assert "tensor-parallel rank 1 exited" in ready.json()["checks"]["engine"]["error"]
    again = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert again.status_code == 503 and "tensor-parallel rank 1" in again.json()["error"]["message"]
    assert worker.process.poll() is None, "the worker stays up to say why (/healthz, /readyz)"
