"""The web process's probes on real parts: PostgreSQL (the test database), Redis (the worker's database,
or a closed port for one that is away), moto S3 for the storage, a real serving worker registered in
Redis and a real Celery worker. `/healthz` touches none of them; `/readyz` names what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.engine.tiny import build_tiny_model
from serving.registry.storage import get_storage
from tests import zygote
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER_ID = "readyz-test-worker"
REQUIRED = {"database", "redis", "storage", "serving_workers"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("readyz-base") / "tiny-llama", arch="llama", size="tiny", seed=0)


@pytest.fixture
def platform(settings, s3_bucket: str, moto_s3_endpoint: str, tiny_model: Path, redis_client) -> None:
    """Storage on moto S3, the tiny base model, an empty worker registry in this worker's Redis database."""
    settings.STORAGE_URL = f"s3://{s3_bucket}/platform"
    settings.S3_ENDPOINT_URL = moto_s3_endpoint
    settings.BASE_MODEL_PATH = tiny_model
    settings.BASE_MODEL_NAME = tiny_model.name
    settings.BASE_MODEL_ALIASES = []


class Process:
    """A platform process started for one test, its output in a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.handle = log.open("wb")
        self.process = zygote.popen(argv, cwd=ROOT, env=dict(os.environ), stdout=self.handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        self.handle.close()


@pytest.fixture
def serving_and_celery_workers(platform, settings, tiny_model: Path, tmp_path: Path) -> Iterator[None]:
    """A serving worker of the base model heartbeating into this test's Redis, and a Celery worker on it."""
    serving = Process([sys.executable, "-m", "serving.engine.server", "--model", str(tiny_model),
                       "--served-model-name", tiny_model.name, "--port", str(free_port()), "--max-model-len", "256",
                       "--num-gpu-blocks-override", "64", "--redis-url", settings.REDIS_URL, "--worker-id", WORKER_ID,
                       "--heartbeat-interval", "1", "--uvicorn-log-level", "warning"], tmp_path / "serving.log")
    celery = Process([sys.executable, "-m", "celery", "-A", "lora_platform", "worker", "-Q", "quick", "-c", "1",
                      "--pool", "solo", "--without-gossip", "--without-mingle", "-l", "INFO",
                      "--hostname", "readyz-test@%h"], tmp_path / "celery.log")
    try:
        yield
    finally:
        serving.stop()
        celery.stop()


def readyz(client) -> tuple[int, dict]:
    response = client.get("/readyz")
    return response.status_code, response.json()


def test_healthz_answers_without_touching_a_dependency(client, settings) -> None:
    """No database access is allowed here (no django_db mark), Redis and storage point nowhere."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.STORAGE_URL = f"s3://nowhere/x"
    settings.S3_ENDPOINT_URL = f"http://127.0.0.1:{free_port()}"
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "alive"}
    assert "no-cache" in response["Cache-Control"]


@pytest.mark.django_db
def test_readyz_is_503_naming_redis_when_redis_is_unreachable(client, settings, platform) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # a closed port: nothing listens there
    status, body = readyz(client)
    assert status == 503 and body["status"] == "not_ready"
    # The worker registry lives in Redis too: without it no worker can be known to be live.
    assert body["failing"] == ["redis", "serving_workers"]
    assert body["checks"]["redis"]["ok"] is False and "Redis does not answer" in body["checks"]["redis"]["error"]
    assert body["checks"]["database"]["ok"] and body["checks"]["storage"]["ok"]
    for check in body["checks"].values():
        assert isinstance(check["seconds"], float) and check["seconds"] >= 0


@pytest.mark.django_db
def test_readyz_is_503_naming_the_workers_when_none_is_live(client, settings, platform) -> None:
    status, body = readyz(client)
    assert status == 503 and body["failing"] == ["serving_workers"]
    error = body["checks"]["serving_workers"]["error"]
    assert f"no serving worker of {settings.BASE_MODEL_NAME} is live" in error
    assert {name for name, check in body["checks"].items() if check["ok"]} == {"database", "redis", "storage"}
    # Reported, not required: no Celery worker runs here.
    assert body["checks"]["celery"] == {**body["checks"]["celery"], "ok": False, "required": False}
    assert get_storage().list("health") == []  # the storage probe cleaned up after itself


@pytest.mark.e2e
@pytest.mark.django_db
def test_readyz_is_200_with_everything_up(client, settings, serving_and_celery_workers) -> None:
    deadline = time.monotonic() + 180  # the serving worker loads its model first
    status, body = readyz(client)
    while (status != 200 or not body["checks"]["celery"]["ok"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        status, body = readyz(client)
    assert status == 200, body
    assert body["status"] == "ready" and body["failing"] == []
    assert {name for name, check in body["checks"].items() if check["required"]} == REQUIRED
    assert all(check["ok"] for check in body["checks"].values()), body
    assert body["checks"]["serving_workers"]["detail"] == f"1 live: {WORKER_ID}"
    assert "readyz-test@" in body["checks"]["celery"]["detail"]
    print("readyz check durations (s):", {name: check["seconds"] for name, check in body["checks"].items()})
