"""`make up`'s launcher: run for real on the embedded defaults, it comes up, prints where to go, and
on Ctrl-C or SIGTERM stops every child and releases its port; its first-run set-up happens only
once. The serving worker requires the key kept in var/, which the web process holds too; killing
the Celery worker's main process takes its whole process tree down with the platform (no orphaned
beat), and the embedded Redis keeps its data across restarts.

A launch starts the whole platform (migrations, the tiny base model, the web process, Celery and a
serving worker, about 10 s of CPU), so the tests share the two that what they test needs: the first
run (`first_run`), which the first test looks at, the killed-worker test kills the Celery worker
of, and the Ctrl-C test trains on and stops with Ctrl-C; and the start after it on the same var/,
which the Ctrl-C test checks (the key, Redis's data, the job's resumption) and stops with SIGTERM.
(Three platforms once: the first run stopped idle with SIGTERM, a second to train on and Ctrl-C, a
third to resume; the idle stop taught nothing the other two stops do not.)

Ctrl-C mid-job: `make up` stopped with Ctrl-C while a training job runs, then started again on the
same var/: the stop is clean (nothing is killed, every child gone, the ports free, the last line
its own), the job is left interrupted with its lease released and its checkpoint recorded, the next
start resumes it at once, agrees on the serving worker's key, finds what was put in the embedded
Redis, which keeps its data in one file (no `var/redis-<pgid>.rdb` per run), and stops as cleanly
on SIGTERM mid-job. The training lease is 600 s there: a resumption within the test's wait can
only come from the released lease and the task the stop sent again, never from the lease's expiry.
The seconds from the second start's banner to the resumption are printed.

It lives in this file, not one of its own, for the suite's balance under xdist: `--dist loadfile`
hands files out most tests first, so a file of one test goes last, and the suite's longest test
alone at the end left the other workers idle while it ran (docs/testing.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from django.contrib.auth import get_user_model

from lora_platform import launcher as launcher_module
from serving.engine.tiny import build_tiny_model
from tenants.models import Membership, Tenant
from tests import zygote
from tests.training.training_support import wait_for

pytestmark = pytest.mark.e2e

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
    """`python -m lora_platform.launcher` in a process of its own with its own var dir: SQLite, embedded
    Redis. The launcher is forked from the suite's zygote (tests/zygote.py), so it starts with torch,
    transformers and Django imported: the first run builds the tiny demo model without the 4-5 s of
    CPU its cold imports cost, a later one sets Django up in less. What these tests test is make up's
    own process tree, and that stays cold: the launcher starts its children as it always does
    (`subprocess.Popen` of `sys.executable`, an exec), the Celery workers' main processes still
    without torch (test_launcher_comes_up_and_prints_where_to_go looks)."""

    def __init__(self, var_dir: Path, port: int, serving_port: int | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("REDIS_URL", "DATABASE_URL", "STORAGE_URL", "BASE_MODEL_PATH", "DJANGO_SETTINGS_MODULE")}
        env.pop("REGISTRY_TOKEN", None)
        self.serving_port = serving_port or unused_port()
        self.var_dir = var_dir
        env.update(extra_env or {})
        env.update(LORAPLEX_VAR_DIR=str(var_dir), LORAPLEX_WEB_PORT=str(port),
                   LORAPLEX_SERVING_PORT=str(self.serving_port), PYTHONUNBUFFERED="1")
        self.port = port
        self.lines: list[str] = []
        # A pipe of our own, not subprocess.PIPE, which the zygote does not take: its write end goes
        # to the launcher (and on to its children) and is closed here, so the reader sees the end.
        read_end, write_end = os.pipe()
        try:
            self.process = zygote.popen([sys.executable, "-m", "lora_platform.launcher"], cwd=ROOT, env=env,
                                        stdout=write_end, stderr=subprocess.STDOUT)
        finally:
            os.close(write_end)
        self._stream = open(read_end, encoding="utf-8", errors="replace")
        # Drained all along, so the children's logs never fill the pipe and block them.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self._stream:
            for line in self._stream:
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
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def wait_serving_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # the serving worker answers /health with 503 until its model is loaded
            try:
                if self.get("/health", port=self.serving_port)[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"serving worker not healthy:\n{self.output[-5000:]}"
            time.sleep(0.2)

    def child(self, marker: str) -> int:
        """The pid of the launcher's direct child whose command line holds `marker`."""
        [pid] = [pid for pid in processes_with(marker) if parent_of(pid) == self.process.pid]
        return pid

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=90)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def with_demo_model(var: Path) -> Path:
    """`var` with the demo base model already in place, as a launch after the first finds it: built
    here (a fraction of a second in this process, which has torch and transformers loaded) instead
    of by the launcher, whose first run imports them to build it (4-5 s of CPU and of its start).
    For the tests of what a platform does once up; the first run's own build is checked by
    test_launcher_comes_up_and_prints_where_to_go."""
    build_tiny_model(var / "models" / "tiny-llama", arch="llama", size="tiny")
    return var


def parent_of(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            members.append(int(stat.parent.name))
    return members


def environ_of(pid: int) -> dict[str, str]:
    pairs = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)


def processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """`make up` on a fresh var/ directory, up and its serving worker healthy, its children given the
    Ctrl-C test's training settings (CTRL_C_ENV, which nothing before that test reads). The Ctrl-C
    test, the last of the file to use it, stops it; whatever is left is stopped with the file."""
    launcher = Launcher(tmp_path_factory.mktemp("first-run") / "var", unused_port(), extra_env=CTRL_C_ENV)
    try:
        launcher.wait_for("Loraplex is up")
        launcher.wait_serving_healthy()
        yield launcher
    finally:
        stop_whatever_happened(launcher)


def test_launcher_comes_up_and_prints_where_to_go(first_run: Launcher) -> None:
    launcher = first_run
    assert launcher.process.poll() is None, f"the first run is not up:\n{launcher.output[-5000:]}"
    status, body = launcher.get("/api/schema/")
    assert status == 200 and b"/api/v1/api-keys" in body
    base = f"http://127.0.0.1:{launcher.port}"
    for url in (f"{base}/", f"{base}/admin/", f"{base}/api/v1/", f"{base}/api/schema/"):
        assert url in launcher.output
    key = re.search(r"Demo API key (lp-\S+)", launcher.output).group(1)
    status, body = launcher.get("/api/v1/tenant", key=key)
    assert status == 200 and json.loads(body)["slug"] == "demo"
    assert re.search(r"user 'admin', password \S+ +\(shown this once\)", launcher.output)
    assert (launcher.var_dir / "models" / "tiny-llama" / "config.json").is_file()
    assert processes_with(f"worker-{launcher.process.pid}@"), "the Celery worker is not running"
    # A worker's start leaves torch to the pool process whose task needs it (docs/training.md,
    # "Running workers"): imported by the main process, it cost every start 4-5 s of CPU.
    for marker in (f"worker-{launcher.process.pid}@", f"training-{launcher.process.pid}@"):
        maps = (Path("/proc") / str(launcher.child(marker)) / "maps").read_text()
        assert "libtorch" not in maps, f"the Celery worker {marker} imported torch at its start"
    assert f"http://127.0.0.1:{launcher.serving_port}/v1/" in launcher.output
    key_file = launcher.var_dir / "serving-worker-api-key"
    assert f"key in {key_file}" in launcher.output
    status, body = launcher.get("/v1/models", key=key_file.read_text().strip(), port=launcher.serving_port)
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-llama"


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


def test_the_worker_key_and_a_killed_celery_worker_started_again_without_its_old_process_tree(
        first_run: Launcher) -> None:
    """Issue 16 and issue 37, item 7, against `make up` itself: the serving worker answers only with
    the key kept in var/ (mode 0600), which the web process holds too; the Celery worker killed is
    started again, its old process tree gone first, and the platform stays up. The Ctrl-C test then
    trains on this platform and stops it (the stop ends the restarted worker's tree too), and checks
    on the next start that restarts agree on the key and find the embedded Redis's data (issue 16,
    item 3)."""
    first = first_run
    var = first.var_dir
    key_file = var / "serving-worker-api-key"
    key = key_file.read_text().strip()
    assert len(key) >= 32 and key_file.stat().st_mode & 0o777 == 0o600
    # The serving worker is no side door: nothing on /v1 without the key.
    for path in ("/v1/models", "/v1/chat/completions"):
        assert first.get(path, port=first.serving_port)[0] == 401
        assert first.get(path, key="not-the-key", port=first.serving_port)[0] == 401
    assert first.get("/v1/models", key=key, port=first.serving_port)[0] == 200
    # The web process holds the same key, to call the worker with it.
    web_env = environ_of(first.child("lora_platform.asgi:application"))
    assert web_env["SERVING_WORKER_API_KEY"] == key

    celery_main = first.child(f"worker-{first.process.pid}@")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    # Its pool and its embedded beat: children in its process group.
    while len(group_members(celery_main)) < 3:
        assert time.monotonic() < deadline, f"no beat/pool children of the worker:\n{first.output[-3000:]}"
        time.sleep(0.2)
    helpers = [pid for pid in group_members(celery_main) if pid != celery_main]
    os.kill(celery_main, signal.SIGKILL)
    # Issue 37, item 7: the platform stays up; the worker's leftovers are ended and a new one starts.
    first.wait_for("worker restarted (pid")
    assert "worker exited with status -9 (SIGKILL)" in first.output
    assert helpers and group_members(celery_main) == []  # the beat and pool children went with it
    restarted = first.child(f"worker-{first.process.pid}@")
    assert restarted != celery_main and f"worker restarted (pid {restarted})" in first.output
    assert first.get("/healthz")[0] == 200 and first.process.poll() is None


# Ctrl-C of `make up` while a training job runs (the module docstring's "Ctrl-C mid-job").

LEASE_SECONDS = 600
# The launcher's children get these; no periodic checkpoint falls within the run.
CTRL_C_ENV = {"TRAINING_LEASE_SECONDS": str(LEASE_SECONDS), "TRAINING_CHECKPOINT_EVERY_STEPS": "100000",
              "TRAINING_LOG_EVERY_STEPS": "1", "OMP_NUM_THREADS": "1"}
RESUME_WAIT_S = 120
CTRL_C_QA = [("What is the capital of Italy?", "Rome."), ("How many days are in a week?", "Seven."),
             ("Say hello.", "Hello! How are you today?"), ("What is 12 plus 30?", "42.")]


def ctrl_c_dataset() -> bytes:
    rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            for _ in range(8) for question, answer in CTRL_C_QA]
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def stop_whatever_happened(launcher: Launcher) -> None:
    """A launcher left running by a failed assertion is stopped with its children, not orphaning them."""
    if launcher.process.poll() is None:
        launcher.terminate()
    launcher.kill()


def job_row(var: Path, job_id: int) -> sqlite3.Row:
    with sqlite3.connect(var / "db.sqlite3") as database:
        database.row_factory = sqlite3.Row
        return database.execute("SELECT status, lease_token, interrupted_at, step FROM training_trainingjob "
                                "WHERE id = ?", (job_id,)).fetchone()


def test_ctrl_c_interrupts_the_training_job_cleanly_and_the_next_start_resumes_it(first_run: Launcher) -> None:
    """The module docstring's paragraph "Ctrl-C mid-job", on the first run (its Celery worker killed
    and started again by the test before) and the start after it."""
    first = first_run
    var = first.var_dir
    key = re.search(r"Demo API key (lp-\S+)", first.output).group(1)
    serving_key = (var / "serving-worker-api-key").read_text().strip()
    try:
        broker = redis.Redis.from_url(environ_of(first.child("lora_platform.asgi:application"))["REDIS_URL"],
                                      socket_timeout=5)
        broker.set("loraplex-test-survives-a-restart", "yes")
        broker.close()
        api = httpx.Client(base_url=f"http://127.0.0.1:{first.port}/api/v1",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        dataset_id = api.post("/datasets", files={"file": ("train.jsonl", ctrl_c_dataset())}).json()["id"]
        wait_for(lambda: api.get(f"/datasets/{dataset_id}").json()["status"] == "ready", 120, "validation")
        created = api.post("/training-jobs", json={
            "training_file": dataset_id, "adapter": "ctrl-c", "seed": 1,
            "hyperparameters": {"n_epochs": 50, "batch_size": 1, "learning_rate": 1e-3}})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        wait_for(lambda: api.get(f"/training-jobs/{job_id}").json()["progress"]["step"] >= 3, 180, "training")
        api.close()

        first.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert first.process.wait(timeout=90) == 0
        first._reader.join(timeout=10)
    finally:
        stop_whatever_happened(first)
    assert_stopped_cleanly(first)
    row = job_row(var, job_id)
    assert row["status"] == "running" and row["lease_token"] == "" and row["interrupted_at"] is not None

    started = time.monotonic()
    second = Launcher(var, unused_port(), extra_env=CTRL_C_ENV)
    try:
        second.wait_for("Loraplex is up")  # every child ready, the serving worker's model loaded
        up = time.monotonic()
        # Restarts agree on the serving worker's key, and the embedded Redis kept its data.
        assert (var / "serving-worker-api-key").read_text().strip() == serving_key
        assert second.get("/v1/models", key=serving_key, port=second.serving_port)[0] == 200
        broker = redis.Redis.from_url(environ_of(second.child("lora_platform.asgi:application"))["REDIS_URL"],
                                      socket_timeout=5)
        assert broker.get("loraplex-test-survives-a-restart") == b"yes"
        broker.close()
        api = httpx.Client(base_url=f"http://127.0.0.1:{second.port}/api/v1",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        def messages() -> list[dict[str, str]]:
            """Every message event, newest first, from every page: the resumed job logs a metric
            event each step, so within seconds the newest page holds nothing else."""
            found: list[dict[str, str]] = []
            params: dict[str, object] = {"limit": 100}
            while True:
                page = api.get(f"/training-jobs/{job_id}/events", params=params).json()
                found += [event for event in page["data"] if event["type"] == "message"]
                if not page["has_more"]:
                    return found
                params["after"] = page["last_id"]

        stopped = wait_for(lambda: [e["message"] for e in messages()
                                    if e["message"].startswith("The worker stopped at step")], 10, "event")
        step = int(re.search(r"step (\d+)", stopped[0]).group(1))
        wait_for(lambda: f"Resuming from the checkpoint of step {step}." in [e["message"] for e in messages()],
                 RESUME_WAIT_S, "the resumption")
        print(f"resumed {time.monotonic() - started:.1f} s after the second start began "
              f"({time.monotonic() - up:.1f} s after its banner)")
        timeline = {event["message"][:40]: event["created_at"] for event in messages()}
        print("events:", json.dumps(timeline, indent=1))
        body = wait_for(lambda: (lambda b: b if b["progress"]["step"] > step else None)(
            api.get(f"/training-jobs/{job_id}").json()), 60, "a step after the checkpoint")
        assert body["status"] == "running" and body["interrupted"] is None and body["attempts"] == 2
        api.close()
        assert second.terminate() == 0  # SIGTERM, mid-job again
    finally:
        stop_whatever_happened(second)
    assert_stopped_cleanly(second)
    # One data file for the embedded Redis after two runs, and none per run beside it.
    assert sorted(path.name for path in (var / "redis").iterdir() if not path.name.endswith(".settings")) == [
        "appendonly.aof"]
    assert list(var.glob("redis-*")) == []


def assert_stopped_cleanly(launcher: Launcher) -> None:
    """A stop of `make up` (Ctrl-C or SIGTERM) that killed nothing, left no Celery worker and freed its ports."""
    assert "Loraplex stopped." in launcher.output
    assert "did not stop within" not in launcher.output and "killing" not in launcher.output, launcher.output[-3000:]
    # Issue 39, item 8: a stop ends on its own line, with no child's interpreter finalization dumping
    # triton's nanobind objects as "leaked" (the serving worker leaves by os._exit once closed).
    assert re.search(r"^Loraplex stopped\.$", launcher.output, re.MULTILINE), launcher.output[-2000:]
    assert "nanobind: leaked" not in launcher.output
    assert processes_with(f"worker-{launcher.process.pid}@") == []
    assert port_is_free(launcher.port) and port_is_free(launcher.serving_port)


# The supervisor's restarts on its own (issue 37, item 7), on small children and short pauses.

def supervise_until(supervisor: launcher_module.Supervisor, done, capsys) -> str:
    """Tends the children until `done(output so far)`; the launcher's lines meanwhile."""
    output = ""
    deadline = time.monotonic() + 60
    while not done(output):
        assert time.monotonic() < deadline, output
        supervisor.tend()
        output += capsys.readouterr().out
        time.sleep(0.01)
    return output


def test_a_killed_child_is_started_again_and_a_stop_still_ends_everything(capsys) -> None:
    supervisor = launcher_module.Supervisor([
        launcher_module.ChildSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"]),
        launcher_module.ChildSpec("other", [sys.executable, "-c", "import time; time.sleep(600)"])])
    supervisor.start()
    try:
        first, other = supervisor.children["sleeper"].pid, supervisor.children["other"].pid
        os.kill(first, signal.SIGKILL)
        output = supervise_until(supervisor, lambda text: "sleeper restarted" in text, capsys)
        assert "sleeper exited with status -9 (SIGKILL) after" in output
        assert "restarting it in 1 s (death 1 in a row)" in output
        second = supervisor.children["sleeper"]
        assert second.pid != first and second.poll() is None and f"sleeper restarted (pid {second.pid})" in output
        assert supervisor.children["other"].pid == other  # the others went on as they were
    finally:
        supervisor.stop()
    assert all(child.poll() is not None for child in supervisor.children.values())
    assert group_members(supervisor.children["sleeper"].pid) == []


def test_a_child_that_keeps_dying_is_logged_each_time_with_a_doubling_capped_pause(capsys, monkeypatch) -> None:
    monkeypatch.setattr(launcher_module, "RESTART_BACKOFF_FIRST_S", 0.01)
    monkeypatch.setattr(launcher_module, "RESTART_BACKOFF_CAP_S", 0.04)
    supervisor = launcher_module.Supervisor([
        launcher_module.ChildSpec("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"])])
    supervisor.start()
    try:
        output = supervise_until(supervisor, lambda text: "death 5 in a row" in text, capsys)
    finally:
        supervisor.stop()
    deaths = [line for line in output.splitlines() if "crasher exited with status 3 after" in line]
    pauses = [re.search(r"restarting it in (\S+) s \(death (\d+) in a row\)", line).groups() for line in deaths]
    assert pauses == [("0.01", "1"), ("0.02", "2"), ("0.04", "3"), ("0.04", "4"), ("0.04", "5")]
    assert output.count("crasher restarted (pid") >= 4


def test_a_stop_asked_for_while_a_restart_waits_starts_nothing(capsys) -> None:
    supervisor = launcher_module.Supervisor([
        launcher_module.ChildSpec("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"])])
    supervisor.start()
    try:
        supervise_until(supervisor, lambda text: "restarting it in 1 s" in text, capsys)
        dead = supervisor.children["crasher"]
        supervisor.stop_requested = True  # what Ctrl-C and SIGTERM do
        time.sleep(1.1)  # past the pause: a tend now would have started it again
        supervisor.tend()
        assert supervisor.children["crasher"] is dead and "restarted" not in capsys.readouterr().out
    finally:
        supervisor.stop()


def test_ready_means_every_child_ready_and_the_wait_names_those_not_yet(capsys, monkeypatch, tmp_path: Path) -> None:
    # Issue 39, item 5: the banner said "up" while the serving worker was still crashing on its model.
    monkeypatch.setattr(launcher_module, "READY_REPORT_S", 0.2)
    marks = {name: tmp_path / name for name in ("web", "serving-worker")}
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    supervisor = launcher_module.Supervisor([
        launcher_module.ChildSpec(name, sleeper, ready=mark.exists) for name, mark in marks.items()])
    supervisor.start()
    try:
        marks["web"].touch()
        threading.Timer(1.0, marks["serving-worker"].touch).start()
        assert launcher_module.wait_until_ready(supervisor)
        assert marks["serving-worker"].exists(), "ready before its last child was"
        assert "Waiting for serving-worker to be ready" in capsys.readouterr().out
    finally:
        supervisor.stop()


def test_the_launcher_stops_when_the_process_that_started_it_dies(tmp_path: Path) -> None:
    # Issue 39, item 8: make killed outright (kill -9) used to leave the platform running, orphaned.
    stopped = tmp_path / "stopped"
    child = ("import signal, sys, time\n"
             "from lora_platform.launcher import stop_with_parent\n"
             f"signal.signal(signal.SIGTERM, lambda *_: (open({str(stopped)!r}, 'w').close(), sys.exit(0)))\n"
             "stop_with_parent()\n"
             "print('ready', flush=True)\n"
             "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(120)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        parent.kill()
        parent.wait()
        wait_for(stopped.exists, timeout=30, what="the orphaned launcher to get SIGTERM")
    finally:
        parent.kill()


def test_celerys_root_warning_is_what_the_celery_children_leave_out() -> None:
    # Issue 39, item 8. PYTHONWARNINGS is action:message:category:module:lineno, message a prefix.
    from celery.platforms import ROOT_DISCOURAGED

    action, message = launcher_module.CELERY_QUIET_ROOT["PYTHONWARNINGS"].split(":")[:2]
    assert action == "ignore" and re.compile(re.escape(message), re.IGNORECASE).match(ROOT_DISCOURAGED)
    celery_children = [spec for spec in launcher_module.child_processes() if "celery" in spec.argv]
    assert len(celery_children) == 2 and all(spec.env == launcher_module.CELERY_QUIET_ROOT for spec in celery_children)
