"""`make up`'s launcher: run for real on the embedded defaults, it comes up, prints where to go, and
on SIGTERM stops every child and releases its port; its first-run set-up happens only once."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from lora_platform import launcher as launcher_module
from tenants.models import Membership, Tenant

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on the port now (SO_REUSEADDR, as servers do: TIME_WAIT is fine)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Launcher:
    """`python -m lora_platform.launcher` in a subprocess with its own var dir: SQLite, embedded Redis."""

    def __init__(self, var_dir: Path, port: int, serving_port: int | None = None) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("REDIS_URL", "DATABASE_URL", "STORAGE_URL", "BASE_MODEL_PATH", "DJANGO_SETTINGS_MODULE")}
        env.pop("REGISTRY_TOKEN", None)
        self.serving_port = serving_port or unused_port()
        env.update(LORAPLEX_VAR_DIR=str(var_dir), LORAPLEX_WEB_PORT=str(port),
                   LORAPLEX_SERVING_PORT=str(self.serving_port), PYTHONUNBUFFERED="1")
        self.port = port
        self.lines: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "lora_platform.launcher"], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Drained all along, so the children's logs never fill the pipe and block them.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while text not in self.output:
            assert self.process.poll() is None, f"launcher exited early:\n{self.output[-5000:]}"
            assert time.monotonic() < deadline, f"no '{text}' within {STARTUP_TIMEOUT_S} s:\n{self.output[-5000:]}"
            time.sleep(0.2)

    def get(self, path: str, key: str | None = None, port: int | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{port or self.port}{path}")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=90)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_launcher_comes_up_prints_where_to_go_and_stops_cleanly(tmp_path: Path) -> None:
    port = unused_port()
    launcher = Launcher(tmp_path / "var", port)
    try:
        launcher.wait_for("Loraplex is up")
        status, body = launcher.get("/api/schema/")
        assert status == 200 and b"/api/v1/api-keys" in body
        base = f"http://127.0.0.1:{port}"
        for url in (f"{base}/", f"{base}/admin/", f"{base}/api/v1/", f"{base}/api/schema/"):
            assert url in launcher.output
        key = re.search(r"Demo API key (lp-\S+)", launcher.output).group(1)
        status, body = launcher.get("/api/v1/tenant", key=key)
        assert status == 200 and json.loads(body)["slug"] == "demo"
        assert re.search(r"user 'admin', password \S+ +\(shown this once\)", launcher.output)
        assert (tmp_path / "var" / "models" / "tiny-llama" / "config.json").is_file()
        assert processes_with(f"worker-{launcher.process.pid}@"), "the Celery worker is not running"
        assert f"http://127.0.0.1:{launcher.serving_port}/v1/" in launcher.output
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # the serving worker answers /health with 503 until its model is loaded
            try:
                if launcher.get("/health", port=launcher.serving_port)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"serving worker not healthy:\n{launcher.output[-5000:]}"
            time.sleep(0.5)
        status, body = launcher.get("/v1/models", port=launcher.serving_port)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-llama"

        assert launcher.terminate() == 0
    finally:
        launcher.kill()
    assert "Loraplex stopped." in launcher.output
    assert port_is_free(port) and port_is_free(launcher.serving_port)
    assert processes_with(f"worker-{launcher.process.pid}@") == []


def test_launcher_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        launcher = Launcher(tmp_path / "var", holder.getsockname()[1])
        try:
            assert launcher.process.wait(timeout=120) == 1
        finally:
            launcher.kill()
    launcher._reader.join(timeout=10)
    assert "is in use; stop what holds it or set LORAPLEX_WEB_PORT" in launcher.output


@pytest.mark.django_db
def test_first_run_setup_happens_once_and_secrets_are_printed_only_then() -> None:
    key = launcher_module.ensure_demo_tenant()
    password = launcher_module.ensure_admin_user()
    assert key.startswith("lp-") and password

    assert launcher_module.ensure_demo_tenant() is None
    assert launcher_module.ensure_admin_user() is None
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(password)
    assert Membership.objects.get(user=admin).tenant == Tenant.objects.get(slug="demo")
    assert Tenant.objects.count() == 1

    first = launcher_module.banner("http://h:1", key, password)
    later = launcher_module.banner("http://h:1", None, None)
    assert key in first and password in first
    assert "shown this once" not in later and "tenants create-key demo" in later
