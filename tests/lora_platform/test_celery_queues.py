"""Quick work and training have a queue and a worker each, in `make up` (the launcher's children) and in
docker-compose.yml alike, and every task is routed by name to a queue some worker consumes (issue 37,
item 5: one worker at concurrency 1 served both, so a training job held another tenant's 17 KB
validation for 14 minutes). No worker is started: the command lines are read as they would run."""

from __future__ import annotations

from pathlib import Path

import yaml

from lora_platform import launcher
from lora_platform.celery import app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_SERVICES: dict[str, dict] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def option(argv: list[str], *names: str) -> str | None:
    for name in names:
        if name in argv:
            return argv[argv.index(name) + 1]
    return None


def celery_workers(commands: dict[str, list[str]]) -> dict[str, tuple[frozenset[str], int, bool]]:
    """name → (queues it consumes, its concurrency, whether it runs beat) for each `celery worker` command."""
    workers = {}
    for name, argv in commands.items():
        if "celery" not in " ".join(argv) or "worker" not in argv:
            continue
        queues = option(argv, "--queues", "-Q")
        assert queues, f"{name} consumes Celery's default queue, not a named one: {argv}"
        workers[name] = (frozenset(queues.split(",")), int(option(argv, "--concurrency", "-c") or 0),
                         "--beat" in argv or "-B" in argv)
    return workers


def launcher_workers() -> dict[str, tuple[frozenset[str], int, bool]]:
    return celery_workers({child.name: child.argv for child in launcher.child_processes()})


def compose_workers() -> dict[str, tuple[frozenset[str], int, bool]]:
    return celery_workers({name: service.get("command") or [] for name, service in COMPOSE_SERVICES.items()})


def platform_tasks() -> list[str]:
    app.loader.import_default_modules()  # what a worker imports at start: the apps' tasks modules
    return sorted(name for name in app.tasks if not name.startswith("celery."))


def test_every_task_is_routed_by_name_to_a_queue_both_deployments_consume() -> None:
    tasks = platform_tasks()
    assert "training.tasks.dataset_validate" in tasks and "training.tasks.training_job_run" in tasks
    for workers in (launcher_workers(), compose_workers()):
        consumed = set().union(*(queues for queues, _, _ in workers.values()))
        for name in tasks:
            route = app.conf.task_routes.get(name)
            assert route and route["queue"] in consumed, (name, route, consumed)
            # What Celery's router decides when the task is sent, by name as training.dispatch sends it.
            assert app.amqp.router.route({}, name)["queue"].name == route["queue"], name
    # A task nobody routed (Celery's own) lands on a consumed queue too, never on a `celery` queue.
    assert app.conf.task_default_queue == "quick"


def test_validation_and_training_have_a_queue_and_a_worker_each() -> None:
    routes = app.conf.task_routes
    assert routes["training.tasks.dataset_validate"]["queue"] == "quick"
    assert routes["training.tasks.training_job_run"]["queue"] == "training"
    for workers in (launcher_workers(), compose_workers()):
        # No worker serves both queues: one that did held validation behind training.
        assert sorted(sorted(queues) for queues, _, _ in workers.values()) == [["quick"], ["training"]], workers
        quick = next(value for value in workers.values() if value[0] == {"quick"})
        training = next(value for value in workers.values() if value[0] == {"training"})
        assert quick[1] >= 2, "one large file would hold every other tenant's validation"
        assert training[1] == 1
        assert not training[2], "beat runs beside the quick work, not in the training worker"


def test_the_launcher_runs_beat_once_and_gives_the_training_worker_time_to_checkpoint() -> None:
    children = {child.name: child for child in launcher.child_processes()}
    workers = launcher_workers()
    assert [name for name, (_, _, beat) in workers.items() if beat] == ["worker"]
    assert workers["training-worker"][0] == {"training"}
    assert children["training-worker"].stop_timeout_s == launcher.WORKER_STOP_TIMEOUT_S
    # Two workers on one host: distinct node names, or `celery inspect` and the launcher's tests mix them up.
    hostnames = [option(children[name].argv, "--hostname") for name in workers]
    assert len(set(hostnames)) == 2 and all(hostnames)


def test_compose_gives_the_training_worker_time_to_checkpoint_and_probes_both() -> None:
    training = COMPOSE_SERVICES["training-worker"]
    assert training["stop_grace_period"] == "2m"
    for name in compose_workers():
        assert "inspect ping" in " ".join(COMPOSE_SERVICES[name]["healthcheck"]["test"]), name
