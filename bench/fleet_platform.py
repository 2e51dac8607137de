"""bench/fleet.py's platform: registry versions for the trace's adapters, and per routing policy a
fleet of K serving workers behind W web processes, started fresh and stopped after.

The platform is bench/gateway.py's (bench.gateway.embedded_platform: SQLite, the embedded Redis,
local storage, the tiny model, this process's settings). The adapters are tiny rank-8 PEFT
adapters (serving.engine.tiny.save_random_peft_adapter, seeded, kept in a work directory for the
next run), uploaded as version 1.0.0 of an adapter of one of a few tenants and deployed through
the registry's services (serving.registry.services), so the gateway resolves them as any tenant's model.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.gateway import WORKER_KEY, bench_tenant, free_port, wait_up

ROOT = Path(__file__).resolve().parents[1]
VERSION = "1.0.0"


@dataclass(frozen=True)
class Served:
    """One registered adapter as a client names it: the model and its tenant's key."""

    model: str
    key: str


def adapter_files(model: Path, count: int, work: Path) -> list[Path]:
    """`count` tiny rank-8 adapters on `model`, written where missing (seeded: a later run reuses them)."""
    from serving.engine.tiny import save_random_peft_adapter

    directories = []
    for index in range(count):
        directory = work / "adapters" / f"a{index}"
        if not (directory / "adapter_model.safetensors").is_file():
            save_random_peft_adapter(model, directory, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"),
                                     seed=1000 + index)
        directories.append(directory)
    return directories


def register(directories: list[Path], tenants: int, stamp: str) -> list[Served]:
    """Each adapter uploaded and deployed as 1.0.0 of `a<index>` of tenant `index % tenants`."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    from serving.registry import services

    per_tenant = math.ceil(len(directories) / tenants)
    made = [bench_tenant(f"fleet-{stamp}-t{index}", max_adapters=per_tenant) for index in range(tenants)]
    served = []
    for index, directory in enumerate(directories):
        tenant, key = made[index % tenants]
        adapter = services.adapter_create(tenant=tenant, name=f"a{index}")
        files = [SimpleUploadedFile(name, (directory / name).read_bytes())
                 for name in ("adapter_config.json", "adapter_model.safetensors")]
        version = services.adapter_version_upload(adapter=adapter, files=files, actor="bench", version=VERSION)
        services.adapter_version_deploy(version=version, actor="bench")
        served.append(Served(model=adapter.name, key=key))
    return served


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen[bytes]


@dataclass
class Fleet:
    """K workers and W web processes routing by `policy`, each process's output in `logs`."""

    policy: str
    model: Path
    workers: int
    webs: int
    slots: int
    cpu_cache: int
    logs: Path
    rank: int = 8  # --max-lora-rank
    worker_flags: tuple[str, ...] = ()  # more worker flags (bench/noisy_neighbour.py's 8B shape: --load-format dummy …)
    worker_children: list[Child] = field(default_factory=list)
    web_children: list[Child] = field(default_factory=list)

    def worker_ids(self) -> list[str]:
        return [f"fleet-{self.policy}-{index}" for index in range(self.workers)]

    def start(self) -> None:
        from django.conf import settings

        self.logs.mkdir(parents=True, exist_ok=True)
        storage = Path(settings.STORAGE_URL.removeprefix("file://"))
        # One thread each: K workers, W web processes and the client share the machine's cores, and
        # torch's default (a thread per core in every worker) would have them fight over each core.
        worker_env = {**os.environ, "OMP_NUM_THREADS": "1", "LOG_LEVEL": "WARNING"}
        for worker_id in self.worker_ids():
            port = free_port()
            command = [sys.executable, "-m", "serving.engine.server", "--model", str(self.model), "--port", str(port),
                       "--served-model-name", "tiny-llama", "--api-key", WORKER_KEY, "--redis-url", settings.REDIS_URL,
                       "--worker-id", worker_id, "--heartbeat-interval", "1", "--max-loras", str(self.slots),
                       "--max-cpu-loras", str(self.cpu_cache), "--max-lora-rank", str(self.rank),
                       "--allowed-adapter-path", str(storage), "--uvicorn-log-level", "warning", *self.worker_flags]
            self.worker_children.append(self._spawn(worker_id, f"http://127.0.0.1:{port}", command, worker_env))
        metrics_dir = self.logs / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)  # multiprocess mode wants it empty at the start
        metrics_dir.mkdir()
        web_env = {**os.environ, "GATEWAY_ROUTING": self.policy,
                   # Routing alone: no prefetching into the workers' slots behind its back.
                   "GATEWAY_PREWARM_INTERVAL_SECONDS": "0",
                   "GATEWAY_USAGE_FLUSH_SECONDS": "0.2", "GATEWAY_PROCESSES": str(self.webs),
                   # Every web process's /metrics reports all of them (the failover counter).
                   "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        from lora_platform.launcher import web_argv

        for index in range(self.webs):
            port = free_port()
            self.web_children.append(self._spawn(f"web-{self.policy}-{index}", f"http://127.0.0.1:{port}",
                                                 web_argv("127.0.0.1", port), web_env))
        for child in self.worker_children:
            wait_up(f"{child.url}/health", self.logs / f"{child.name}.log")
        for child in self.web_children:
            wait_up(f"{child.url}/metrics", self.logs / f"{child.name}.log")
        # A port taken between free_port() and the child's bind (other programs share the machine)
        # leaves the child dead and another process answering on its port: measure nothing then.
        for child in (*self.worker_children, *self.web_children):
            if child.process.poll() is not None:
                raise SystemExit(f"{child.name} exited with {child.process.returncode} (its port {child.url} answers "
                                 f"for another process?); see {self.logs / (child.name + '.log')}")
        self._wait_registered()

    def _spawn(self, name: str, url: str, command: list[str], env: dict[str, str]) -> Child:
        log = open(self.logs / f"{name}.log", "wb")
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        return Child(name=name, url=url, process=process)

    def _wait_registered(self, timeout_s: float = 60.0) -> None:
        """Until every worker is in the registry's live list, as the gateway reads it."""
        import redis
        from django.conf import settings

        from serving.contracts.registry import worker_key

        client = redis.Redis.from_url(settings.REDIS_URL)
        deadline = time.monotonic() + timeout_s
        try:
            while not all(client.get(worker_key(worker_id)) for worker_id in self.worker_ids()):
                if time.monotonic() > deadline:
                    raise SystemExit(f"workers not registered in Redis after {timeout_s:.0f} s; see {self.logs}")
                time.sleep(0.2)
        finally:
            client.close()

    def web_urls(self) -> list[str]:
        return [child.url for child in self.web_children]

    def worker_url(self, worker_id: str) -> str:
        return next(child.url for child in self.worker_children if child.name == worker_id)

    def kill(self, worker_id: str) -> None:
        """SIGKILL: no deregistration, no draining; its registry entry stays until its TTL (3 s)."""
        child = next(child for child in self.worker_children if child.name == worker_id)
        child.process.send_signal(signal.SIGKILL)
        child.process.wait()

    def stop(self) -> None:
        """Web processes first (their last usage records flushed on the way out), then the workers."""
        for children in (self.web_children, self.worker_children):
            for child in children:
                if child.process.poll() is None:
                    child.process.terminate()
            for child in children:
                try:
                    child.process.wait(30)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
