"""The serving worker's probes, on a real worker process and the real registry (Django's live server):
`/healthz` answers whatever the worker's state; `/readyz` is 200 only once the engine runs and the
registry's snapshot is applied, and names what is missing before; `/health` answers as it always did."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "readyz-registry-token"


def probe(worker, path: str) -> tuple[int, dict]:
    response = httpx.get(f"{worker.url}{path}", timeout=10)
    return response.status_code, response.json()


def test_readyz_waits_for_the_engine_and_the_registry_while_healthz_always_answers(
        settings, live_server, start_worker, tiny_model: Path) -> None:
    settings.BASE_MODEL_PATH = tiny_model
    settings.BASE_MODEL_NAME = tiny_model.name
    settings.REGISTRY_TOKEN = "not-the-workers-token"  # the registry refuses the worker's snapshot at first
    worker = start_worker("--registry-url", f"{live_server.url}/api/v1/internal/registry/snapshot",
                          "--registry-token", TOKEN, "--registry-reconcile-interval", "1",
                          "--served-model-name", tiny_model.name, wait=False)
    # Loading: alive, not ready, and /health as before (503 "loading"). Asked in this order, a /health
    # still loading means the two probes before it saw the loading worker too.
    seen_loading = False
    deadline = time.monotonic() + 180
    while True:
        assert time.monotonic() < deadline, worker.log()
        try:
            alive, liveness = probe(worker, "/healthz")
        except httpx.TransportError:
            time.sleep(0.1)  # not listening yet
            continue
        ready, readiness = probe(worker, "/readyz")
        health, _ = probe(worker, "/health")
        assert alive == 200 and liveness["status"] == "alive"
        assert ready == 503 and "adapters" in readiness["failing"]
        if health == 200:
            break
        seen_loading = True
        assert readiness["failing"] == ["engine", "adapters"] and liveness["state"] == "loading"
        assert readiness["checks"]["engine"]["error"] == "the worker is loading"
        time.sleep(0.1)
    print("saw the loading state:", seen_loading)

    # The engine runs; the registry still refuses: not ready, and it says why.
    _, readiness = probe(worker, "/readyz")
    assert readiness["checks"]["engine"] == {"ok": True, "detail": "running"}
    assert readiness["failing"] == ["adapters"]
    assert "snapshot has not been applied" in readiness["checks"]["adapters"]["error"]

    settings.REGISTRY_TOKEN = TOKEN  # the registry lets the worker in: the next reconcile applies it
    deadline = time.monotonic() + 60
    while (ready := probe(worker, "/readyz"))[0] != 200:
        assert time.monotonic() < deadline, (ready, worker.log())
        time.sleep(0.2)
    status, readiness = ready
    assert readiness["status"] == "ready" and readiness["failing"] == []
    assert readiness["checks"]["adapters"]["ok"] and "applied" in readiness["checks"]["adapters"]["detail"]
    assert probe(worker, "/health") == (200, {"status": "ready"})


def test_a_worker_without_a_registry_is_ready_once_its_engine_runs(worker) -> None:
    # The suites' shared worker: it has no --registry-url, and its engine runs once it is started.
    status, readiness = probe(worker, "/readyz")
    assert status == 200, readiness
    assert readiness["checks"]["adapters"] == {"ok": True, "detail": "no --registry-url: nothing to sync"}
