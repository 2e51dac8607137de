"""The web process as `make up` starts it (the launcher's command line), on this run's test database
and Redis, for tests that speak raw HTTP/1.1 over sockets to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lora_platform import launcher
from tests.conftest import free_port
from tests.gateway.conftest import _database_url

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


class LiveWeb:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            launcher.web_argv("127.0.0.1", self.port), cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "GATEWAY_PREWARM_INTERVAL_SECONDS": "0", "DJANGO_DEBUG": "0", **env})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"web process exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/metrics", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"web process not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.2)

    def connect(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def written_bytes(self) -> int:
        """What the server process has passed to write() so far, files and sockets alike (Linux's
        /proc/<pid>/io `wchar`): a body spooled to a temporary file shows up here."""
        for line in Path(f"/proc/{self.process.pid}/io").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "wchar":
                return int(value)
        raise AssertionError("no wchar in /proc/<pid>/io")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def web_env(tmp_path: Path) -> dict[str, str]:
    """The test database and Redis of this run (the caller's fixture must have set up the database)."""
    from django.conf import settings

    return {"DATABASE_URL": _database_url(), "REDIS_URL": settings.REDIS_URL,
            "STORAGE_URL": f"file://{tmp_path / 'storage'}", "LORAPLEX_VAR_DIR": str(tmp_path / "var")}


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received
