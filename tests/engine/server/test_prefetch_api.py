"""`POST /v1/prefetch_lora_adapters` (docs/resilience.md, "Predictive prewarm") on the worker's real
app: it answers once the slot placements are done, reads the CPU-only versions after the answer, and
a newer call supersedes what an older one had not read yet.

The worker runs in this process (its real app and lifespan, over Starlette's test client), so the
test can hold the engine's storage reads as a slow object store would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serving.contracts.artifact import adapter_digest
from serving.engine.server.app import build_app
from serving.engine.server.cli import ServerArgs
from serving.engine.server.worker import Worker

KEY = "operator-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _wait(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_cpu_only_versions_are_read_after_the_answer_until_a_newer_call(
    tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    directories = [make_adapter(seed=70 + i) for i in range(5)]
    names = [f"acme/bot-{i}@1.0.0" for i in range(5)]
    args = ServerArgs(model=str(tiny_model), device="cpu", api_key=KEY, max_loras=1, max_cpu_loras=8,
                      max_lora_rank=16, max_model_len=256, num_gpu_blocks_override=128, slot_verify_interval=0,
                      allowed_adapter_path=sorted({str(d.parent) for d in directories}))
    worker = Worker(args)

    def entry(i: int, to_gpu: bool) -> dict[str, Any]:
        return {"lora_name": names[i], "artifact_uri": str(directories[i]),
                "manifest_sha256": adapter_digest(directories[i]), "to_gpu": to_gpu}

    with TestClient(build_app(worker)) as client:
        _wait(lambda: client.get("/health").status_code == 200, "the worker to be ready")
        assert worker.engine is not None
        engine = worker.engine.engine
        cache = engine.lora_cache
        assert cache is not None
        read, gate, held = cache.load_fn, threading.Event(), threading.Event()

        def slow_storage(path: str, *a: Any, **kw: Any) -> Any:  # a loader thread
            if Path(path).name == directories[2].name:  # this one answers when the test says
                held.set()
                gate.wait(60)
            return read(path, *a, **kw)

        cache.load_fn = slow_storage

        def loaded() -> set[str]:
            return {info.name for info in engine.list_loras()}

        # The slot part is read and placed before the answer; the CPU-only ones are queued, and the
        # answer comes while one of them is still being read.
        first = client.post("/v1/prefetch_lora_adapters", headers=AUTH,
                            json={"adapters": [entry(0, True), entry(1, False), entry(2, False), entry(3, False)]})
        assert first.status_code == 200, first.text
        assert [(e["gpu"], e["queued"]) for e in first.json()["data"]] == [
            (True, False), (False, True), (False, True), (False, True)]
        _wait(held.is_set, "the CPU-only reads, most wanted first")
        assert names[1] in loaded() and names[2] not in loaded()
        # A newer call: what the older one has not started reading is given up for this one's.
        second = client.post("/v1/prefetch_lora_adapters", headers=AUTH, json={"adapters": [entry(4, False)]})
        assert second.status_code == 200, second.text
        gate.set()
        _wait(lambda: {names[2], names[4]} <= loaded(), "the read under way and the newer call's")
        time.sleep(1.0)  # the older call's loop has long had its turn (a read here takes milliseconds)
        assert names[3] not in loaded()
        assert engine.stats().gpu_slots == (names[0],)
