"""docker-compose.yml is operable (docs/operations.md): every long-running service has a healthcheck and
restarts unless stopped, the one-shot jobs restart on failure only, every dependency waits for a
condition, and one MAX_LORA_RANK feeds the web app and the serving worker. No Docker here, so the
file is read as Compose reads it (YAML, merge keys, `${VAR:-default}`) and the probes' commands are
run as the containers would run them, against real servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${NAME}` and `${NAME:-default}` (unset or empty: the default)."""
    return VARIABLE.sub(lambda match: environ.get(match.group(1)) or (match.group(2) or ""), value)


def one_shots() -> set[str]:
    """Services that others wait for to complete: jobs that run once and exit."""
    return {name for service in SERVICES.values() for name, need in (service.get("depends_on") or {}).items()
            if need["condition"] == "service_completed_successfully"}


def long_running() -> set[str]:
    return set(SERVICES) - one_shots()


def probe_argv(service: str, replacements: dict[str, str]) -> list[str]:
    """A healthcheck's CMD as argv, with the container's addresses and paths swapped for the test's."""
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    argv = [sys.executable if part == "python" else part for part in test[1:]]
    for old, new in replacements.items():
        argv = [part.replace(old, new) for part in argv]
    return argv


def test_the_one_shot_jobs_are_the_expected_ones_and_restart_on_failure_only() -> None:
    assert one_shots() == {"setup", "minio-init"}
    for name in one_shots():
        # unless-stopped would run a finished job again and again.
        assert SERVICES[name]["restart"] == "on-failure", name


@pytest.mark.parametrize("name", sorted(long_running()))
def test_every_long_running_service_has_a_healthcheck_and_restarts_unless_stopped(name: str) -> None:
    service = SERVICES[name]
    assert service.get("restart") == "unless-stopped", name
    check = service.get("healthcheck") or {}
    assert check.get("test") and check["test"][0] in ("CMD", "CMD-SHELL"), name
    assert check.get("interval") and check.get("retries"), name


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_dependency_waits_for_health_or_completion(name: str) -> None:
    needs = SERVICES[name].get("depends_on") or {}
    assert isinstance(needs, dict), f"{name}: a bare depends_on list starts it before its dependencies are up"
    for dependency, need in needs.items():
        expected = "service_completed_successfully" if dependency in one_shots() else "service_healthy"
        assert need == {"condition": expected}, (name, dependency)


def test_the_start_order_has_no_cycle_and_the_serving_worker_waits_for_the_web_app() -> None:
    """The serving worker reads the registry from the web app, so it waits for it; the web app's own
    probe is /healthz, not /readyz, which would wait for a serving worker: a deadlock."""
    assert SERVICES["serving-worker"]["depends_on"]["web"] == {"condition": "service_healthy"}
    assert any("/healthz" in part for part in SERVICES["web"]["healthcheck"]["test"])
    assert any("/readyz" in part for part in SERVICES["serving-worker"]["healthcheck"]["test"])
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(name: str) -> None:
        assert name not in visiting, f"depends_on cycle through {name}"
        if name in done:
            return
        visiting.add(name)
        for dependency in SERVICES[name].get("depends_on") or {}:
            visit(dependency)
        visiting.discard(name)
        done.add(name)

    for name in SERVICES:
        visit(name)


def test_one_max_lora_rank_feeds_the_web_app_and_the_serving_worker(settings) -> None:
    command = SERVICES["serving-worker"]["command"]
    worker_rank = command[command.index("--max-lora-rank") + 1]
    web_rank = SERVICES["web"]["environment"]["MAX_LORA_RANK"]
    assert worker_rank == web_rank == SERVICES["worker"]["environment"]["MAX_LORA_RANK"]
    for environ in ({}, {"MAX_LORA_RANK": "32"}):
        assert interpolate(worker_rank, environ) == interpolate(web_rank, environ)
    assert interpolate(web_rank, {"MAX_LORA_RANK": "32"}) == "32"
    if "MAX_LORA_RANK" not in os.environ:
        # Unset, compose's default is the platform's own default.
        assert interpolate(web_rank, {}) == str(settings.MAX_LORA_RANK)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_web_apps_probe_command_passes_on_a_live_web_app_and_fails_on_none(live_server) -> None:
    address = live_server.url.removeprefix("http://")
    assert subprocess.run(probe_argv("web", {"127.0.0.1:8000": address}), timeout=30).returncode == 0
    closed = probe_argv("web", {"127.0.0.1:8000": "127.0.0.1:9"})  # the discard port: nothing listens
    assert subprocess.run(closed, capture_output=True, timeout=30).returncode != 0


@pytest.mark.e2e
def test_the_beat_probe_passes_on_a_fresh_schedule_file_only(tmp_path: Path) -> None:
    schedule = tmp_path / "celerybeat-schedule"
    argv = probe_argv("beat", {"/tmp/celerybeat-schedule": str(schedule)})
    assert subprocess.run(argv, timeout=30).returncode == 1  # beat has written nothing yet
    schedule.with_suffix(".db").write_bytes(b"")
    assert subprocess.run(argv, timeout=30).returncode == 0
    old = time.time() - 3600
    os.utime(schedule.with_suffix(".db"), (old, old))
    assert subprocess.run(argv, timeout=30).returncode == 1


def test_the_worker_settings_env_example_lists_reach_compose_s_serving_worker() -> None:
    # Issue 39, item 5: one settings file (.env, which compose reads for its ${VARIABLES}) for both.
    from serving.engine.server.cli import env_variables

    environment = SERVICES["serving-worker"]["environment"]
    passed = {name for name in environment if name.startswith("SERVING_WORKER_")}
    assert passed <= set(env_variables())
    listed = set(re.findall(r"^# (SERVING_WORKER_[A-Z_]+)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    # Its key comes from the secrets volume; its access log's level is make up's concern.
    assert listed - {"SERVING_WORKER_UVICORN_LOG_LEVEL"} <= passed
    for name in passed:
        assert environment[name] == f"${{{name}:-}}", "empty: the worker's own default"
    assert SERVICES["web"]["environment"]["GATEWAY_BUCKET_BURST"] == "${GATEWAY_BUCKET_BURST:-}"
