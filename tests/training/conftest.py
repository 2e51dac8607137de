"""Fixtures of the training suites: the tiny base model, storage, datasets, and real Celery workers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from serving.engine.tiny import build_tiny_model
from tests import zygote
from training_support import BASE_MODEL_NAME, ROOT, process_env, sdk

if TYPE_CHECKING:  # imported where used: it needs Django, which the GPU machine's test runs lack
    from tests.gateway.conftest import WebProcess


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base") / BASE_MODEL_NAME, arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def wsgi_app() -> Iterator[object]:
    """The platform's WSGI application for in-process SDK clients (training_support.sdk)."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    # As Django's test client does: a request must not close the connection holding the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield WSGIHandler()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def openai_a(platform, wsgi_app, tenant_a):
    return sdk(wsgi_app, tenant_a.key)


@pytest.fixture
def openai_b(platform, wsgi_app, tenant_b):
    return sdk(wsgi_app, tenant_b.key)


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

    def __init__(self, env: dict[str, str], log: Path, queues: list[str] | None = None) -> None:
        self.log = log
        self.handle = log.open("ab")
        # One worker for both queues unless asked (`queues`: the queue and concurrency options to run with).
        queues = queues or ["-Q", "quick,training", "-c", "1"]
        self.process = zygote.popen(
            [sys.executable, "-m", "celery", "-A", "lora_platform", "worker", *queues,
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

    def end(self) -> None:
        """At the end of its test: SIGKILL to the group (`kill`), and its log closed. Not a warm
        shutdown: what a worker does on a clean stop is for test_clean_stop and the launcher's Ctrl-C
        test to check, and at a test's end it only cost time, 3.5-4 s a worker (billiard's pool process
        sleeps 1 s on its way out, then the main process's exit with torch loaded)."""
        self.kill()
        self.handle.close()


@pytest.fixture
def start_worker(transactional_db, tmp_path: Path, settings) -> Iterator[Callable[..., Worker]]:
    """`start_worker(**env)` → a ready worker on the test database with this test's settings
    (`start_worker(queues=[...], **env)`: on those queues, as `Worker` takes them)."""
    workers: list[Worker] = []

    def start(queues: list[str] | None = None, **extra: str) -> Worker:
        worker = Worker(process_env(settings, extra), tmp_path / f"worker-{len(workers)}.log", queues)
        workers.append(worker)
        worker.wait_ready()
        return worker

    purge_queues()
    yield start
    for worker in workers:
        worker.end()
    purge_queues()


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A `redis-server` of the test's own on a free port, which the test may stop, freeze and restart
    (never the machine's Redis). No persistence: a restart starts it empty, as a lost broker would."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = unused_port()
        self.process: subprocess.Popen | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
            stdout=(self.directory / "redis.log").open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert self.process.poll() is None, (self.directory / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def freeze(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing is answered."""
        os.kill(self.process.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if self.frozen:
            self.thaw()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    try:  # a server that failed to come up is stopped too
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def start_web(transactional_db, tmp_path: Path, settings) -> Iterator[Callable[..., WebProcess]]:
    """`start_web(**env)` → a ready web process (the gateway suite's) on the test database with this
    test's settings."""
    from tests.gateway.conftest import WebProcess

    processes: list[WebProcess] = []

    def start(**extra: str) -> WebProcess:
        web = WebProcess(process_env(settings, extra), tmp_path / f"web-{len(processes)}.log")
        processes.append(web)
        web.wait_ready()
        return web

    yield start
    for web in processes:
        web.stop()
