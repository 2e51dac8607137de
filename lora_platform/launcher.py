"""`make up`: the whole platform on one machine, on its embedded defaults.

`python -m lora_platform.launcher` prepares what the processes need (database tables, the embedded
Redis, a base model, a demo tenant and an admin user the first time), starts the processes of the
platform as children (the list in `child_processes`), prints where to go, and stops the children
cleanly on Ctrl-C or SIGTERM. If one child dies, the others are stopped too: a half-running
platform is worse than a stopped one.

The children get this process's environment, REDIS_URL included: importing the settings starts the
embedded Redis when REDIS_URL is unset and exports its URL, so every child shares that one server.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

WEB_HOST = os.environ.get("LORAPLEX_WEB_HOST", "127.0.0.1")
WEB_PORT = int(os.environ.get("LORAPLEX_WEB_PORT", "8000"))
SERVING_PORT = int(os.environ.get("LORAPLEX_SERVING_PORT", "8100"))
DEMO_TENANT = "demo"
ADMIN_USERNAME = "admin"
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]


def child_processes() -> list[ChildSpec]:
    """The platform's processes: web, Celery worker, and one serving worker synced to the registry."""
    from django.conf import settings

    python = sys.executable
    snapshot_url = f"http://{WEB_HOST}:{WEB_PORT}/api/v1/internal/registry/snapshot"
    return [
        ChildSpec("web", [python, "-m", "uvicorn", "lora_platform.asgi:application",
                          "--host", WEB_HOST, "--port", str(WEB_PORT), "--log-level", "warning"]),
        ChildSpec("worker", [python, "-m", "celery", "-A", "lora_platform", "worker",
                             "--queues", "quick,training", "--concurrency", "1", "--loglevel", "INFO",
                             # One machine, one worker: it also runs the beat schedule (the
                             # training jobs sweep); compose runs beat as its own service.
                             "--beat", "--schedule", str(settings.VAR_DIR / "celerybeat-schedule"),
                             "--hostname", f"worker-{os.getpid()}@%h"]),
        # REGISTRY_TOKEN and REDIS_URL reach it through the environment (see ensure_registry_token).
        ChildSpec("serving-worker", [python, "-m", "serving.engine.server",
                                     "--model", str(settings.BASE_MODEL_PATH),
                                     "--served-model-name", settings.BASE_MODEL_NAME,
                                     "--host", WEB_HOST, "--port", str(SERVING_PORT),
                                     "--max-lora-rank", str(settings.MAX_LORA_RANK),
                                     "--registry-url", snapshot_url,
                                     "--uvicorn-log-level", "warning"]),
    ]


def ensure_registry_token() -> None:
    """The web app and the serving worker share a registry token; one per run unless configured."""
    os.environ.setdefault("REGISTRY_TOKEN", secrets.token_urlsafe(32))


def say(message: str = "") -> None:
    print(message, flush=True)


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")
    import django

    django.setup()


def ensure_database() -> None:
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def ensure_base_model() -> None:
    """Builds the tiny demo base model at BASE_MODEL_PATH if nothing is there yet."""
    from django.conf import settings

    path = Path(settings.BASE_MODEL_PATH)
    if (path / "config.json").is_file():
        return
    try:
        from serving.engine.tiny import build_tiny_model
    except ImportError as error:
        say(f"WARNING: no base model at {path}, and the tiny-model builder (serving.engine.tiny) cannot be "
            f"imported ({error}). Set BASE_MODEL_PATH to a Hugging Face causal-LM directory. The web app and "
            "workers start anyway; training and serving need the base model.")
        return
    say(f"Building the tiny demo base model (random weights) at {path} …")
    build_tiny_model(path, arch="llama", size="tiny")


def ensure_demo_tenant() -> str | None:
    """Creates the demo tenant the first time; its API key (returned only then) or None."""
    from tenants.models import Tenant
    from tenants.services import tenant_create

    if Tenant.objects.filter(slug=DEMO_TENANT).exists():
        return None
    _, key = tenant_create(slug=DEMO_TENANT, tier_name="standard", name="Demo tenant")
    return key


def ensure_admin_user() -> str | None:
    """Creates the superuser `admin` (owner of the demo tenant) the first time; its password then, or None.

    The password is random and printed once; it is stored nowhere but as Django's password hash.
    """
    from django.contrib.auth import get_user_model

    from tenants.models import Membership, Tenant

    users = get_user_model()
    if users.objects.filter(username=ADMIN_USERNAME).exists():
        return None
    password = secrets.token_urlsafe(12)
    admin = users.objects.create_superuser(username=ADMIN_USERNAME, email="", password=password)
    demo = Tenant.objects.filter(slug=DEMO_TENANT).first()
    if demo is not None:
        Membership.objects.get_or_create(user=admin, tenant=demo, defaults={"role": Membership.Role.OWNER})
    return password


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        # As uvicorn binds: connections of a previous run in TIME_WAIT do not block a restart.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class Supervisor:
    """Starts the children, watches them, and stops them all (SIGTERM, then SIGKILL) once."""

    def __init__(self, specs: list[ChildSpec]) -> None:
        self.specs = specs
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def start(self) -> None:
        for spec in self.specs:
            # A session of its own: Ctrl-C reaches only the launcher, which stops each child once.
            self.children[spec.name] = subprocess.Popen(spec.argv, start_new_session=True)

    def dead_child(self) -> str | None:
        for name, child in self.children.items():
            if child.poll() is not None:
                return name
        return None

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, child in self.children.items():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it.")
                child.kill()
                child.wait()


def wait_until_ready(supervisor: Supervisor, url: str) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not supervisor.stopping:
        if supervisor.dead_child() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    return False


def banner(base: str, demo_key: str | None, admin_password: str | None) -> str:
    lines = [
        "",
        "Loraplex is up. Ctrl-C stops it.",
        f"  Admin        {base}/admin/",
        f"  API          {base}/api/v1/",
        f"  API schema   {base}/api/schema/   (browsable: {base}/api/docs/)",
        f"  Serving      http://{WEB_HOST}:{SERVING_PORT}/v1/   (OpenAI-compatible serving worker; "
        f"metrics at /metrics)",
    ]
    if admin_password:
        lines.append(f"  Admin login  user '{ADMIN_USERNAME}', password {admin_password}   (shown this once)")
    else:
        lines.append(f"  Admin login  user '{ADMIN_USERNAME}' (password printed on the first run; "
                     f"reset: python manage.py changepassword {ADMIN_USERNAME})")
    if demo_key:
        lines.append(f"  Demo API key {demo_key}   (tenant '{DEMO_TENANT}'; shown this once)")
        lines.append(f"  Try          curl -H 'Authorization: Bearer {demo_key}' {base}/api/v1/tenant")
    else:
        lines.append(f"  Demo tenant  '{DEMO_TENANT}' (its key was printed on the first run; new one: "
                     f"python manage.py tenants create-key {DEMO_TENANT} --name laptop)")
    return "\n".join(lines) + "\n"


def main() -> int:
    if not port_is_free(WEB_HOST, WEB_PORT):
        say(f"Port {WEB_PORT} on {WEB_HOST} is in use; stop what holds it or set LORAPLEX_WEB_PORT.")
        return 1
    if not port_is_free(WEB_HOST, SERVING_PORT):
        say(f"Port {SERVING_PORT} on {WEB_HOST} is in use; stop what holds it or set LORAPLEX_SERVING_PORT.")
        return 1
    ensure_registry_token()
    setup_django()
    ensure_database()
    ensure_base_model()
    demo_key = ensure_demo_tenant()
    admin_password = ensure_admin_user()

    supervisor = Supervisor(child_processes())

    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    base = f"http://{WEB_HOST}:{WEB_PORT}"
    try:
        supervisor.start()
        if not wait_until_ready(supervisor, f"{base}/api/schema/"):
            if supervisor.stopping:
                return 0
            say(f"The web app did not answer at {base}/api/schema/; stopping.")
            return 1
        say(banner(base, demo_key, admin_password))
        while not supervisor.stopping:
            dead = supervisor.dead_child()
            if dead is not None:
                say(f"{dead} exited with status {supervisor.children[dead].returncode}; stopping the platform.")
                return 1
            time.sleep(0.5)
        return 0
    finally:
        supervisor.stop()
        say("Loraplex stopped.")


if __name__ == "__main__":
    sys.exit(main())
