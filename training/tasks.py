"""Celery tasks of the training pipeline: thin wrappers named after the services they call.

`dataset_validate`, `training_jobs_sweep` and `uploads_expire` are routed to the `quick` queue,
`training_job_run` to the `training` queue (settings.CELERY_TASK_ROUTES), each with a worker of its
own, so long jobs never hold up quick work. Late acks and reject-on-worker-lost (settings) put a job's task back on the queue when its
worker dies; the service makes any redelivery safe.

Nothing here imports the trainer at a worker's start: the pool process whose task needs torch,
transformers and PEFT imports them then, so a worker that runs no such task never pays their
seconds of CPU (docs/training.md, "Running workers").
"""

from __future__ import annotations

from celery import Task, shared_task
from celery.signals import worker_ready

from training import conf, datasets, run, scratch, sweep, uploads


# The check stops itself between lines past TRAINING_VALIDATION_TIMEOUT_SECONDS (training.validation);
# these limits bound a single line that never comes back. Past the soft one the check is interrupted
# (SoftTimeLimitExceeded, a signal to the pool process), which ends the dataset invalid; past the hard
# one the pool process is killed (a regular expression in C takes no signal), and the sweep ends the
# dataset. The slot is free again either way.
VALIDATION_LINE_GRACE_SECONDS = 60


@shared_task(name="training.tasks.dataset_validate", ignore_result=True,
             soft_time_limit=conf.setting_int("TRAINING_VALIDATION_TIMEOUT_SECONDS") + VALIDATION_LINE_GRACE_SECONDS,
             time_limit=conf.setting_int("TRAINING_VALIDATION_TIMEOUT_SECONDS") + 2 * VALIDATION_LINE_GRACE_SECONDS)
def dataset_validate(dataset_id: int) -> None:
    datasets.dataset_validate(dataset_id=dataset_id)


@shared_task(bind=True, name="training.tasks.training_job_run", ignore_result=True, max_retries=None)
def training_job_run(self: Task, job_id: int) -> None:
    claim = run.training_job_run(job_id=job_id)
    if claim.retry_in is not None:
        # Another delivery's run still reports: look again once its lease would have expired. Or this
        # worker is stopping (training.worker_stop): at once (0), for the next worker to take.
        raise self.retry(countdown=claim.retry_in)


@shared_task(name="training.tasks.training_jobs_sweep", ignore_result=True)
def training_jobs_sweep() -> None:
    sweep.training_jobs_sweep()


@shared_task(name="training.tasks.uploads_expire", ignore_result=True)
def uploads_expire() -> None:
    uploads.uploads_expire()


@worker_ready.connect
def scratch_sweep(**_: object) -> None:
    """A starting worker removes what killed runs on this host left in the scratch folder."""
    scratch.training_scratch_sweep()
