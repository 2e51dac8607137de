"""Fixtures of the training suites: the tiny base model, storage, datasets, and real Celery workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from serving.engine.tiny import build_tiny_model
from training_support import BASE_MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base") / BASE_MODEL_NAME, arch="llama", size="tiny", seed=0)


@pytest.fixture
def platform(settings, base_model_dir: Path, tmp_path: Path) -> Path:
    """The platform's base model and a fresh local storage for this test; the storage root."""
    settings.BASE_MODEL_PATH = base_model_dir
    settings.BASE_MODEL_NAME = BASE_MODEL_NAME
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.S3_ENDPOINT_URL = None
    return tmp_path / "storage"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """In-process training with one OpenMP thread (see OMP_NUM_THREADS for workers below)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def database_url() -> str:
    """The URL of the test database this process uses, for worker subprocesses."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    credentials = quote(db["USER"] or "", safe="") + (f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else "")
    return f"postgres://{credentials}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def purge_queues() -> None:
    """Drops every waiting and unacknowledged task, so a worker never runs another test's leftovers."""
    from lora_platform.celery import app

    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for queue in ("quick", "training"):
            channel.queue_purge(queue)
        client = channel.client
        client.delete("unacked", "unacked_index", "unacked_mutex")


class Worker:
    """A real `celery worker` process (its own process group, so SIGKILL takes its pool too)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.handle = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "lora_platform", "worker", "-Q", "quick,training", "-c", "1",
             "--pool", "prefork", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=ROOT, env=env, stdout=self.handle, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"celery worker exited with {self.process.returncode}:\n{self.output()}")
            if " ready." in self.output():
                return
            time.sleep(0.2)
        raise TimeoutError(f"celery worker not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the whole process group: the worker and its pool child die at once."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.handle.close()


@pytest.fixture
def start_worker(transactional_db, tmp_path: Path, settings) -> Iterator[Callable[..., Worker]]:
    """`start_worker(**env)` → a ready worker on the test database with this test's settings."""
    workers: list[Worker] = []

    def start(**extra: str) -> Worker:
        env = dict(os.environ)
        env.update({
            "DJANGO_SETTINGS_MODULE": "lora_platform.settings",
            "DATABASE_URL": database_url(),
            "STORAGE_URL": settings.STORAGE_URL,
            "BASE_MODEL_PATH": str(settings.BASE_MODEL_PATH),
            "BASE_MODEL_NAME": settings.BASE_MODEL_NAME,
            "LOG_LEVEL": "INFO",
            # One compute thread: on a shared 2-core machine, OpenMP threads spinning against other
            # processes make a tiny model's step 10-20x slower.
            "OMP_NUM_THREADS": "1",
            **({"S3_ENDPOINT_URL": settings.S3_ENDPOINT_URL} if settings.S3_ENDPOINT_URL else {}),
        })
        env.update({key: str(value) for key, value in extra.items()})
        worker = Worker(env, tmp_path / f"worker-{len(workers)}.log")
        workers.append(worker)
        worker.wait_ready()
        return worker

    purge_queues()
    yield start
    for worker in workers:
        worker.stop()
    purge_queues()
