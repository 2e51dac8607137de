"""Serving-worker suites: a tiny base model, PEFT adapters on it, real worker processes on
127.0.0.1 (`python -m serving.engine.server`), and the offline API as the oracle.

One worker (`worker`) serves most tests of the session; tests that stop or overload a worker start
their own through `start_worker`. Every test names its own adapters, so none depends on another's
leftovers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import httpx
import pytest
import uvicorn

from serving.engine.server.cli import ServerArgs
from serving.engine.server.serve import uvicorn_config
from serving.engine.server.worker import Worker
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter
from tests import zygote
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 180.0
MAX_LORAS = 2
MAX_CPU_LORAS = 3
# A context long enough for streams that outlive the checks made while they run.
LONG_TOKENS = 1500


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("worker-base") / "tiny-llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def make_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(r=8, target_modules=(…), seed=0)` → a PEFT-saved adapter directory (cached)."""
    built: dict[tuple, Path] = {}
    counter = itertools.count()

    def make(*, r: int = 8, lora_alpha: float = 16, target_modules: Sequence[str] = ("q_proj", "v_proj"),
             seed: int = 0) -> Path:
        key = (r, lora_alpha, tuple(target_modules), seed)
        if key not in built:
            out = tmp_path_factory.mktemp("worker-adapters") / f"adapter-{next(counter)}"
            built[key] = save_random_peft_adapter(
                tiny_model, out, r=r, lora_alpha=lora_alpha, target_modules=target_modules, seed=seed,
                init_scale=0.5,
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def adapters(make_adapter: Callable[..., Path]) -> dict[str, Path]:
    """Three adapters of different ranks and target modules, loaded by the shared worker at start."""
    return {
        "alpha": make_adapter(r=4, target_modules=("q_proj", "v_proj"), seed=1),
        "beta": make_adapter(r=16, lora_alpha=8, target_modules=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=2),
        "gamma": make_adapter(r=8, lora_alpha=32, target_modules=("gate_proj", "up_proj", "down_proj"), seed=3),
    }


class WorkerProcess:
    """`python -m serving.engine.server` on a free port, its output in a log file."""

    def __init__(self, model: Path, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_before_ready: list[tuple[int, str]] = []
        self._stopping = False
        command = [sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port", str(self.port),
                   "--max-model-len", "2048", "--num-gpu-blocks-override", "512", *args]
        self._log = open(log_path, "wb")
        self.process = zygote.popen(command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})})

    def wait_ready(self) -> None:
        """Poll /health until 200, keeping what it answered before."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if response.status_code == 200:
                return
            self.health_before_ready.append((response.status_code, response.json()["status"]))
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop_begin(self) -> None:
        """SIGTERM, once (`stop` waits): a fixture's processes are all told before any is waited for."""
        if self.process.poll() is None and not self._stopping:
            self.process.send_signal(signal.SIGTERM)
            self._stopping = True

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.stop_begin()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
        pattern = "^" + re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)$"
        match = re.search(pattern, text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


@contextlib.contextmanager
def _worker_processes(tiny_model: Path, logs: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """`start(*args, env=None)` → a ready worker; every one started is stopped on leaving."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> WorkerProcess:
        worker = WorkerProcess(tiny_model, args, logs / f"worker-{len(started)}.log", env)
        started.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    try:
        yield start
    finally:
        stop_all(started)


class Stoppable(Protocol):
    def stop_begin(self) -> None: ...

    def stop(self) -> object: ...


def stop_all(processes: Sequence[Stoppable]) -> None:
    """Stops every process: all are told first, so their shutdowns overlap instead of following
    one another."""
    for process in processes:
        process.stop_begin()
    for process in processes:
        process.stop()


@pytest.fixture(scope="module")
def start_worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., WorkerProcess]]:
    """`start(*args, env=None)` → a ready worker, stopped at the end of the test file that started
    it: under xdist a worker runs other files next, which need the memory and CPU, and whose Redis a
    registered worker would go on heartbeating into."""
    with _worker_processes(tiny_model, tmp_path_factory.mktemp("worker-logs")) as start:
        yield start


@pytest.fixture(scope="session")
def worker(tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[WorkerProcess]:
    """The shared worker, open (no key): alpha and beta loaded at start, 2 GPU slots over 3 CPU
    cache entries; adapters may be loaded from anywhere under the session's temporary directory."""
    with _worker_processes(tiny_model, tmp_path_factory.mktemp("worker-logs")) as start:
        yield start(
            "--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}",
            "--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(MAX_CPU_LORAS), "--max-lora-rank", "16",
            "--served-model-name", "tiny-base", "--allowed-adapter-path", str(tmp_path_factory.getbasetemp()),
        )


@contextlib.contextmanager
def serve_in_process(args: ServerArgs) -> Iterator[tuple[Worker, str]]:
    """A worker's real app under uvicorn on a thread of this process, ready: `(worker, url)`.

    For tests that reach into the engine while HTTP requests run on it (write into a GPU slot as
    a stray kernel would, corrupt a sequence's state so the real step fails), which a worker
    process does not allow, and that need real streaming, which Starlette's test client lacks.
    The worker is told its port, so a registration in Redis (`redis_url`) advertises where it is."""
    port = free_port()
    worker = Worker(dataclasses.replace(args, port=port))
    server = uvicorn.Server(uvicorn_config(worker, dataclasses.replace(worker.args, host="127.0.0.1",
                                                                        uvicorn_log_level="warning")))
    worker.request_stop = lambda: setattr(server, "should_exit", True)
    thread = threading.Thread(target=server.run, name="in-process-worker", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process worker did not start"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield worker, url
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="session")
def offline(tiny_model: Path):
    """The offline API on the same model: what the worker must generate, token for token."""
    from serving.engine import LLM

    return LLM(str(tiny_model), max_loras=MAX_LORAS, max_cpu_loras=4, max_lora_rank=16, max_model_len=2048,
               num_kv_blocks=512)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report carries the log of every worker it used."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, WorkerProcess):
                report.sections.append((f"worker log ({name})", value.log()))
