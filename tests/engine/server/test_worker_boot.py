"""What the worker does once its engine is loaded: everything loaded by then is frozen out of the
garbage collector, so a full collection under load walks only what requests leave behind."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from fastapi.testclient import TestClient

from serving.engine.server.app import build_app
from serving.engine.server.cli import ServerArgs
from serving.engine.server.worker import Worker


def test_what_the_boot_loaded_is_frozen_out_of_the_collector(tiny_model: Path) -> None:
    gc.unfreeze()
    worker = Worker(ServerArgs(model=str(tiny_model), device="cpu", max_model_len=128, num_gpu_blocks_override=32,
                               slot_verify_interval=0))  # fmt: skip
    try:
        with TestClient(build_app(worker)) as client:
            deadline = time.monotonic() + 60
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the worker never became ready"
                time.sleep(0.05)
            assert worker.engine is not None
            model = worker.engine.engine.runner.model
            # Tracked, yet in none of the three generations a collection walks: in the frozen one.
            assert gc.get_freeze_count() > 0 and gc.is_tracked(model)
            assert not any(obj is model for obj in gc.get_objects())
            answer = client.post("/v1/completions", json={"model": worker.base_model_id, "prompt": "Hello",
                                                           "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    finally:
        gc.unfreeze()
