"""Gateway suites on real parts: the web process under uvicorn (a subprocess, on this run's test
database and Redis), serving workers on the tiny model registering themselves in that Redis, and
registry versions whose artifacts live in a storage directory of this run.

The shared web process and worker (`web`, `worker`) live for the session; what a file starts
through `start_web`/`start_worker` stops at the end of that file. Each test makes its own tenants and
adapters (the database is flushed between transactional tests, so ids never repeat in a way the
gateway's 0.5 s caches could confuse: new rows get new ids).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from lora_platform import launcher
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter
from tests import zygote
from tests.conftest import free_port
from tests.engine.server.conftest import WorkerProcess, stop_all

ROOT = Path(__file__).resolve().parents[2]
WORKER_KEY = "gateway-test-worker-key"
STARTUP_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A base model name of this suite's own: its session workers heartbeat into the run's shared
    # Redis under this suite's worker key, and other suites' web processes (other keys) route by
    # base model name, so they must never match these workers.
    return build_tiny_model(tmp_path_factory.mktemp("gateway-base") / "gw-tiny-llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three PEFT adapters on the tiny base (different weights, so different replies)."""
    root = tmp_path_factory.mktemp("gateway-adapters")
    return [save_random_peft_adapter(tiny_model, root / f"adapter-{seed}", r=8, lora_alpha=16,
                                     target_modules=("q_proj", "v_proj"), seed=seed, init_scale=0.5)
            for seed in (11, 12, 13)]


@pytest.fixture(scope="session")
def storage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-storage")


def _database_url() -> str:
    from django.db import connection

    database = connection.settings_dict
    if database["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{database['NAME']}"
    user = database.get("USER") or ""
    password = f":{database['PASSWORD']}" if database.get("PASSWORD") else ""
    return (f"postgres://{user}{password}@{database.get('HOST') or '127.0.0.1'}:{database.get('PORT') or 5432}/"
            f"{database['NAME']}")


class WebProcess:
    """The web process as `make up` starts it (lora_platform.launcher.web_argv) on a free port, its
    output in a log file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._stopping = False
        self._log = open(log_path, "wb")
        self.process = zygote.popen(
            self.command(),
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            # No prewarm loop unless a test asks for one: every suite's web processes share CI's Redis,
            # and one of them taking the round's lock (and prefetching into other suites' workers)
            # would change what another test sees.
            env={**os.environ, "GATEWAY_PREWARM_INTERVAL_SECONDS": "0", **env})

    def command(self) -> list[str]:
        # Production's command line (make up, compose, the image), guarded HTTP protocol included, so
        # every suite's requests go through what serves them there.
        return launcher.web_argv("127.0.0.1", self.port)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"web process exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/metrics", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"web process not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def stop_begin(self) -> None:
        """SIGTERM, once (`stop` waits): a fixture's processes are all told before any is waited for."""
        if self.process.poll() is None and not self._stopping:
            self.process.terminate()
            self._stopping = True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.stop_begin()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="session")
def gateway_env(django_db_setup, django_db_blocker, tiny_model: Path, storage_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every web process of the session (the test database, Redis, storage)."""
    from django.conf import settings

    with django_db_blocker.unblock():
        database_url = _database_url()
    return {
        "DATABASE_URL": database_url,
        "REDIS_URL": settings.REDIS_URL,
        "STORAGE_URL": f"file://{storage_dir}",
        "SERVING_WORKER_API_KEY": WORKER_KEY,
        "BASE_MODEL_PATH": str(tiny_model),
        "BASE_MODEL_NAME": tiny_model.name,
        "BASE_MODEL_ALIASES": "",
        "LORAPLEX_VAR_DIR": str(tmp_path_factory.mktemp("gateway-var")),
        "DJANGO_DEBUG": "0",
        "GATEWAY_USAGE_FLUSH_SECONDS": "0.2",
        # The product's 0.25 s bound on a hot-path Redis call is for a server whose Redis answers in
        # a millisecond; on the suite's loaded 2-core machine a call now and then takes longer, and
        # the web process then rightly serves from process-local breakers and buckets for a second,
        # which a test of something else reads as a wrong answer (seen in fresh-clone runs: an open
        # breaker read as closed). The tests of the outage itself set the product's bound again.
        "GATEWAY_REDIS_TIMEOUT": "2",
    }


@contextlib.contextmanager
def _web_processes(gateway_env: dict[str, str], logs: Path) -> Iterator[Callable[..., WebProcess]]:
    """`start(**env)` → a ready web process; every one started is stopped on leaving."""
    started: list[WebProcess] = []

    def start(**env: str) -> WebProcess:
        web = WebProcess({**gateway_env, **env}, logs / f"web-{len(started)}.log")
        started.append(web)
        web.wait_ready()
        return web

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def start_web(gateway_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Callable[..., WebProcess]]:
    """`start(**env)` → a ready web process, stopped at the end of the test file that started it.

    Not at the end of the session: under xdist a worker runs other files next, and a web process
    left running goes on flushing the usage queue and reading the breakers of that worker's Redis
    (tests/registry/test_usage_redis_outage.py saw its queued record taken), and holds memory and
    CPU that the rest of the run needs."""
    with _web_processes(gateway_env, tmp_path_factory.mktemp("web-logs")) as start:
        yield start


@pytest.fixture(scope="session")
def web(gateway_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebProcess]:
    """The web process the suite's files share (its start-up paid once per xdist worker)."""
    with _web_processes(gateway_env, tmp_path_factory.mktemp("web-logs")) as start:
        yield start()


@contextlib.contextmanager
def _worker_processes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[Callable[..., WorkerProcess]]:
    """`start(worker_id, *args)` → a ready serving worker registered in Redis with the shared key
    (`wait=False`: started, not waited for, so that several come up at once); every one started is
    stopped on leaving."""
    from django.conf import settings

    started: list[WorkerProcess] = []
    logs = tmp_path_factory.mktemp("gateway-worker-logs")

    def start(worker_id: str, *args: str, wait: bool = True) -> WorkerProcess:
        worker = WorkerProcess(tiny_model, [
            "--served-model-name", tiny_model.name, "--redis-url", settings.REDIS_URL, "--worker-id", worker_id,
            "--heartbeat-interval", "0.5", "--api-key", WORKER_KEY, "--max-loras", "2", "--max-lora-rank", "16",
            # Each test's storage is a directory under the session's (the `registry` fixture).
            "--allowed-adapter-path", str(tmp_path_factory.getbasetemp()),
            *args], logs / f"{worker_id}.log")
        started.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def start_worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., WorkerProcess]]:
    """`start(worker_id, *args)` → a ready serving worker, stopped at the end of the test file that
    started it (as `start_web`'s processes: its heartbeats must not outlive the file)."""
    with _worker_processes(tiny_model, tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="session")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """The serving worker the suite's files share."""
    with _worker_processes(tiny_model, tmp_path_factory) as start:
        yield start("gw-worker-1")


@pytest.fixture
def registry(settings, tmp_path: Path, tiny_model: Path, redis_client) -> None:
    """This process's settings as the web process has them; uploads land in a directory of the
    test, which workers read through the versions' file:// URIs."""
    from serving.gateway import catalog

    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.BASE_MODEL_PATH = tiny_model
    settings.BASE_MODEL_NAME = tiny_model.name
    settings.BASE_MODEL_ALIASES = []
    settings.MAX_LORA_RANK = 64
    catalog.caches_clear()


def upload_version(adapter, directory: Path, version: str):
    from serving.registry import services

    files = [SimpleUploadedFile(name, (directory / name).read_bytes())
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    return services.adapter_version_upload(adapter=adapter, files=files, actor="test", version=version)


def wait_for_worker(redis_client, worker_id: str, timeout: float = 30.0) -> None:
    """Until the worker's registration is back and says ready, the one state the gateway routes to
    (tests flush Redis; heartbeats every 0.5 s; a worker still starting registers as loading)."""
    import json

    from serving.contracts.registry import worker_key

    deadline = time.monotonic() + timeout
    while True:
        raw = redis_client.get(worker_key(worker_id))
        if raw is not None and json.loads(raw).get("state") == "ready":
            return
        assert time.monotonic() < deadline, f"worker {worker_id} is not registered as ready in Redis: {raw!r}"
        time.sleep(0.1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report carries the logs of the processes it used."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, (WorkerProcess, WebProcess)):
                report.sections.append((f"log ({name})", value.log()))
