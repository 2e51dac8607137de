"""Sends the training pipeline's Celery tasks by name, so the domain imports none of training.tasks.

training.tasks imports the service modules (training.datasets, run, sweep, scratch); they send
tasks through here, by the names the tasks register (`training.tasks.<name>`), so the dependency
runs one way. Routing (CELERY_TASK_ROUTES)
applies to a task sent by name as to one sent through its function. With CELERY_TASK_ALWAYS_EAGER
(an operator's switch), a task runs in place as `delay()` would run it.

Every task of the pipeline is `ignore_result=True`; a task sent by name must say so itself, or
Celery subscribes to its result on Redis at send time, which hangs while Redis is frozen.

The app is Celery's current one (the project's, lora_platform.celery, made current when the settings
package loads), as `shared_task` finds it for the tasks: no app imports the project package.
"""

from __future__ import annotations

from celery import current_app as app

VALIDATE_DATASET = "training.tasks.dataset_validate"
RUN_JOB = "training.tasks.training_job_run"


def task_send(name: str, *args: object) -> None:
    """Sends task `name` with `args` (raises what the broker raises when it cannot be reached)."""
    if app.conf.task_always_eager:
        app.tasks[name].apply_async(args)
        return
    app.send_task(name, args=args, ignore_result=True)
